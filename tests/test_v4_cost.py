"""The V4 terms of the cost model (torch-free), `mlakit cost` / `mlakit cache` on a V4 model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlakit.cost.v4 import TERMS, compare, layer_terms, model_cost, sequence_bytes
from mlakit.v4.config import V4Config

PRO = V4Config.preset("deepseek-v4-pro")
M = 1 << 20


def test_terms_are_the_arithmetic():
    h, hd = 128, 512
    hca = layer_terms(PRO, "heavily_compressed_attention", M)
    csa = layer_terms(PRO, "compressed_sparse_attention", M)
    assert set(hca) == set(csa) == set(TERMS)
    assert hca["window"]["macs"] == 2 * h * hd * 128
    assert hca["compressed_dense"]["macs"] == 2 * h * hd * ((M + 1) // 128)
    assert csa["compressed_sparse"]["macs"] == 2 * h * hd * 1024
    assert csa["indexer"]["macs"] == 1536 * 64 * 128 + 7168 * 64 + ((M + 1) // 4) * 64 * 129
    assert hca["indexer"]["macs"] == csa["compressed_dense"]["macs"] == 0
    # short context: every entry fits in index_topk, no indexer work; the window holds t+1 keys
    short = layer_terms(PRO, "compressed_sparse_attention", 99)
    assert short["indexer"]["macs"] == 0 and short["compressed_sparse"]["macs"] == 2 * h * hd * 25
    assert short["window"]["macs"] == 2 * h * hd * 100


def test_v4_pro_against_v32_at_1m():
    rows = compare(PRO, M)
    v4 = rows["deepseek-v4-pro"]
    # mlakit's counts (attention layers only): 22% of V3.2's FLOPs, 11.5% of its bf16 cache
    assert 0.21 < v4["flops_vs_v3.2"] < 0.23
    assert 0.11 < v4["cache_vs_v3.2"] < 0.12
    assert rows["deepseek-v3"]["flops_vs_v3.2"] > 10
    total = model_cost(PRO, M)
    assert total["macs"] == sum(t["macs"] for t in total["terms"].values())
    seq = sequence_bytes(PRO, M)
    assert (
        seq["total"]
        == 30 * seq["per_layer"]["compressed_sparse_attention"]
        + 31 * seq["per_layer"]["heavily_compressed_attention"]
    )


def _cli(*args):
    out = subprocess.run(
        [sys.executable, "-m", "mlakit.cli", *args], capture_output=True, text=True, check=False, cwd="."
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("cmd", ["cost", "cache"])
def test_cli_json(cmd):
    extra = ["--new", "1"] if cmd == "cost" else []
    r = json.loads(_cli(cmd, "--model", "deepseek-v4-pro", "--context", "1M", *extra, "--json"))
    assert r["context"] == M
    if cmd == "cost":
        for kind in ("compressed_sparse_attention", "heavily_compressed_attention"):
            assert set(r["per_layer_type"][kind]["terms"]) == set(TERMS)
        assert set(r["compare"]) == {"deepseek-v4-pro", "deepseek-v3.2", "deepseek-v3"}
    else:
        assert r["bytes_per_token_per_layer"]["heavily_compressed_attention"] == 8.0
        assert r["compare"]["deepseek-v3.2"]["cache_bytes_per_token_per_layer"] == 1408


def test_cli_text_and_torch_free():
    text = _cli("cost", "--model", "deepseek-v4-flash", "--context", "128K", "--new", "1")
    assert "compressed_sparse" in text and "of V3.2" in text
    code = "import sys, mlakit.cost.v4, mlakit.commands.v4; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=".")


def test_layer_type_names_match_the_config():
    from mlakit.cost import v4 as cost_v4
    from mlakit.v4 import config

    assert cost_v4.LAYER_TYPES == config.LAYER_TYPES


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlakit.cli", *args], capture_output=True, text=True, check=False, cwd="."
    )


@pytest.mark.parametrize("cmd", ["cost", "cache"])
def test_cli_refuses_context_0_on_v4(cmd):
    extra = ["--new", "1"] if cmd == "cost" else []
    out = _run(cmd, "--model", "deepseek-v4-pro", "--context", "0", *extra)
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.strip() == f"mlakit {cmd}: error: --context must be >= 1, got 0"


def test_cli_cost_says_roofline_flags_are_ignored_on_v4():
    plain = _run("cost", "--model", "deepseek-v4-pro", "--context", "4K", "--new", "1", "--json")
    assert plain.returncode == 0 and plain.stderr == ""
    flags = ["--machine", "a100", "--counting", "independent", "--fused"]
    out = _run("cost", "--model", "deepseek-v4-pro", "--context", "4K", "--new", "1", "--json", *flags)
    assert out.returncode == 0 and json.loads(out.stdout) == json.loads(plain.stdout)
    assert len(out.stderr.strip().splitlines()) == 1
    assert "--machine, --counting, --fused ignored" in out.stderr

"""mlakit calibrate: it says how long it will take, shows progress, saves nothing that fails its own
checks (the crossover monotone within noise; auto ignores a profile marked inconsistent); `mlakit check`
picks its threads as bench does."""

from __future__ import annotations

import json
import os

import pytest
import torch

import mlakit.bench.calibrator as cal
from mlakit.bench.calibrate_plan import cell_seconds, estimate_seconds, format_duration, planned_cells
from mlakit.bench.timing import Timing
from mlakit.calibration import CrossoverProfile, attach, find_profile, profile_path, widths_of
from mlakit.cli import main
from mlakit.config import MLAConfig
from mlakit.cost import MachineProfile

TINY = MLAConfig(
    hidden_size=64,
    num_heads=8,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    name="tiny",
)
HF_CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "num_attention_heads": 8,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_hidden_layers": 1,
}
FAKE_MACHINE = MachineProfile("fake", {"fp32": 1e11, "bf16": 2e11}, 1e10, "test")


@pytest.fixture
def tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cal, "_machine", lambda device: FAKE_MACHINE)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIG))
    return str(path)


def profile(points, consistent=None) -> CrossoverProfile:
    extra = {} if consistent is None else {"consistent": consistent}
    return CrossoverProfile("tiny", widths_of(TINY), "fp32", "cpu", points=points, max_new=64, extra=extra)


# ---- the estimate


@pytest.mark.parametrize(
    ("call_s", "calls"),
    [(1e-4, 1 + 5), (0.3, 1 + 4), (2.0, 1 + 2)],
    ids=["fast-capped-by-repeats", "budget", "slow-min-repeats"],
)
def test_cell_takes_warmup_then_repeats_until_the_budget(call_s, calls):
    timing = Timing(warmup=1, repeats=5, min_repeats=2, budget_s=1.0)
    assert cell_seconds(call_s, timing) == pytest.approx(calls * call_s)


def test_estimate_counts_every_cell_the_search_may_visit():
    cells = planned_cells((256, 1024), [1, 4, 16])
    assert len(cells) == 2 * (3 + 1 + 4)
    timing = Timing(warmup=0, repeats=1, min_repeats=1, budget_s=0.01)
    est = estimate_seconds(TINY, FAKE_MACHINE, "fp32", 1, (256, 1024), [1, 4, 16], timing)
    assert 0 < est < 1  # microseconds of work per call at these widths
    assert format_duration(439) == "7 min 19 s" and format_duration(12.4) == "12 s"


def test_cli_prints_the_expected_duration_and_progress(tiny_model, capsys, tmp_path):
    args = ["calibrate", "--model", tiny_model, "--device", "cpu", "--dtype", "fp32", "--quick"]
    assert main([*args, "--context", "8", "--max-new", "4", "--out", str(tmp_path / "p.json")]) == 0
    err = capsys.readouterr().err
    assert "expected about" in err and "2 new-token counts" in err
    assert err.index("expected about") < err.index("mlakit calibrate (cells)")  # before any timing


# ---- the consistency checks


def test_an_inconsistent_profile_is_not_saved(tiny_model, capsys, tmp_path, monkeypatch):
    jumpy = profile(((256, 1.2), (1024, 83.7), (4096, None)), consistent=False)
    jumpy.extra["warnings"] = ["crossover jumps from 1.2 at 256 to 83.7 at 1024"]
    monkeypatch.setattr(cal, "calibrate", lambda opts: (jumpy, []))
    good = profile(((256, 12.0),))
    folder = tmp_path / "cache"
    good_path = good.save(profile_path(MLAConfig.resolve(tiny_model), "fp32", "cpu", str(folder)))
    args = ["calibrate", "--model", tiny_model, "--device", "cpu", "--dtype", "fp32", "--quick"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "not saved" in out and "jumps from 1.2" in out and "saved /" not in out
    assert CrossoverProfile.load(good_path) == good  # the good profile stays
    assert main([*args, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["path"] is None


def test_monotone_check_on_the_issues_figures():
    assert cal.monotone_warnings(((256, 1.2), (1024, 83.7), (4096, None)), 512)
    assert cal.monotone_warnings(((256, 170.0), (1024, 171.0), (4096, 172.0)), 512) == []
    # near the largest count measured, "> max_new" is no jump
    assert cal.monotone_warnings(((8, 3.9), (32, None)), 4) == []


@pytest.mark.parametrize(
    ("points", "warned"),
    [
        ([(256, 135.0), (1024, 158.0)], False),
        ([(256, 52.6), (1024, None)], True),
        ([(256, 135.0), (1024, 40.0)], True),
        ([(256, None), (1024, 40.0)], True),
        ([(256, 30.0), (1024, 158.0)], True),
    ],
    ids=["model-like", "the-issue-52.6-then-none", "falls", "none-then-some", "jumps"],
)
def test_calibrate_monotone_within_noise(points, warned):
    assert bool(cal.monotone_warnings(points, 512)) is warned


def test_auto_ignores_a_profile_marked_inconsistent(tmp_path):
    from mlakit import MLAAttention

    marked = profile(((8, 3.0),), consistent=False)
    assert marked.decide(TINY, 100, 8) is None and not marked.consistent
    assert profile(((8, 3.0),)).decide(TINY, 100, 8) == "materialize"
    marked.save(profile_path(TINY, "fp32", "cpu", str(tmp_path)))
    assert find_profile(TINY, "fp32", "cpu", str(tmp_path)) is None
    layer = MLAAttention(TINY)
    assert attach(layer, str(tmp_path)) is None and layer.profile is None


# ---- mlakit check: bench's thread choice


def test_check_runs_one_thread_on_a_busy_machine(tiny_model, capsys, monkeypatch):
    old = torch.get_num_threads()
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 7.0, 7.0))
    torch.set_num_threads(2)
    try:
        args = ["check", "--model", tiny_model, "--prefill", "4", "--decode-steps", "1", "--json"]
        assert main(args) == 0
        d = json.loads(capsys.readouterr().out)
    finally:
        torch.set_num_threads(old)
    assert d["threads"] == 1 and "1 thread" in d["threads_reason"]
    assert (
        main(["check", "--model", tiny_model, "--prefill", "4", "--decode-steps", "1", "--threads", "1"]) == 0
    )
    assert "--threads 1 as asked" in capsys.readouterr().out

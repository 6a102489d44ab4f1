"""What makes a bench figure trustworthy on a busy machine: the thread choice, noise marks, peaks,
auto against its own path, calibrate's self-checks, the help text against the code."""

from __future__ import annotations

import pytest

from mlakit.bench.calibrator import monotone_warnings
from mlakit.bench.machine_state import MachineState, _choose, advisories
from mlakit.bench.report import summary_lines
from mlakit.bench.summary import same_path
from mlakit.bench.timing import QUICK_TIMING, Stats, stats_of


@pytest.mark.parametrize(
    ("requested", "load", "one", "every", "want"),
    [
        (None, 0.1, 2.0, 1.0, 2),  # free cores, threads help x2
        (None, 2.5, 2.0, 1.0, 1),  # busy cores
        (None, 0.1, 2.0, 1.9, 1),  # threads barely help
        (None, 0.1, 1.7, 32.0, 1),  # spinning threads: 2 threads far slower
        (2, 2.5, 1.7, 32.0, 2),  # asked for: kept, and the reason says so
    ],
    ids=["free-fast", "busy", "no-gain", "spin", "asked"],
)
def test_thread_choice(requested, load, one, every, want):
    threads, reason = _choose(requested, "cpu", 2, load, 2, one, every)
    assert threads == want and f"load {load:.1f} on 2 cores" in reason


def test_advisory_names_omp_wait_policy_when_threads_spin():
    state = MachineState(2, 2.5, 2, 1.7, 32.0, None, 2, "asked")
    text = " ".join(advisories(state))
    assert "OMP_WAIT_POLICY=PASSIVE" in text and "busy" in text
    assert not advisories(MachineState(2, 0.0, 2, 2.0, 1.0, "PASSIVE", 2, "free"))


def test_quick_timing_never_times_one_call():
    assert QUICK_TIMING.min_repeats >= 3


@pytest.mark.parametrize(
    ("seconds", "spread"), [([1.0, 1.0, 1.0], 0.0), ([1.0, 2.0, 1.5], 2 / 3)], ids=["flat", "wide"]
)
def test_spread(seconds, spread):
    assert stats_of(seconds).spread == pytest.approx(spread)


def _row(backend, ms, spread=0.0, **kw):
    return dict(backend=backend, batch=1, cached=256, new=1, dtype="fp32", ms_median=ms, spread=spread, **kw)


@pytest.mark.parametrize(
    ("auto_ms", "spread", "within"),
    [(1.03, 0.02, True), (1.3, 0.02, False), (1.3, 0.4, True)],
    ids=["close", "apart", "noisy"],
)
def test_auto_against_its_own_path(auto_ms, spread, within):
    rows = [_row("mlakit-absorb", 1.0, spread), _row("mlakit-auto", auto_ms, 0.0, path="absorb")]
    (check,) = same_path(rows)
    assert check["within_noise"] is within and check["ratio"] == pytest.approx(auto_ms)


def _doc(pct_bw):
    decode = {
        "batch": 1,
        "context": 256,
        "new": 1,
        "absorb_ms": 1.0,
        "slower_than_absorb": {},
        "absorb_core_pct_peak_flops": None,
        "absorb_pct_peak_bandwidth": pct_bw,
        "absorb_roofline_fraction": pct_bw / 100,
        "absorb_spread": 0.0,
    }
    crossover = {
        "batch": 1,
        "context": 256,
        "measured": None,
        "measured_max_new": 16,
        "counting": "causal",
        "flop_model": 135.0,
        "roofline": None,
        "noisy": False,
    }
    auto = {"cells": 0}
    return {
        "summary": {"crossover": [crossover], "decode": [decode], "auto": auto, "same_path": []},
        "rows": [],
    }


@pytest.mark.parametrize(
    ("pct", "shown"), [(40.0, "40% of peak bandwidth"), (108.0, "unreliable")], ids=["ok", "over"]
)
def test_no_figure_above_the_peak(pct, shown):
    text = "\n".join(summary_lines(_doc(pct)))
    assert shown in text and "108%" not in text and "causal counting" in text


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
    assert bool(monotone_warnings(points, 512)) is warned


def test_bench_help_defaults_match_the_grid():
    from mlakit.bench.grid import DEFAULT_GRID, QUICK_GRID
    from mlakit.commands.bench import DEFAULT_LISTS, QUICK_LISTS

    for lists, grid in ((DEFAULT_LISTS, DEFAULT_GRID), (QUICK_LISTS, QUICK_GRID)):
        assert lists == {"batch": grid.batch, "context": grid.context, "new": grid.new}


def test_stats_spread_zero_for_one_call():
    assert Stats(1.0, 1.0, 1.0, 1).spread == 0.0


@pytest.mark.parametrize(
    ("value", "label"), [(1, "1"), (16, "16"), (1024, "1K"), (4096, "4K"), (1 << 20, "1M"), (1536, "1536")]
)
def test_plot_ticks_read_as_tokens(value, label):
    from mlakit.bench.plots import token_label

    assert token_label(value) == label


def test_cost_local_predicts_at_the_rate_mlakit_runs(monkeypatch, capsys):
    import json

    import torch

    import mlakit.profile as prof
    from mlakit.cli import main
    from mlakit.cost import MachineProfile
    from mlakit.ops import common
    from mlakit.ops.common import compute_dtype

    native = MachineProfile("local-cpu", {"fp32": 8.9e10, "bf16": 6.2e8}, 1.6e10)
    monkeypatch.setattr(prof, "local_profile", lambda device="cpu", refresh=False: native)
    # the profile is an AVX2-only CPU's (bf16 at 0.62 GFLOP/s): run as on one wherever this runs
    monkeypatch.setitem(common._CPU_FAST, torch.bfloat16, False)
    assert main(["cost", "--context", "1K", "--new", "128", "--machine", "local", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    native_bf16 = compute_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    want = native.peak_flops["bf16" if native_bf16 else "fp32"]
    assert r["machine"]["peak_flops"]["bf16"] == want
    assert r["totals"]["materialize"]["time_s"] < 10  # not minutes at 0.62 GFLOP/s


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(220.0, "220 s"), (1.25, "1.25 s"), (0.00123, "1.23 ms"), (4.5e-6, "4.5 µs"), (3e-9, "3 ns")],
)
def test_times_print_in_fitting_units(seconds, text):
    from mlakit.cost import format_seconds

    assert format_seconds(seconds) == text

"""benchmarks/vllm_peer.py's own logic (no server started): the run a repeated workload reports, and
its arguments refused before anything runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_peer.py"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("vllm_peer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def runs(*tps):
    return [{"output_throughput": t, "median_tpot_ms": 100.0 / t} for t in tps]


@pytest.mark.parametrize(
    "tps, want",
    [((7.0,), 7.0), ((3.0, 9.0, 5.0), 5.0), ((4.0, 1.0, 8.0, 6.0), 4.0), ((2.0, 2.0), 2.0)],
    ids=["one", "three", "four-lower-middle", "ties"],
)
def test_a_repeated_workload_reports_its_median_run(peer, tps, want):
    row = peer.median_run(runs(*tps))
    assert row["output_throughput"] == want
    assert row["median_tpot_ms"] == 100.0 / want  # the whole run's figures, not a mix of runs
    if len(tps) > 1:
        assert row["runs"] == list(tps)
    else:
        assert "runs" not in row


def test_repeat_below_one_is_refused_first(peer, capsys):
    with pytest.raises(SystemExit) as e:
        peer.main(["--venv", "/nonexistent", "--repeat", "0"])
    assert e.value.code == 2
    assert "--repeat: got 0, expected >= 1" in capsys.readouterr().err

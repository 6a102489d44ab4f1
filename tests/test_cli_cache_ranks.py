"""`mlakit cache --cp/--tp`: latent bytes per rank, by hand."""

import json

import pytest

from mlakit.cli import main


def run_json(capsys, *argv):
    assert main(["cache", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tp_replicates_and_cp_splits(capsys):
    # V3 bf16: 576 values · 2 bytes · 61 layers = 70,272 bytes per token
    d = run_json(capsys, "--model", "deepseek-v3", "--context", "131072", "--tp", "8")
    assert d["per_rank"]["mla_bytes_per_rank"] == [131072 * 70272] * 8
    d = run_json(capsys, "--model", "deepseek-v3", "--context", "131072", "--cp", "8", "--tp", "2")
    ranks = d["per_rank"]["mla_bytes_per_rank"]
    assert len(ranks) == 16 and sum(ranks) == 2 * 131072 * 70272
    assert max(ranks) == 131072 // 8 * 70272


def test_fp8_per_rank_uses_656_bytes(capsys):
    d = run_json(capsys, "--model", "deepseek-v3", "--context", "1000", "--cp", "2", "--dtype", "fp8")
    assert sum(d["per_rank"]["mla_bytes_per_rank"]) == 1000 * 656 * 61


def test_no_per_rank_without_flags(capsys):
    assert "per_rank" not in run_json(capsys, "--context", "10")


@pytest.mark.parametrize("flag", ["--cp", "--tp"])
def test_bad_rank_counts_are_refused(capsys, flag):
    assert main(["cache", flag, "0"]) == 2
    assert f"{flag[2:]} must be a positive integer" in capsys.readouterr().err

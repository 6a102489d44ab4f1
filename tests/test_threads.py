"""Compute threads: --threads checked before any work, the default every usable core."""

from __future__ import annotations

import os

import pytest
import torch

from mlakit.cli import main
from mlakit.engine.threads import check_threads, set_threads, usable_cores


def test_the_default_is_every_core_the_process_may_use():
    want = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert usable_cores() == want == check_threads(None)
    assert check_threads(3) == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"--threads must be an integer >= 1"):
        check_threads(bad)


def test_set_threads_sets_torchs_pool():
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--port", "0"]])
def test_the_cli_refuses_a_bad_thread_count_in_one_line_before_loading(command, capsys):
    assert main([*command, "--threads", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--threads must be an integer >= 1, got 0") and len(err) == 1

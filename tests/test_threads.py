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


def _affinity_of_threads() -> dict[int, set[int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            line = next(x for x in f if x.startswith("Cpus_allowed_list"))
        out[int(tid)] = line.split(":", 1)[1].strip()
    return out


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no thread affinity on this platform")
def test_bind_threads_pins_the_calling_threads_team():
    """On a thread of its own (its OpenMP team is its own): thread i of the team runs on cpus[i] only,
    and the GEMMs that follow run on that very team (no new threads appear)."""
    import threading

    from mlakit.engine.threads import (
        _gomp_path,
        bind_threads,
        compute_cpus,
        enter_compute_thread,
        plan_threads,
    )

    if _gomp_path() is None:
        pytest.skip("no GNU OpenMP runtime in this process")
    cores = sorted(os.sched_getaffinity(0))
    n = min(2, len(cores))
    assert compute_cpus(n) == cores[:n]
    assert compute_cpus(len(cores) + 1) is None  # oversubscribed: never pinned
    result = {}

    def run():
        torch.set_num_threads(n)
        result["bound"] = bind_threads(cores[:n])
        result["mine"] = os.sched_getaffinity(0)
        before = set(os.listdir("/proc/self/task"))
        x = torch.randn(512, 512)
        for _ in range(3):
            x @ x
        result["new"] = set(os.listdir("/proc/self/task")) - before
        result["line"] = enter_compute_thread()

    plan_threads(n)  # where the command plans them: before the loop thread starts
    t = threading.Thread(target=run)
    try:
        t.start()
        t.join()
    finally:
        plan_threads(None, bind=False)
    assert result["bound"] == cores[:n]
    assert result["mine"] == {cores[0]}  # the calling thread is thread 0
    assert not result["new"]
    assert "pinned to cores" in result["line"]
    assert os.sched_getaffinity(0) == set(cores)  # this (another) thread is untouched


def test_one_openmp_runtime_in_the_process():
    """torch's GEMMs and mlakit's fused core share one OpenMP runtime, hence one pool of threads."""
    from mlakit.engine.threads import _gomp_path
    from mlakit.ops import cpu_core

    cpu_core.available()  # loads the fused core where this CPU runs it
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(libs) <= 1, libs
    assert (_gomp_path() is None) == (not any("libgomp" in x for x in libs))


def test_compute_thread_runs_calls_in_order_on_one_thread_and_hands_back_errors():
    import threading

    from mlakit.engine.threads import ComputeThread

    ct = ComputeThread(name="test-compute")
    try:
        assert "compute threads" in ct.line  # what enter_compute_thread said on it
        seen = []
        assert ct.call(lambda a, b=0: a + b, 2, b=3) == 5
        futures = [ct.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(5)]
        for f in futures:
            f.result(10)
        assert [i for i, _ in seen] == list(range(5))
        assert {t for _, t in seen} == {ct.ident()} and ct.ident() != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            ct.call(lambda: 1 / 0)
        assert ct.call(lambda: "still here") == "still here"  # an error does not stop the thread
    finally:
        ct.close(10)
    with pytest.raises(RuntimeError, match="compute thread has stopped"):
        ct.submit(lambda: None)

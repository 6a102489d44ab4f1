"""How busy this machine is before timing anything, and the thread count that gives honest figures.

On a machine whose cores are already taken, torch's intra-op threads wait for each other; OpenMP
threads spin while they wait (OMP_WAIT_POLICY=ACTIVE behaviour, the default of many builds), so a
2-thread step can run many times slower than a 1-thread one and the slowdown lands unevenly on
backends, reversing comparisons. Measured here: the load average against the cores we may use, and
a short fp32 GEMM at 1 thread and at all threads. The decision: all threads when they beat one
thread clearly, else 1 thread. OMP_WAIT_POLICY is read when torch is imported, so it cannot be
changed from inside the run: where it is unset and threads > 1, the run says to set it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

PROBE_SIZE = 384  # fp32 GEMM of ~0.1 GFLOP: milliseconds on one core
PROBE_CALLS = 7
SPEEDUP_NEEDED = 1.25  # all threads must beat one thread by this much to be used


@dataclass(frozen=True)
class MachineState:
    cores: int  # cores this process may run on
    load: float  # 1-minute load average before the run
    default_threads: int  # torch's intra-op threads before the run
    probe_ms_1: float  # median ms of the probe GEMM on 1 thread
    probe_ms_all: float  # ... on default_threads threads
    omp_wait_policy: str | None  # the environment's OMP_WAIT_POLICY (read by torch at import)
    threads: int  # the choice
    reason: str  # why, in words

    @property
    def busy(self) -> bool:
        return self.load >= self.cores - 0.5

    def to_dict(self) -> dict:
        return {**asdict(self), "busy": self.busy}


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _probe_ms(threads: int) -> float:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen)
        b = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen)
        torch.mm(a, b)
        times = []
        for _ in range(PROBE_CALLS):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    finally:
        torch.set_num_threads(old)


def measure_state(requested: int | None, device: str = "cpu") -> MachineState:
    """The state and the thread choice (`requested` wins when given; the reason then says so)."""
    n, load = cores(), os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    default = torch.get_num_threads()
    one = _probe_ms(1) if device == "cpu" else 0.0
    every = _probe_ms(default) if device == "cpu" and default > 1 else one
    policy = os.environ.get("OMP_WAIT_POLICY")
    threads, reason = _choose(requested, device, n, load, default, one, every)
    return MachineState(n, load, default, one, every, policy, threads, reason)


def _choose(requested, device, n, load, default, one, every) -> tuple[int, str]:
    state = f"load {load:.1f} on {n} cores; probe GEMM {one:.2f} ms on 1 thread, {every:.2f} ms on {default}"
    if requested is not None:
        return requested, f"--threads {requested} as asked ({state})"
    if device != "cpu":
        return default, f"torch's {default} host threads (the work runs on {device})"
    if default <= 1:
        return 1, f"1 thread: torch's default here ({state})"
    if every * SPEEDUP_NEEDED <= one and load < n - 0.5:
        return (
            default,
            f"{default} threads: they beat 1 thread x{one / every:.2f} and the cores are free ({state})",
        )
    why = "the cores are busy" if load >= n - 0.5 else f"{default} threads gain only x{one / every:.2f}"
    return 1, f"1 thread: {why}, so threads would wait on each other and skew comparisons ({state})"


def advisories(state: MachineState) -> list[str]:
    """Lines to print beside the figures when the setting may distort them."""
    out = []
    if state.threads > 1 and state.omp_wait_policy is None:
        out.append(
            f"note: {state.threads} threads with OMP_WAIT_POLICY unset: waiting OpenMP threads spin; on a "
            "busy machine rerun with OMP_WAIT_POLICY=PASSIVE (read when torch is imported) or --threads 1"
        )
    if state.busy:
        out.append(f"note: the machine was busy (load {state.load:.1f} on {state.cores} cores): expect noise")
    return out

"""Warm-up, repeats, median and min/max of a Step; the device is synchronized around every call."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from mlakit.bench.backends import Step


@dataclass(frozen=True)
class Timing:
    warmup: int = 1  # untimed calls first (allocations, lazy weights, kernel selection)
    repeats: int = 5  # timed calls at most
    min_repeats: int = 2  # timed calls at least, whatever the budget
    budget_s: float = 1.0  # stop repeating once the timed calls of a cell took this long

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_repeats < 1 or self.repeats < self.min_repeats or self.budget_s <= 0:
            raise ValueError(
                f"timing needs warmup >= 0, 1 <= min_repeats <= repeats and budget_s > 0, got {self}"
            )

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("warmup", "repeats", "min_repeats", "budget_s")}


DEFAULT_TIMING = Timing()
QUICK_TIMING = Timing(warmup=1, repeats=3, min_repeats=1, budget_s=0.5)


@dataclass(frozen=True)
class Stats:
    ms_median: float
    ms_min: float
    ms_max: float
    repeats: int


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(step: Step, device: torch.device) -> float:
    step.reset()
    synchronize(device)
    t0 = time.perf_counter()
    step.run()
    synchronize(device)
    return time.perf_counter() - t0


def _enough(seconds: list[float], timing: Timing) -> bool:
    return len(seconds) >= timing.min_repeats and sum(seconds) >= timing.budget_s


def time_step(step: Step, device: torch.device, timing: Timing = DEFAULT_TIMING) -> Stats:
    seconds: list[float] = []
    first = 0.0
    for _ in range(timing.warmup):
        first = _call(step, device)
    # on a CPU a call past the whole budget is arithmetic, not warm-up (the gate already ran every
    # code path and nothing is compiled or autotuned): it counts, and the cell costs one call less
    if timing.warmup and device.type == "cpu" and first >= timing.budget_s:
        seconds.append(first)
    while len(seconds) < timing.repeats and not _enough(seconds, timing):
        seconds.append(_call(step, device))
    ms = [s * 1e3 for s in seconds]
    return Stats(statistics.median(ms), min(ms), max(ms), len(ms))

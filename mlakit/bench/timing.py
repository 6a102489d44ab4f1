"""Warm-up, repeats, median and min/max of a Step; the device is synchronized around every call.

The spread of a cell is (max − min) / median of its timed calls. Where it exceeds `noisy_spread`
the cell takes more calls (up to `noisy_repeats`); a cell still that spread is marked noisy, and
the report says so beside its figure.
"""

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
    noisy_spread: float = 0.2  # (max - min) / median above this: take more calls ...
    noisy_repeats: int = 9  # ... up to this many, within 3 budgets

    def __post_init__(self) -> None:
        bad = self.warmup < 0 or self.min_repeats < 1 or self.repeats < self.min_repeats or self.budget_s <= 0
        if bad or self.noisy_repeats < self.repeats or not self.noisy_spread > 0:
            raise ValueError(
                f"timing needs warmup >= 0, 1 <= min_repeats <= repeats and budget_s > 0, got {self}"
            )

    def to_dict(self) -> dict:
        keys = ("warmup", "repeats", "min_repeats", "budget_s", "noisy_spread", "noisy_repeats")
        return {k: getattr(self, k) for k in keys}


DEFAULT_TIMING = Timing()
# --quick: a smaller grid and budget, but still 3 calls per cell (one call has no spread to report)
QUICK_TIMING = Timing(warmup=1, repeats=3, min_repeats=3, budget_s=0.5, noisy_repeats=6)


@dataclass(frozen=True)
class Stats:
    ms_median: float
    ms_min: float
    ms_max: float
    repeats: int

    @property
    def spread(self) -> float:
        """(max − min) / median of the timed calls; 0 for one call."""
        return (self.ms_max - self.ms_min) / self.ms_median if self.ms_median > 0 else 0.0


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
    while (
        _noisy(seconds, timing) and len(seconds) < timing.noisy_repeats and sum(seconds) < 3 * timing.budget_s
    ):
        seconds.append(_call(step, device))
    return stats_of(seconds)


def _noisy(seconds: list[float], timing: Timing) -> bool:
    return len(seconds) > 1 and stats_of(seconds).spread > timing.noisy_spread


def stats_of(seconds: list[float]) -> Stats:
    ms = [s * 1e3 for s in seconds]
    return Stats(statistics.median(ms), min(ms), max(ms), len(ms))


def time_interleaved(steps: list[Step], device: torch.device, timing: Timing = DEFAULT_TIMING) -> list[Stats]:
    """Time several steps call by call in turn (A B A B ...): a change of load hits them all alike."""
    for step in steps:
        _call(step, device)
    seconds: list[list[float]] = [[] for _ in steps]
    while len(seconds[0]) < timing.noisy_repeats and (
        len(seconds[0]) < max(3, timing.min_repeats) or sum(map(sum, seconds)) < timing.budget_s
    ):
        for out, step in zip(seconds, steps, strict=True):
            out.append(_call(step, device))
    return [stats_of(s) for s in seconds]

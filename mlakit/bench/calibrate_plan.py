"""What a calibration will cost before it starts, and whether what it measured may be followed.

The estimate times every cell the search may visit (both paths at 1, step, step², ... max_new per
context, the bracket's middle, and the two re-timings of each end) under the roofline of the machine
just measured, with the calls the timing rules take: warm-up, then repeats until the budget. It is an
upper bound of the search (which stops once materialize wins twice) and a lower bound of the noise
(a noisy cell takes up to three budgets).
"""

from __future__ import annotations

import math

from mlakit.bench.costs import row_terms
from mlakit.bench.timing import Timing
from mlakit.commands.time_limit import format_duration as format_duration  # re-exported
from mlakit.config import MLAConfig
from mlakit.cost import MachineProfile, term_times


def step_seconds(
    cfg: MLAConfig, machine: MachineProfile, dtype: str, batch: int, cached: int, new: int
) -> dict:
    """Predicted seconds of one call of each path's whole layer step at this cell."""
    row = {"batch": batch, "new": new, "cached": cached}
    out = {}
    for path in ("absorb", "materialize"):
        macs, nbytes = row_terms(cfg, row, dtype, path, None)
        out[path] = sum(t["time_s"] for t in term_times(macs, nbytes, machine, dtype).values())
    return out


def cell_seconds(call_s: float, timing: Timing) -> float:
    """Warm-up calls, then timed calls until the budget (at least min_repeats, at most repeats)."""
    timed = min(timing.repeats, max(timing.min_repeats, math.ceil(timing.budget_s / max(call_s, 1e-9))))
    return (timing.warmup + timed) * call_s


def planned_cells(contexts, counts: list[int]) -> list[tuple[int, int]]:
    """(cached, new) of every cell the search may time: the counts, one middle, two re-timed ends."""
    cells = []
    for cached in sorted(set(contexts)):
        cells += [(cached, n) for n in counts]
        cells += [(cached, counts[-1])]  # the bracket's middle, at most this wide
        cells += [(cached, counts[-1])] * 4  # two ends, each re-timed twice
    return cells


def estimate_seconds(
    cfg: MLAConfig, machine: MachineProfile, dtype: str, batch: int, contexts, counts, timing
) -> float:
    """Seconds the calibration should take on `machine` (see the module docstring for what it leaves out)."""
    total = 0.0
    for cached, new in planned_cells(contexts, counts):
        for call_s in step_seconds(cfg, machine, dtype, batch, cached, new).values():
            total += cell_seconds(call_s, timing)
    return total


def failed_checks(points, max_new: int) -> list[str]:
    """Why a measured profile must not steer mode="auto": the crossover barely moves with context
    (docs/cost-model.md), so a fall or a jump between neighbouring contexts is noise, not the machine."""
    from mlakit.bench.calibrator import monotone_warnings

    return monotone_warnings(points, max_new)

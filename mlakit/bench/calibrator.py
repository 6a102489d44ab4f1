"""Calibrate: this machine's peaks (mlakit.profile) and the measured crossover per context, saved as a
CrossoverProfile that `mode="auto"` follows.

Per context the new-token count grows by `step`× from 1 while absorb is faster, stops once
materialize has won at two counts in a row (or at `max_new`), and one more count is timed at the
geometric middle of the bracket; the crossover is read from those times like the bench's.

Then it checks itself: both ends of the bracket are timed twice more, the two paths call by call in
turn. Where both re-timings contradict the first, the first was the outlier and the re-timed figures
replace it; where the two re-timings contradict each other, the context is noise, not a crossover,
and is left out of the profile (named in `extra["unmeasured"]`). Crossovers that fall with context by
more than the noise allows, or jump, are named in `extra["warnings"]`. With no context left,
calibrate refuses to save a profile.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from mlakit.bench.backends import BACKENDS, PATHS
from mlakit.bench.context import DTYPES, BenchContext
from mlakit.bench.grid import Cell, Grid
from mlakit.bench.progress import progress
from mlakit.bench.run import torch_threads
from mlakit.bench.sweep import gate, time_cell
from mlakit.bench.timing import DEFAULT_TIMING, Timing, time_interleaved
from mlakit.calibration import CrossoverProfile, profile_path, widths_of
from mlakit.commands import plural
from mlakit.commands.time_limit import check_time_limit, over_limit
from mlakit.config import MLAConfig
from mlakit.cost import measured_crossover

ABSORB, MATERIALIZE = PATHS["absorb"], PATHS["materialize"]


@dataclass(frozen=True)
class CalibrateOptions:
    model: str | MLAConfig = "deepseek-v3"
    dtype: str = "fp32"
    device: str = "cpu"
    batch: int = 1
    contexts: tuple[int, ...] = (256, 1024, 4096)
    max_new: int = 512
    step: int = 4  # new-token counts 1, step, step², ... up to max_new
    timing: Timing = DEFAULT_TIMING
    measure_machine: bool = True
    progress: bool = True
    seed: int = 0
    threads: int | None = None  # torch intra-op threads; None: torch's setting
    max_minutes: float = 60.0  # refuse, before any cell is timed, a longer search estimate (0: never)


QUICK_CONTEXTS = (256, 1024)


def calibrate(opts: CalibrateOptions) -> tuple[CrossoverProfile, list[dict]]:
    """Measure and return the profile and the timed rows (nothing is written here)."""
    with torch_threads(opts.threads):
        return _calibrate(opts)


def _calibrate(opts: CalibrateOptions) -> tuple[CrossoverProfile, list[dict]]:
    if opts.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
    if opts.step < 2 or opts.max_new < 1 or opts.batch < 1 or not opts.contexts:
        raise ValueError(f"calibrate needs step >= 2, max_new >= 1, batch >= 1 and contexts, got {opts}")
    cfg = MLAConfig.resolve(opts.model)
    machine = _machine(opts.device) if opts.measure_machine else None
    if machine is not None and opts.progress:
        _announce(cfg, machine, opts)
    ctx = BenchContext(cfg, DTYPES[opts.dtype], opts.device, seed=opts.seed)
    paths = [BACKENDS[ABSORB], BACKENDS[MATERIALIZE]]
    passed, verdicts = gate(ctx, Grid((opts.batch,), tuple(opts.contexts), (1,)), paths)
    failed = [v for v in verdicts if not v.ok]
    if failed:
        raise ValueError(f"calibrate: {failed[0].backend} disagrees with the reference: {failed[0].error}")
    rows: list[dict] = []
    counts = _counts(opts.step, opts.max_new)
    bar = progress(len(set(opts.contexts)) * len(counts), "mlakit calibrate (cells)", opts.progress)
    try:
        for cached in sorted(set(opts.contexts)):
            rows += _search(ctx, opts, cached, bar)
    finally:
        bar.close()
    measured = {t: measured_crossover(rows, t, opts.batch, opts.dtype) for t in sorted(set(opts.contexts))}
    unmeasured = {t: why for t in measured if (why := _confirm(ctx, opts, t, rows, measured[t]))}
    measured = {t: measured_crossover(rows, t, opts.batch, opts.dtype) for t in measured}  # after re-timing
    points = tuple((t, x) for t, x in measured.items() if t not in unmeasured)
    if not points:
        detail = "; ".join(f"cached {t}: {why}" for t, why in unmeasured.items())
        raise ValueError(
            f"calibrate could not measure a consistent crossover at any context ({detail}); the machine is "
            "too noisy: try --threads 1, or a quieter moment. Nothing saved."
        )
    extra = _extra(opts, rows)
    extra["unmeasured"] = {str(t): why for t, why in unmeasured.items()}
    extra["warnings"] = monotone_warnings(points, opts.max_new)
    extra["consistent"] = not extra["warnings"]  # False: saved by no one, followed by no one
    profile = CrossoverProfile(
        model=cfg.name,
        widths=widths_of(cfg),
        dtype=opts.dtype,
        device=torch.device(opts.device).type,
        points=points,
        max_new=max(r["new"] for r in rows),
        machine=None if machine is None else machine.to_dict(),
        extra=extra,
    )
    return profile, rows


def _confirm(ctx: BenchContext, opts: CalibrateOptions, cached: int, rows: list[dict], cross) -> str | None:
    """Time the bracket's ends twice more, both paths in turn (rows updated where both re-timings
    overturn the first); a reason when the re-timings disagree beyond the noise, else None."""
    mine = sorted({r["new"] for r in rows if r["cached"] == cached})
    if cross is None:
        ends = [(mine[-1], "absorb")]
    else:
        below = [n for n in mine if n < cross]
        ends = ([(below[-1], "absorb")] if below else []) + [
            (min(n for n in mine if n >= cross), "materialize")
        ]
    for n, want in ends:
        cell = Cell(opts.batch, cached, n)
        x = ctx.inputs(cell)
        with torch.inference_mode():
            steps = [BACKENDS[name].prepare(ctx, cell, x) for name in (ABSORB, MATERIALIZE)]
            timed = [time_interleaved(steps, ctx.device, opts.timing) for _ in range(2)]
        votes = [_verdict(a, m)[0] for a, m in timed]
        if "tie" not in votes and votes[0] != votes[1]:
            return f"at {n} new tokens two re-timings in turn disagree ({votes[0]}, then {votes[1]} faster)"
        if all(v not in (want, "tie") for v in votes):
            _replace(rows, cached, n, timed[-1])  # the first timing was the outlier: keep the steadier one
    return None


def _replace(rows: list[dict], cached: int, n: int, stats) -> None:
    for row in rows:
        if row["cached"] == cached and row["new"] == n:
            s = stats[0] if row["backend"] == ABSORB else stats[1]
            row.update(
                ms_median=s.ms_median, ms_min=s.ms_min, ms_max=s.ms_max, repeats=s.repeats, retimed=True
            )
    return None


def _verdict(a, m) -> tuple[str, float, float]:
    """Which path was faster, or "tie" within the calls' own spread (at least 5%)."""
    if abs(m.ms_median / a.ms_median - 1) <= max(a.spread, m.spread, 0.05):
        return "tie", a.ms_median, m.ms_median
    return ("absorb" if a.ms_median < m.ms_median else "materialize"), a.ms_median, m.ms_median


def monotone_warnings(points, max_new: int, noise: float = 0.5) -> list[str]:
    """The crossover barely moves with context (docs/cost-model.md): a fall beyond `noise` or a
    jump past 3x between neighbouring contexts is named."""
    out = []
    for (t0, x0), (t1, x1) in zip(points, points[1:], strict=False):
        a = float("inf") if x0 is None else x0
        b = float("inf") if x1 is None else x1
        # "> max_new" is known to exceed max_new only: a jump to it needs 3a below max_new
        b_at_least = max_new if x1 is None else x1
        if b < a * (1 - noise) or (x0 is None and x1 is not None and x1 < max_new * (1 - noise)):
            out.append(f"crossover falls from {_shown(x0, max_new)} at {t0} to {_shown(x1, max_new)} at {t1}")
        elif a != float("inf") and b_at_least > 3 * a:
            out.append(f"crossover jumps from {_shown(x0, max_new)} at {t0} to {_shown(x1, max_new)} at {t1}")
    return out


def _shown(x, max_new: int) -> str:
    return f"> {max_new}" if x is None else f"{x:.1f}"


def _announce(cfg: MLAConfig, machine, opts: CalibrateOptions) -> None:
    """The expected duration, before any cell is timed (stderr, beside the progress bar)."""
    import sys

    from mlakit.bench.calibrate_plan import estimate_seconds, format_duration

    counts = _counts(opts.step, opts.max_new)
    est = estimate_seconds(cfg, machine, opts.dtype, opts.batch, opts.contexts, counts, opts.timing)
    contexts = len(set(opts.contexts))
    cells = f"up to {plural(contexts * len(counts), 'cell')}"
    how = "roofline on the peaks just measured, every count up to --max-new timed"
    if over_limit(est, opts.max_minutes):
        fits = _max_new_that_fits(cfg, machine, opts)
        lower = f"--max-new ({fits} fits)" if fits else "--context or --batch"
        check_time_limit(est, opts.max_minutes, f"calibrate of {cfg.name}, {cells},", how, lower)
    grid = f"{plural(contexts, 'context')} x {plural(len(counts), 'new-token count')}"
    sys.stderr.write(
        f"mlakit calibrate: {cells} ({grid}, both paths) and their re-timings; expected about "
        f"{format_duration(est)} at most ({how}; the search stops once materialize wins twice; noisy "
        "cells take up to 3x)\n"
    )
    sys.stderr.flush()


def _max_new_that_fits(cfg: MLAConfig, machine, opts: CalibrateOptions) -> int | None:
    """The largest search count (1, step, step², ...) whose estimate is within --max-minutes."""
    from mlakit.bench.calibrate_plan import estimate_seconds

    fits = None
    for n in _counts(opts.step, opts.max_new):
        counts = _counts(opts.step, n)
        est = estimate_seconds(cfg, machine, opts.dtype, opts.batch, opts.contexts, counts, opts.timing)
        if over_limit(est, opts.max_minutes):
            break
        fits = n
    return fits


def _machine(device: str):
    from mlakit.profile import measure_machine

    return measure_machine(device)


def _search(ctx: BenchContext, opts: CalibrateOptions, cached: int, bar) -> list[dict]:
    """Both paths at 1, step, step², ..., max_new until materialize wins twice; then the bracket's middle."""
    rows, wins, counts = [], 0, []
    for n in _counts(opts.step, opts.max_new):
        if wins >= 2:
            break
        bar.set_postfix_str(f"cached {cached}, new {n}")
        pair = _time_pair(ctx, Cell(opts.batch, cached, n), opts.timing)
        rows += pair
        counts.append(n)
        bar.update()
        wins = wins + 1 if pair[1]["ms_median"] <= pair[0]["ms_median"] else 0
    bar.update(len(_counts(opts.step, opts.max_new)) - len(counts))  # the counts the search skipped
    cross = measured_crossover(rows, cached, opts.batch, opts.dtype)
    if cross is not None and cross > 1:
        above = min(c for c in counts if c >= cross)
        mid = round(math.sqrt(above * max(c for c in counts if c < above)))
        if mid not in counts:
            rows += _time_pair(ctx, Cell(opts.batch, cached, mid), opts.timing)
    return rows


def _counts(step: int, max_new: int) -> list[int]:
    """1, step, step², ... below max_new, then max_new itself."""
    counts = [1]
    while counts[-1] * step < max_new:
        counts.append(counts[-1] * step)
    return counts + ([max_new] if counts[-1] < max_new else [])


def _time_pair(ctx: BenchContext, cell: Cell, timing: Timing) -> list[dict]:
    x = ctx.inputs(cell)
    return [time_cell(ctx, cell, x, BACKENDS[name], timing) for name in (ABSORB, MATERIALIZE)]


def _extra(opts: CalibrateOptions, rows: list[dict]) -> dict:
    return {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "batch": opts.batch,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": [
            {k: r[k] for k in ("backend", "batch", "new", "cached", "dtype", "ms_median", "ms_min", "ms_max")}
            for r in rows
        ],
    }


def output_path(out: str | None, cfg: MLAConfig, dtype: str, device: str) -> str:
    """--out as a .json file, or as a folder for the standard name; default the user's cache folder."""
    device = torch.device(device).type
    if out is None:
        return profile_path(cfg, dtype, device)
    if out.endswith(".json"):
        return out
    return profile_path(cfg, dtype, device, folder=out)

"""Gate every backend, then time each one over the grid's cells: one row per (backend, cell)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

from mlakit.bench.backends import PATHS, Backend
from mlakit.bench.context import BenchContext
from mlakit.bench.gate import Verdict, check, gate_cells
from mlakit.bench.grid import Cell, Grid
from mlakit.bench.progress import progress
from mlakit.bench.timing import Stats, Timing, time_interleaved, time_step
from mlakit.dispatch import choose

AUTO = "mlakit-auto"
NOISY_SPREAD = 0.2  # a cell whose calls still spread this much after the extra repeats is marked noisy


@dataclass
class Sweep:
    rows: list[dict] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # backends that cannot run here, and why


def gate(ctx: BenchContext, grid: Grid, backends: list[Backend]) -> tuple[list[Backend], list[Verdict]]:
    """The backends that agree with their oracle (or have none), and every verdict."""
    cells = gate_cells(min(grid.batch[-1], 2), grid.context[-1])
    oracles: dict = {}
    passed, verdicts = [], []
    for b in backends:
        if b.oracle is None:
            passed.append(b)
            continue
        verdict = check(b, ctx, cells, oracles)
        verdicts.append(verdict)
        if verdict.ok:
            passed.append(b)
    return passed, verdicts


def runs_at(backend: Backend, cell: Cell, grid: Grid) -> bool:
    return not backend.decode_only or cell.new == grid.decode_new


def run_sweep(
    ctx: BenchContext, grid: Grid, backends: list[Backend], timing: Timing, show_progress: bool = True
) -> Sweep:
    out = Sweep()
    for b in backends:
        if not b.available():
            out.skipped.append({"backend": b.name, "reason": "not installed (pip install 'mlakit[hf]')"})
    usable = [b for b in backends if b.available()]
    passed, out.verdicts = gate(ctx, grid, usable)
    tasks = [(cell, b) for cell in grid.cells() for b in passed if runs_at(b, cell, grid)]
    bar = progress(len(tasks), "mlakit bench", show_progress)
    try:
        for cell in grid.cells():
            x = ctx.inputs(cell)
            timed: dict[str, dict] = {}
            for b in (b for b in passed if runs_at(b, cell, grid)):
                bar.set_postfix_str(f"{b.name} {cell.label}")
                row = _reuse_for_auto(ctx, cell, grid, b, timed) or time_cell(ctx, cell, x, b, timing)
                timed[b.name] = row
                out.rows.append(row)
                bar.update()
            _recheck_same_path(ctx, cell, x, timed, timing, passed)
            del x
            gc.collect()
    finally:
        bar.close()
    return out


def time_cell(ctx: BenchContext, cell: Cell, x, backend: Backend, timing: Timing) -> dict:
    """Prepare `backend` on the cell's inputs, time its step, and return the row."""
    with torch.inference_mode():
        step = backend.prepare(ctx, cell, x)
        stats = time_step(step, ctx.device, timing)
        info = step.describe()
    return base_row(backend.name, cell, ctx.dtype_name, stats, **info)


def _reuse_for_auto(ctx: BenchContext, cell: Cell, grid: Grid, backend: Backend, timed: dict) -> dict | None:
    """Away from decode, auto runs the very op of the path it picks on the same inputs: its row takes
    that path's timing (no second noisy measurement of one computation). At decode it is timed."""
    if backend.name != AUTO or cell.new == grid.decode_new:
        return None
    path = choose(ctx.cfg, cell.new, [cell.cached] * cell.batch, profile=ctx.layer.profile)
    source = timed.get(PATHS[path])
    if source is None:
        return None
    stats = Stats(source["ms_median"], source["ms_min"], source["ms_max"], source["repeats"])
    return base_row(AUTO, cell, ctx.dtype_name, stats, path=path, timed_as=PATHS[path])


def same_path_gap(auto: dict, same: dict) -> tuple[float, float]:
    """(auto's time over the same path's, the noise: the larger spread of the two, at least 5%)."""
    return auto["ms_median"] / same["ms_median"], max(auto.get("spread", 0), same.get("spread", 0), 0.05)


def _recheck_same_path(ctx: BenchContext, cell: Cell, x, timed: dict, timing: Timing, passed) -> None:
    """Auto timed on its own runs the very path it picked: where the two times differ beyond their
    noise, time both again call by call in turn and keep those figures (marked `interleaved`)."""
    auto = timed.get(AUTO)
    if auto is None or "timed_as" in auto or "path" not in auto or PATHS[auto["path"]] not in timed:
        return
    same = timed[PATHS[auto["path"]]]
    ratio, noise = same_path_gap(auto, same)
    if abs(ratio - 1) <= noise:
        return
    backends = {b.name: b for b in passed}
    with torch.inference_mode():
        steps = [backends[r["backend"]].prepare(ctx, cell, x) for r in (auto, same)]
        for row, stats in zip((auto, same), time_interleaved(steps, ctx.device, timing), strict=True):
            row.update(_stats_fields(stats), interleaved=True)


def _stats_fields(stats: Stats) -> dict:
    return {
        "ms_median": stats.ms_median,
        "ms_min": stats.ms_min,
        "ms_max": stats.ms_max,
        "repeats": stats.repeats,
        "spread": stats.spread,
        "noisy": stats.spread > NOISY_SPREAD,
    }


def base_row(backend: str, cell: Cell, dtype: str, stats: Stats, **info) -> dict:
    row = {
        "backend": backend,
        "batch": cell.batch,
        "new": cell.new,
        "cached": cell.cached,
        "dtype": dtype,
        **_stats_fields(stats),
    }
    row.update(info)
    return row

"""What the rows say: the crossover per context (measured, FLOP model, roofline), absorb's speedups
and % of peak at decode, and auto's regret."""

from __future__ import annotations

from mlakit.config import MLAConfig
from mlakit.cost import DEFAULT_COUNTING, MachineProfile, crossover, measured_crossover, roofline_crossover

ABSORB, MATERIALIZE, AUTO = "mlakit-absorb", "mlakit-materialize", "mlakit-auto"
PROJECTIONS = "mlakit-projections"
SPARSE = "mlakit-sparse"
SELF = (ABSORB, PROJECTIONS)  # not compared with absorb: absorb itself, and a part of its step
PATH_BACKEND = {"absorb": ABSORB, "materialize": MATERIALIZE}
REGRET_LIMIT = 0.05  # auto counts as right within 5% of the faster path
REGRET_TARGET = 0.95  # ... in at least 95% of the cells


def index(rows: list[dict]) -> dict:
    return {(r["backend"], r["batch"], r["cached"], r["new"]): r for r in rows}


def crossovers(cfg: MLAConfig, rows, dtype: str, machine: MachineProfile | None) -> list[dict]:
    out = []
    for batch, cached in sorted({(r["batch"], r["cached"]) for r in rows if r["backend"] == ABSORB}):
        out.append(
            {
                "batch": batch,
                "context": cached,
                "measured": measured_crossover(rows, cached, batch, dtype),
                "measured_max_new": max(r["new"] for r in rows if r["cached"] == cached),
                "counting": DEFAULT_COUNTING,
                "flop_model": crossover(cfg, cached, DEFAULT_COUNTING).exact,
                "roofline": None
                if machine is None
                else roofline_crossover(cfg, cached, machine, dtype, DEFAULT_COUNTING, max_new=1 << 20),
                "noisy": _noisy_cell(rows, batch, cached),
            }
        )
    return out


def _noisy_cell(rows: list[dict], batch: int, cached: int) -> bool:
    """Whether either path's time at this (batch, cached) spread more than its noise threshold."""
    return any(
        r.get("noisy")
        for r in rows
        if (r["batch"], r["cached"]) == (batch, cached) and r["backend"] in PATH_BACKEND.values()
    )


def unreliable(pct: float | None) -> bool:
    """A rate above the peak measured in the same run cannot be read as a fraction of it."""
    return pct is not None and pct > 100


def decode(rows: list[dict], new: int) -> list[dict]:
    """Per (batch, cached) at the decode count: absorb's time, every backend's time over absorb's."""
    at = index(rows)
    out = []
    for (name, batch, cached, n), row in sorted(at.items(), key=lambda kv: kv[0][1:]):
        if name != ABSORB or n != new:
            continue
        same = [r for r in rows if (r["batch"], r["cached"], r["new"]) == (batch, cached, n)]
        others = {r["backend"]: r["ms_median"] / row["ms_median"] for r in same if r["backend"] not in SELF}
        proj = next((r["ms_median"] for r in same if r["backend"] == PROJECTIONS), None)
        out.append(
            {
                "batch": batch,
                "context": cached,
                "new": n,
                "absorb_ms": row["ms_median"],
                "projections_ms": proj,
                "absorb_core_ms": row.get("core_ms"),
                "slower_than_absorb": others,
                "absorb_pct_peak_flops": row.get("pct_peak_flops"),
                "absorb_pct_peak_bandwidth": row.get("pct_peak_bandwidth"),
                "absorb_core_pct_peak_flops": row.get("core_pct_peak_flops"),
                "absorb_roofline_fraction": _ratio(row.get("roofline_ms"), row["ms_median"]),
                "absorb_spread": row.get("spread"),
            }
        )
    return out


def _ratio(num, den):
    return None if num is None or not den else num / den


def auto_regret(rows: list[dict], source: str) -> dict:
    """Over cells with both paths timed: time of the path auto picked over the faster path's."""
    at = index(rows)
    cells, good, misses = 0, 0, []
    for (name, batch, cached, n), row in at.items():
        a, m = at.get((ABSORB, batch, cached, n)), at.get((MATERIALIZE, batch, cached, n))
        if name != AUTO or a is None or m is None or "path" not in row:
            continue
        best = min(a["ms_median"], m["ms_median"])
        picked = at[(PATH_BACKEND[row["path"]], batch, cached, n)]["ms_median"]
        regret = picked / best - 1
        cells += 1
        if regret <= REGRET_LIMIT:
            good += 1
        else:
            misses.append(
                {"batch": batch, "context": cached, "new": n, "picked": row["path"], "regret": regret}
            )
    fraction = good / cells if cells else None
    return {
        "cells": cells,
        "within_5pct": good,
        "fraction": fraction,
        "target": REGRET_TARGET,
        "meets_target": None if fraction is None else fraction >= REGRET_TARGET,
        "decided_by": source,
        "misses": misses,
    }


def same_path(rows: list[dict]) -> list[dict]:
    """Cells where mlakit-auto was timed on its own: its time over the path's it ran, and the noise."""
    at = index(rows)
    out = []
    for (name, batch, cached, n), row in sorted(at.items(), key=lambda kv: kv[0][1:]):
        same = at.get((PATH_BACKEND.get(row.get("path"), ""), batch, cached, n))
        if name != AUTO or same is None or "timed_as" in row:
            continue
        ratio = row["ms_median"] / same["ms_median"]
        noise = max(row.get("spread", 0), same.get("spread", 0), REGRET_LIMIT)
        out.append(
            {
                "batch": batch,
                "context": cached,
                "new": n,
                "path": row["path"],
                "ratio": ratio,
                "noise": noise,
                "within_noise": abs(ratio - 1) <= noise,
                "interleaved": bool(row.get("interleaved")),
            }
        )
    return out


def sparse(rows: list[dict], new: int, index_topk: int | None = None) -> list[dict]:
    """Per (batch, cached) at the decode count: the DSA layer's step (mlakit-sparse), the path it ran,
    and dense absorb's time over it (> 1: sparse is faster)."""
    at = index(rows)
    out = []
    for (name, batch, cached, n), row in sorted(at.items(), key=lambda kv: kv[0][1:]):
        if name != SPARSE or n != new:
            continue
        dense = at.get((ABSORB, batch, cached, n))
        out.append(
            {
                "batch": batch,
                "context": cached,
                "new": n,
                "index_topk": index_topk,
                "sparse_ms": row["ms_median"],
                "path": row.get("path"),
                "absorb_ms": None if dense is None else dense["ms_median"],
                "speedup_vs_absorb": None if dense is None else dense["ms_median"] / row["ms_median"],
                "roofline_ms": row.get("roofline_ms"),
                "noisy": bool(row.get("noisy")),
            }
        )
    return out


def summarize(cfg, rows, dtype: str, machine, decode_new: int, auto_source: str) -> dict:
    out = {
        "crossover": crossovers(cfg, rows, dtype, machine),
        "decode": decode(rows, decode_new),
        "auto": auto_regret(rows, auto_source),
        "same_path": same_path(rows),
        "noisy_cells": sum(1 for r in rows if r.get("noisy")),
    }
    rows_sparse = sparse(rows, decode_new, cfg.index_topk)
    if rows_sparse:  # a DSA model only: a dense model's summary keeps its keys
        out["sparse"] = rows_sparse
    return out

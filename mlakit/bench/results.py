"""Results as data: rows with their work and rates, the machine and versions; results.json and .csv.

The JSON follows mlakit.cost.measured's schema (a `rows` list with backend, batch, new, cached,
dtype, ms_median), which the explorer page and `mlakit explore --bench` read.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
import time

import torch

from mlakit.bench import costs
from mlakit.bench.backends import BACKENDS
from mlakit.bench.context import BenchContext
from mlakit.cost import MachineProfile
from mlakit.cost.measured import SCHEMA
from mlakit.cost.sparse import SPARSE_MODES
from mlakit.ops.cpu_core import describe

PROJECTIONS = "mlakit-projections"
CSV_COLUMNS = (
    "backend",
    "batch",
    "new",
    "cached",
    "dtype",
    "ms_median",
    "ms_min",
    "ms_max",
    "repeats",
    "spread",
    "noisy",
    "path",
    "timed_as",
    "flops",
    "bytes",
    "flop_per_s",
    "bytes_per_s",
    "pct_peak_flops",
    "pct_peak_bandwidth",
    "roofline_ms",
    "core_ms",
    "core_flop_per_s",
    "core_pct_peak_flops",
    "rates_unreliable",
)


def enrich(rows: list[dict], ctx: BenchContext, machine: MachineProfile | None) -> list[dict]:
    """Add FLOPs, bytes, rates, % of peak and the roofline time to each row; the attention core
    (step minus the projections timed in the same cell) where there is one."""
    dtype = ctx.dtype_name
    proj = {_cell(r): r["ms_median"] for r in rows if r["backend"] == PROJECTIONS}
    for row in rows:
        spec = BACKENDS.get(row["backend"])
        path = row.get("path") or (spec.cost_path if spec else None)
        kv_heads = spec.kv_heads(ctx) if spec and spec.kv_heads else None
        if kv_heads is not None:
            row["kv_heads"] = kv_heads
        cfg = ctx.sparse_cfg if path in SPARSE_MODES else ctx.cfg  # a DSA row: the indexer's terms too
        terms = costs.row_terms(cfg, row, dtype, path, kv_heads)
        row.update(costs.rates(row["ms_median"], *terms, machine, dtype))
        base = proj.get(_cell(row))
        if path is not None and base is not None and row["ms_median"] > base:
            row["core_ms"] = row["ms_median"] - base
            macs, nbytes = costs.core_terms(cfg, path, row["batch"], row["new"], row["cached"], dtype)
            row.update(costs.rates(row["core_ms"], macs, nbytes, machine, dtype, prefix="core_"))
        pcts = [row.get(k) for k in ("pct_peak_flops", "pct_peak_bandwidth", "core_pct_peak_flops")]
        if machine is not None:
            # above a peak measured in the same run: the load changed between them; not a fraction of it
            row["rates_unreliable"] = any(p is not None and p > 100 for p in pcts)
    return rows


def _cell(row: dict) -> tuple:
    return row["batch"], row["new"], row["cached"], row["dtype"]


def environment(ctx: BenchContext) -> dict:
    """Machine, threads and versions: what a reader needs to compare two results files."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "mlakit"):
        mod = sys.modules.get(name)
        try:
            versions[name] = getattr(mod or __import__(name), "__version__", "unknown")
        except ImportError:
            versions[name] = None
    device = ctx.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    core, core_note = describe(ctx.dtype, device, ctx.cfg)
    return {
        # the absorbed decode core "auto" runs (mlakit.ops.cpu_core), and why not the fused one
        "core": core,
        "core_note": core_note,
        "device": str(device),
        "device_name": name,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "versions": versions,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write(results: dict, out_dir: str) -> dict[str, str]:
    """results.json and results.csv in `out_dir` (created); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "results.json"), "csv": os.path.join(out_dir, "results.csv")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    with open(paths["csv"], "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in results["rows"]:
            w.writerow({k: _csv_value(row.get(k)) for k in CSV_COLUMNS})
    return {k: os.path.abspath(v) for k, v in paths.items()}


def _csv_value(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def document(ctx: BenchContext, grid, timing, sweep, machine: MachineProfile | None, summary: dict) -> dict:
    return {
        "schema": SCHEMA,
        "model": ctx.cfg.name,
        "config": ctx.cfg.to_dict(),
        "dtype": ctx.dtype_name,
        "grid": {"batch": list(grid.batch), "context": list(grid.context), "new": list(grid.new)},
        "timing": {
            **timing.to_dict(),
            "note": "median, min and max of the timed calls; a shared machine: read medians, expect noise",
        },
        "env": environment(ctx),
        "machine": None if machine is None else machine.to_dict(),
        "auto_profile": getattr(ctx.layer.profile, "to_dict", lambda: None)(),
        "gate": [v.to_dict() for v in sweep.verdicts],
        "skipped": sweep.skipped,
        "rows": sweep.rows,
        "summary": summary,
    }

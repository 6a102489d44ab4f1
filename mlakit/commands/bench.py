"""mlakit bench: time both paths and the baselines over a grid; results, plots, the crossover."""

from __future__ import annotations

from dataclasses import replace

from mlakit.commands import emit_json
from mlakit.commands.args import check_memory, check_out_dir, parse_count_list, positive, resolve_model

# the defaults of mlakit.bench.grid (kept here so `bench --help` needs no torch; a test keeps them equal)
DEFAULT_LISTS = {"batch": (1,), "context": (256, 1024), "new": (1, 16, 128)}
QUICK_LISTS = {"batch": (1,), "context": (256,), "new": (1, 16, 64)}
LIST_LIMITS = {"batch": (1, 1 << 20), "context": (0, 1 << 30), "new": (1, 1 << 24)}


def _shown(values) -> str:
    return ",".join(f"{v // 1024}K" if v >= 1024 and v % 1024 == 0 else str(v) for v in values)


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time absorb, materialize, auto and baselines on this machine; find the real crossover",
        description="Sweep batch × cached × new tokens, time one layer step of each backend (after a "
        "correctness gate), write results.csv/json, plots and the explorer page, print the crossover. "
        "Before timing it measures the machine's load and a 1- vs all-thread GEMM and picks the threads.",
    )
    p.add_argument("--model", default="deepseek-v3", help="preset name, config.json or model folder")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        help="default: bf16 where the device has native bf16 matmuls, else fp32",
    )
    for name, text in (
        ("batch", "batch sizes"),
        ("context", "cached tokens, 1K = 1024"),
        ("new", "new tokens"),
    ):
        d, q = _shown(DEFAULT_LISTS[name]), _shown(QUICK_LISTS[name])
        p.add_argument(f"--{name}", help=f"comma-separated {text} (default {d}; --quick {q})")
    p.add_argument("--out", default="mlakit-bench", help="output folder (default ./mlakit-bench)")
    p.add_argument(
        "--quick", action="store_true", help="the small grid, 3 calls per cell and a shorter budget"
    )
    p.add_argument("--backends", help="comma-separated subset of the registry (default: all available)")
    p.add_argument("--device", help="cpu or cuda[:i] (default: cuda when available)")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: chosen from the machine's load and a 1- vs all-thread probe)",
    )
    p.add_argument("--json", action="store_true", help="print the results document as JSON")
    p.set_defaults(func=run)


def options(args):
    """BenchOptions from the flags; --quick sets the grid and timing, explicit lists override it."""
    from mlakit.bench.grid import DEFAULT_GRID, QUICK_GRID
    from mlakit.bench.run import BenchOptions
    from mlakit.bench.timing import DEFAULT_TIMING, QUICK_TIMING

    base = QUICK_GRID if args.quick else DEFAULT_GRID
    lists = {
        k: parse_count_list(getattr(args, k), k, *LIST_LIMITS[k])
        for k in ("batch", "context", "new")
        if getattr(args, k) is not None
    }
    grid = replace(base, **lists) if lists else base
    backends = None
    if args.backends is not None:
        backends = tuple(b.strip() for b in args.backends.split(","))
        if not all(backends):
            raise ValueError(f"--backends takes comma-separated backend names, got {args.backends!r}")
    return BenchOptions(
        model=resolve_model(args.model, "bench"),
        dtype=args.dtype,
        device=args.device,
        grid=grid,
        backends=backends,
        timing=QUICK_TIMING if args.quick else DEFAULT_TIMING,
        out_dir=args.out,
        threads=args.threads,
    )


def check(opts) -> None:
    """Everything that can be refused, before a single cell is timed."""
    from mlakit.bench.backends import resolve_backends
    from mlakit.bench.memory import grid_bytes
    from mlakit.bench.run import check_device, default_device, default_dtype

    device = check_device(opts.device or default_device())
    from mlakit.config import MLAConfig

    resolve_backends(opts.backends, sparse=MLAConfig.resolve(opts.model).is_sparse)
    check_out_dir(opts.out_dir)
    need, cell = grid_bytes(opts.model, opts.grid, opts.dtype or default_dtype(device))
    where = f"batch {cell.batch}, {cell.cached:,} cached, {cell.new:,} new"
    check_memory(need, f"the largest cell ({where})", "--batch, --context or --new")


def run(args) -> int:
    positive(args, "threads")
    opts = options(args)
    check(opts)
    from mlakit.bench.report import render
    from mlakit.bench.run import run_bench

    doc = run_bench(opts)
    if args.json:
        emit_json(doc)
        return 0
    print(render(doc))
    for note in doc.get("notes", []):
        print(note)
    files = doc.get("files", {})
    for key in ("json", "csv", "explorer"):
        if key in files:
            print(f"wrote {files[key]}")
    for path in files.get("plots", []):
        print(f"wrote {path}")
    return 0

"""mlakit bench: time both paths and the baselines over a grid; results, plots, the crossover."""

from __future__ import annotations

from dataclasses import replace

from mlakit.commands import emit_json


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time absorb, materialize, auto and baselines on this machine; find the real crossover",
        description="Sweep batch × cached × new tokens, time one layer step of each backend (after a "
        "correctness gate), write results.csv/json, plots and the explorer page, print the crossover.",
    )
    p.add_argument("--model", default="deepseek-v3", help="preset name, config.json or model folder")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        help="default: bf16 where the device has native bf16 matmuls, else fp32",
    )
    p.add_argument("--batch", help="comma-separated batch sizes (default 1)")
    p.add_argument("--context", help="comma-separated cached tokens, 1K = 1024 (default 256,1024)")
    p.add_argument("--new", help="comma-separated new tokens per step (default 1,8,32,128)")
    p.add_argument("--out", default="mlakit-bench", help="output folder (default ./mlakit-bench)")
    p.add_argument("--quick", action="store_true", help="a small grid and fewer repeats (under a minute)")
    p.add_argument("--backends", help="comma-separated subset of the registry (default: all available)")
    p.add_argument("--device", help="cpu or cuda[:i] (default: cuda when available)")
    p.add_argument(
        "--threads", type=int, help="torch threads (default: torch's; 1 is steadier on a busy machine)"
    )
    p.add_argument("--json", action="store_true", help="print the results document as JSON")
    p.set_defaults(func=run)


def options(args):
    """BenchOptions from the flags; --quick sets the grid and timing, explicit lists override it."""
    from mlakit.bench.grid import DEFAULT_GRID, QUICK_GRID, parse_ints
    from mlakit.bench.run import BenchOptions
    from mlakit.bench.timing import DEFAULT_TIMING, QUICK_TIMING

    base = QUICK_GRID if args.quick else DEFAULT_GRID
    lists = {k: parse_ints(getattr(args, k), k) for k in ("batch", "context", "new") if getattr(args, k)}
    grid = replace(base, **lists) if lists else base
    backends = tuple(b.strip() for b in args.backends.split(",")) if args.backends else None
    return BenchOptions(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        grid=grid,
        backends=backends,
        timing=QUICK_TIMING if args.quick else DEFAULT_TIMING,
        out_dir=args.out,
        threads=args.threads,
    )


def run(args) -> int:
    from mlakit.bench.report import render
    from mlakit.bench.run import run_bench

    doc = run_bench(options(args))
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

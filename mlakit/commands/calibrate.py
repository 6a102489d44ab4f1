"""mlakit calibrate: measure this machine's peaks and crossover; save the profile "auto" follows."""

from __future__ import annotations

from mlakit.commands import emit_json
from mlakit.commands.args import (
    check_out_dir,
    check_out_file,
    count_type,
    parse_count_list,
    positive,
    resolve_model,
)
from mlakit.commands.time_limit import add_time_limit_arg, check_max_minutes


def register(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure peak matmul rate, bandwidth and the crossover here; save the profile auto uses",
        description="Measures, for a model's widths, dtype and device, the peak matmul rate and memory "
        "bandwidth and where absorb and materialize cross at a few contexts; saves a JSON profile "
        "(default: the user's cache folder, $MLAKIT_CACHE_DIR or $XDG_CACHE_HOME/mlakit or "
        "~/.cache/mlakit) that mode='auto' follows for matching layers.",
    )
    p.add_argument("--model", default="deepseek-v3", help="preset name, config.json or model folder")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="default: as mlakit bench picks for the device")
    p.add_argument("--device", help="cpu or cuda[:i] (default: cuda when available)")
    p.add_argument(
        "--context", help="comma-separated cached tokens, 1K = 1024 (default 256,1K,4K; --quick 256,1K)"
    )
    p.add_argument(
        "--max-new",
        type=count_type("max-new", 1, 1 << 16),
        default=512,
        help="largest new-token count tried (512)",
    )
    p.add_argument("--batch", type=count_type("batch", 1, 1 << 16), default=1)
    p.add_argument(
        "--threads", type=int, help="torch threads (default: torch's); use what inference will use"
    )
    p.add_argument("--out", help="profile file (.json) or folder (default: the user's cache folder)")
    p.add_argument("--quick", action="store_true", help="two contexts, fewer repeats")
    add_time_limit_arg(p, 60)
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    check_max_minutes(args.max_minutes)
    positive(args, "threads")
    contexts = parse_count_list(args.context, "context", 0, 1 << 24) if args.context is not None else None
    model = resolve_model(args.model, "calibrate")
    if args.out is not None:
        (check_out_file if args.out.endswith(".json") else check_out_dir)(args.out)
    from mlakit.bench.calibrator import QUICK_CONTEXTS, CalibrateOptions, calibrate, output_path
    from mlakit.bench.run import check_device, default_device, default_dtype
    from mlakit.bench.timing import DEFAULT_TIMING, QUICK_TIMING

    device = check_device(args.device or default_device())
    dtype = args.dtype or default_dtype(device)
    opts = CalibrateOptions(
        model=model,
        dtype=dtype,
        device=device,
        batch=args.batch,
        contexts=contexts or (QUICK_CONTEXTS if args.quick else CalibrateOptions.contexts),
        max_new=args.max_new,
        timing=QUICK_TIMING if args.quick else DEFAULT_TIMING,
        threads=args.threads,
        max_minutes=args.max_minutes,
    )
    path = output_path(args.out, opts.model, dtype, device)
    profile, _ = calibrate(opts)
    # a profile failing its own checks is noise: saved, "auto" would follow it (and replace a good one)
    saved = profile.save(path) if profile.consistent else None
    if args.json:
        emit_json({**profile.to_dict(), "path": saved})
    else:
        _print(profile, saved)
    return 0 if saved else 1


def _print(profile, path: str) -> None:
    m = profile.machine
    print(f"mlakit calibrate: {profile.model}, {profile.dtype} on {profile.device}")
    if m:
        peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in m["peak_flops"].items())
        print(f"  peak matmul GFLOP/s: {peaks}; memory read {m['memory_bandwidth'] / 1e9:.1f} GB/s")
    print(f"  {'cached':>7} {'crossover (new tokens)':>24}")
    for t, x in profile.points:
        text = f"> {profile.max_new} (absorb always faster)" if x is None else f"{x:.1f}"
        print(f"  {t:>7} {text:>24}")
    for t, why in profile.extra.get("unmeasured", {}).items():
        print(f"  {t:>7} {'not measured':>24}  (noise: {why})")
    for warning in profile.extra.get("warnings", []):
        print(f"  failed check: {warning}: the crossover barely moves with context, so this is noise")
    if path is None:
        print(
            "not saved: the profile fails its own consistency checks, and mode='auto' must not follow it; "
            "rerun with --threads 1 or at a quieter moment"
        )
        return
    print(f"saved {path}")
    print(
        "mode='auto' follows it for layers of these widths, dtype and device once attached: "
        "mlakit.calibration.attach(layer) (docs/calibrate.md)"
    )

"""mlakit cost: every term of both paths at (context, new), both totals, and the roofline times."""

from __future__ import annotations

from mlakit.commands import emit_json
from mlakit.config import MLAConfig
from mlakit.cost import CACHE_DTYPES, MACHINES, MODELS, MachineProfile, cost_report, resolve_machine


def add_model_args(p, context_default: int | None = 4096) -> None:
    """--model, --context and --json, shared by the cost commands."""
    p.add_argument("--model", default="deepseek-v3", help="preset name, config.json or model folder")
    if context_default is None:
        p.add_argument("--context", type=int, required=True, help="cached tokens")
    else:
        p.add_argument(
            "--context", type=int, default=context_default, help=f"cached tokens ({context_default})"
        )
    p.add_argument("--json", action="store_true", help="print JSON")


def add_machine_arg(p, default: str | None) -> None:
    names = ", ".join(sorted(MACHINES))
    p.add_argument(
        "--machine",
        default=default,
        help=f"roofline machine: {names}, 'local' (measured here once, then cached) or a profile JSON",
    )


def machine_from_arg(value: str) -> MachineProfile:
    if value == "local":
        from mlakit.profile import local_profile  # torch is needed only to measure

        return local_profile()
    return resolve_machine(value)


def check_tokens(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"--{name} must be >= {low}, got {value}")


def register(sub) -> None:
    p = sub.add_parser("cost", help="every term of both paths, both totals and the predicted times")
    add_model_args(p, context_default=None)
    p.add_argument("--new", type=int, required=True, help="new tokens attending to the context")
    p.add_argument("--dtype", choices=CACHE_DTYPES, default="bf16", help="cache dtype (bf16)")
    add_machine_arg(p, "h100")
    p.add_argument("--counting", choices=MODELS, default="independent", help="counting model (independent)")
    p.add_argument("--fused", action="store_true", help="materialize keeps expanded K/V on chip")
    p.set_defaults(func=run)


def run(args) -> int:
    check_tokens("context", args.context, 0)
    check_tokens("new", args.new, 1)
    cfg = MLAConfig.resolve(args.model)
    machine = machine_from_arg(args.machine)
    report = cost_report(cfg, args.context, args.new, args.dtype, machine, args.counting, args.fused)
    if args.json:
        emit_json(report)
        return 0
    print_report(report)
    return 0


def print_report(r: dict) -> None:
    print(
        f"{r['model']}: {r['new']:,} new tokens over {r['context']:,} cached, {r['dtype']} cache, "
        f"{r['counting']} counting, roofline on {r['machine']['name']} (per layer, per sequence)"
    )
    print(f"{'path':<12} {'term':<20} {'multiply-adds':>16} {'bytes':>14} {'time us':>10}  bound")
    for path in ("materialize", "absorb", "shared"):
        for name, t in r["terms"][path].items():
            print(f"{path:<12} {name:<20} {_figures(t)}  {t['bound']}")
    for path in ("materialize", "absorb"):
        t = r["totals"][path]
        print(
            f"{path:<12} {'total':<20} {_figures(t)}  (with shared projections: "
            f"{t['macs_with_shared']:,.0f} MACs, {t['time_s_with_shared'] * 1e6:.2f} us)"
        )
    c = r["crossover"]
    print(f"fewer multiply-adds: {r['fewer_macs']}; predicted faster: {r['faster']}")
    print(
        f"crossover at this context: {_tok(c['exact'])} new tokens (multiply-adds), "
        f"{_tok(c['roofline'])} (roofline); long-context limit {_tok(c['asymptotic'])}"
    )


def _figures(t: dict) -> str:
    return f"{t['macs']:>16,.0f} {t['bytes']:>14,.0f} {t['time_s'] * 1e6:>10.2f}"


def _tok(x) -> str:
    return "none" if x is None else f"{x:,.1f}"

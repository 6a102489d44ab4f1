"""mlakit cost: every term of both paths at (context, new), both totals, and the roofline times."""

from __future__ import annotations

import sys

from mlakit.commands import emit_json, plural
from mlakit.commands import v4 as _v4
from mlakit.commands.args import count_type, resolve_model
from mlakit.cost import (
    CACHE_DTYPES,
    DEFAULT_COUNTING,
    MACHINES,
    MODELS,
    MachineProfile,
    cost_report,
    format_seconds,
    resolve_machine,
)


def add_model_args(p, context_default: int | None = 4096) -> None:
    """--model, --context (4K = 4096) and --json, shared by the cost commands."""
    p.add_argument("--model", default="deepseek-v3", help="preset name, config.json or model folder")
    tokens = count_type("context", 0)
    if context_default is None:
        p.add_argument("--context", type=tokens, required=True, help="cached tokens (4K = 4096)")
    else:
        p.add_argument(
            "--context",
            type=tokens,
            default=context_default,
            help=f"cached tokens, 4K = 4096 ({context_default})",
        )
    p.add_argument("--json", action="store_true", help="print JSON")


def add_counting_arg(p) -> None:
    p.add_argument(
        "--counting",
        choices=MODELS,
        default=DEFAULT_COUNTING,
        help=f"counting model: causal (new tokens also attend to each other, as mlakit runs a step) or "
        f"independent (each new token sees the context only) ({DEFAULT_COUNTING})",
    )


def add_machine_arg(p, default: str | None) -> None:
    names = ", ".join(sorted(MACHINES))
    p.add_argument(
        "--machine",
        default=default,
        help=f"roofline machine: {names}, 'local' (measured here once, then cached; bf16 at the rate "
        "mlakit computes it) or a profile JSON",
    )


def machine_from_arg(value: str) -> MachineProfile:
    if value == "local":
        from mlakit.profile import effective_machine, local_profile  # torch is needed only to measure

        return effective_machine(local_profile())
    try:
        return resolve_machine(value)
    except OSError as err:
        raise ValueError(f"--machine {value!r}: {err.strerror or err}") from None


def check_tokens(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"--{name} must be >= {low}, got {value}")


DEFAULT_MACHINE = "h100"


def register(sub) -> None:
    p = sub.add_parser("cost", help="every term of both paths, both totals and the predicted times")
    add_model_args(p)  # --context defaults to 4K as in crossover and cache
    p.add_argument(
        "--new", type=count_type("new", 1), required=True, help="new tokens attending to the context"
    )
    p.add_argument("--dtype", choices=CACHE_DTYPES, default="bf16", help="cache dtype (bf16)")
    add_machine_arg(p, DEFAULT_MACHINE)
    add_counting_arg(p)
    p.add_argument("--fused", action="store_true", help="materialize keeps expanded K/V on chip")
    p.set_defaults(func=run)


def run(args) -> int:
    check_tokens("context", args.context, 0)
    check_tokens("new", args.new, 1)
    if _v4.is_v4(args.model):
        check_tokens("context", args.context, 1)  # as `mlakit cache` on a V4 model
        _note_v4_ignored(args)
        return _v4.run_cost(args)
    cfg = resolve_model(args.model)
    machine = machine_from_arg(args.machine)
    report = cost_report(cfg, args.context, args.new, args.dtype, machine, args.counting, args.fused)
    if args.json:
        emit_json(report)
        return 0
    print_report(report)
    return 0


def _note_v4_ignored(args) -> None:
    """The V4 terms count multiply-adds and bytes only: say so when roofline flags were given."""
    given = [
        flag
        for flag, changed in (
            ("--machine", args.machine != DEFAULT_MACHINE),
            ("--counting", args.counting != DEFAULT_COUNTING),
            ("--fused", args.fused),
        )
        if changed
    ]
    if given:
        print(
            f"mlakit cost: {', '.join(given)} ignored for a V4 model (its terms are multiply-adds and "
            "bytes read, no roofline)",
            file=sys.stderr,
        )


def print_report(r: dict) -> None:
    print(
        f"{r['model']}: {plural(r['new'], 'new token')} over {r['context']:,} cached, {r['dtype']} cache, "
        f"{r['counting']} counting, roofline on {r['machine']['name']} (per layer, per sequence)"
    )
    if "sparse" in r:
        print(
            "DSA model: the rows down to the DSA section are a dense layer's of these widths (no indexer); "
            "what this model runs, and its answer, is the DSA section"
        )
    print(f"{'path':<12} {'term':<20} {'multiply-adds':>16} {'bytes':>14} {'time':>10}  bound")
    for path in ("materialize", "absorb", "shared"):
        for name, t in r["terms"][path].items():
            print(f"{path:<12} {name:<20} {_figures(t)}  {t['bound']}")
    for path in ("materialize", "absorb"):
        t = r["totals"][path]
        print(
            f"{path:<12} {'total':<20} {_figures(t)}  (with shared projections: "
            f"{t['macs_with_shared']:,.0f} MACs, {format_seconds(t['time_s_with_shared'])})"
        )
    d = r.get("dense_layer", r)  # a DSA model's top-level answer is the sparse one (its section below)
    c = d["crossover"]
    dense = "dense layer: " if "sparse" in r else ""
    print(f"{dense}fewer multiply-adds: {d['fewer_macs']}; predicted faster: {d['faster']}")
    print(
        f"{dense}crossover at this context ({r['counting']} counting): {_tok(c['exact'])} new tokens "
        "(multiply-adds), "
        f"{_tok(c['roofline'])} (roofline); long-context limit {_tok(c['asymptotic'])}"
    )
    if "sparse" in r:
        print_sparse(r["sparse"], r)


def _figures(t: dict) -> str:
    return f"{t['macs']:>16,.0f} {t['bytes']:>14,.0f} {format_seconds(t['time_s']):>10}"


def _tok(x) -> str:
    return "none" if x is None else f"{x:,.1f}"


def print_sparse(s: dict, r: dict) -> None:
    """The DSA section: both sparse paths, the indexer's terms, break-even and the decode figures."""
    m = s["summary"]
    print(
        f"DSA (index_topk {m['index_topk']:,}, indexer {m['index_n_heads']} heads x {m['index_head_dim']}): "
        + (
            "every query sees <= index_topk keys, dense attention (the dense rows above are exact)"
            if s["dense"]
            else "sparse: each query attends to index_topk selected latents"
        )
    )
    print(f"{'path':<19} {'term':<20} {'multiply-adds':>16} {'bytes':>14}")
    for path, terms in s["terms"].items():
        for name, t in terms.items():
            print(f"{path:<19} {name:<20} {t['macs']:>16,.0f} {t['bytes']:>14,.0f}")
        t = s["totals"][path]
        print(f"{path:<19} {'total':<20} {t['macs']:>16,.0f} {t['bytes']:>14,.0f}")
    band = s["crossover"]
    where = "never" if band is None else f"{band[0]:,.1f} <= new < " + _tok(band[1])
    print(
        f"fewer multiply-adds: {s['fewer_macs']}; auto picks {s['auto_picks']}; materialize cheaper: {where}"
    )
    b = m["breakeven_bytes"]
    print(
        f"DSA decode beats dense absorb from {m['breakeven_macs']:,.0f} cached tokens (multiply-adds; "
        f"{m['breakeven_macs_with_projections']:,.0f} with the indexer projections), from "
        f"{b['bf16_latent_fp8_index']:,.0f}-{b['bf16']:,.0f} (bytes, bf16 latent, fp8/bf16 indexer key)"
    )
    for d in m["decode"]:
        c, a = d["core"], d["all_terms"]
        print(
            f"  decode at {d['cached']:>7,} cached: {c['ratio']:.2f}x fewer multiply-adds than dense, "
            f"indexer {c['indexer_share']:.1%} of the rest ({a['ratio']:.2f}x, {a['indexer_share']:.1%} "
            "with every term)"
        )

"""mlakit cache: cache values and bytes per token, per model and per sequence, MLA against the rest."""

from __future__ import annotations

from mlakit.commands import emit_json, plural
from mlakit.commands import v4 as _v4
from mlakit.commands.args import resolve_model
from mlakit.commands.capacity import add_capacity_args, capacity_from_args, print_capacity
from mlakit.commands.cost import add_model_args, check_tokens
from mlakit.commands.ranks import per_rank_cache_bytes
from mlakit.config import MLAConfig
from mlakit.cost import CACHE_DTYPES, DEFAULT_GQA_GROUPS, cache_economics, format_bytes


def register(sub) -> None:
    p = sub.add_parser("cache", help="cache size per token and per sequence: MLA, expanded, MHA, GQA, MQA")
    add_model_args(p)
    p.add_argument("--dtype", choices=CACHE_DTYPES, default="bf16", help="cache dtype (bf16)")
    p.add_argument(
        "--gqa-groups",
        default=",".join(map(str, DEFAULT_GQA_GROUPS)),
        help="GQA group counts to compare, comma-separated; kept where they divide the heads (4,8)",
    )
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks: latent bytes per rank (1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: latent bytes per rank (1)")
    add_capacity_args(p)
    p.set_defaults(func=run)


def per_rank(cfg: MLAConfig, context: int, mla_bytes_per_token_per_layer: int, cp: int, tp: int) -> dict:
    """MLA latent bytes per rank for one sequence (rank = c·tp + t): CP splits it, TP replicates it."""
    value_bytes = mla_bytes_per_token_per_layer / cfg.latent_dim
    ranks = per_rank_cache_bytes(cfg, context, value_bytes, cp=cp, tp=tp)
    return {"cp": cp, "tp": tp, "mla_bytes_per_rank": ranks, "mla_bytes_max_rank": max(ranks)}


def _mla_row(e: dict) -> int:
    """What one token of the model's MLA cache holds per layer: the latent, and a DSA model's indexer key."""
    per_layer = e["bytes_per_token_per_layer"]
    return per_layer.get("mla+indexer", per_layer["mla"])


def parse_groups(text: str) -> list[int]:
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts) or len(parts) > 64:
        raise ValueError(f"--gqa-groups must be up to 64 comma-separated integers >= 1, got {text!r}")
    return [int(p) for p in parts]


def run(args) -> int:
    check_tokens("context", args.context, 1)  # a sequence of no tokens caches nothing to size
    if _v4.is_v4(args.model):
        return _v4.run_cache(args)
    groups = parse_groups(args.gqa_groups)
    cfg = resolve_model(args.model)
    e = cache_economics(cfg, args.context, args.dtype, groups)
    r = {"model": cfg.name, "context": args.context, "dtype": args.dtype, **e}
    if args.cp != 1 or args.tp != 1:
        r["per_rank"] = per_rank(cfg, args.context, _mla_row(e), args.cp, args.tp)
    planned = capacity_from_args(cfg, args, groups)
    if planned is not None:
        r["capacity"] = planned
    if args.json:
        emit_json(r)
        return 0
    print(
        f"{cfg.name}: {plural(cfg.num_layers, 'layer')}, {args.dtype} cache, "
        f"sequence of {plural(args.context, 'token')}"
    )
    head = ("values/token/layer", "bytes/token/layer", "per token", "per sequence")
    print(f"{'cache':<12} {head[0]:>19} {head[1]:>18} {head[2]:>11} {head[3]:>13}")
    for name, values in r["values_per_token_per_layer"].items():
        per_token, per_seq = (format_bytes(r[k][name]) for k in ("bytes_per_token", "bytes_per_sequence"))
        print(
            f"{name:<12} {values:>19,} {r['bytes_per_token_per_layer'][name]:>18,} "
            f"{per_token:>11} {per_seq:>13}"
        )
    what = " (latent and indexer key)" if "dense_layer" in r else ""
    print(
        f"MLA{what} caches as much as GQA with {r['mla_equivalent_gqa_groups']:.3g} groups at these "
        "head widths"
        + (
            f" ({r['dense_layer']['mla_equivalent_gqa_groups']:.3g} for the latent alone)"
            if "dense_layer" in r
            else ""
        )
    )
    if "indexer" in r:
        ix = r["indexer"]
        print(
            f"DSA: {cfg.name} caches mla+indexer, the latent and its indexer key "
            f"({ix['index_key_bytes_per_token_per_layer']} B/token/layer); mla is the latent alone, "
            "what a dense layer of these widths caches"
        )
        print(
            f"DSA indexer key: {ix['index_key_bytes_per_token_per_layer']} B/token/layer beside the latent: "
            f"mla + indexer {ix['mla_with_indexer_bytes_per_token_per_layer']:,} B/token/layer, "
            f"{format_bytes(ix['mla_with_indexer_bytes_per_token'])} per token, "
            f"{format_bytes(ix['mla_with_indexer_bytes_per_sequence'])} per sequence"
        )
    if "per_rank" in r:
        pr = r["per_rank"]
        shown = ", ".join(format_bytes(b) for b in pr["mla_bytes_per_rank"][:8])
        more = " ..." if len(pr["mla_bytes_per_rank"]) > 8 else ""
        print(f"per rank at cp={pr['cp']} tp={pr['tp']} (TP replicates the latent): {shown}{more}")
    if planned is not None:
        print_capacity(planned)
    return 0

"""DeepSeek-V4 in `mlakit cost` and `mlakit cache`: the terms of each layer type, beside V3.2 and V3.

A V4 model (a V4 preset, or a config.json / folder whose model_type is deepseek_v4) is routed here by
the two commands; every other model keeps their MLA output unchanged.
"""

from __future__ import annotations

import json
import os
import sys

from mlakit.commands import emit_json, plural
from mlakit.cost import format_bytes
from mlakit.cost.v4 import TERMS, v4_report
from mlakit.v4.config import LAYER_TYPES, V4_PRESETS, V4Config

_CACHE_KEYS = ("cache_bytes_per_token_per_layer", "cache_bytes_per_sequence", "cache_vs_v3.2")
_SHORT = {
    "sliding_attention": "window",
    "compressed_sparse_attention": "CSA",
    "heavily_compressed_attention": "HCA",
}


def is_v4(model: str) -> bool:
    """True for a V4 preset name or a config.json / model folder of model_type deepseek_v4."""
    if not isinstance(model, str):
        return False
    if model.lower() in V4_PRESETS:
        return True
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("model_type") == "deepseek_v4"
    except (OSError, ValueError, AttributeError):
        return False


def run_cost(args) -> int:
    cfg = V4Config.resolve(args.model)
    r = v4_report(cfg, args.context, args.new, args.dtype)
    if args.json:
        emit_json(r)
        return 0
    print(
        f"{cfg.name}: {plural(args.new, 'new token')} over {args.context:,} cached, {args.dtype} cache "
        f"(multiply-adds and cache bytes read per layer, per sequence)"
    )
    kinds = [k for k in LAYER_TYPES if cfg.count(k)]
    print(
        f"{'term':<18}"
        + "".join(f"{_SHORT[k] + ' x' + str(cfg.count(k)):>22}" for k in kinds)
        + f"{'model':>20}"
    )
    for name in TERMS:
        row = "".join(f"{r['per_layer_type'][k]['terms'][name]['macs']:>22,}" for k in kinds)
        print(f"{name:<18}{row}{r['terms'][name]['macs']:>20,}")
    print(
        f"{'total':<18}"
        + "".join(f"{r['per_layer_type'][k]['macs']:>22,}" for k in kinds)
        + f"{r['macs']:>20,}"
    )
    print(
        f"{'bytes read':<18}"
        + "".join(f"{r['per_layer_type'][k]['bytes']:>22,}" for k in kinds)
        + f"{r['bytes_read']:>20,}"
    )
    _print_compare(r)
    return 0


def run_cache(args) -> int:
    cfg = V4Config.resolve(args.model)
    planned = v4_capacity_from_args(cfg, args)
    _say_ignored_cache_flags(args)
    r = v4_report(cfg, args.context, 1, args.dtype)
    out = {
        "model": r["model"],
        "context": r["context"],
        "dtype": r["dtype"],
        "layer_types": r["layer_types"],
        "bytes_per_token_per_layer": r["cache_bytes_per_token_per_layer"],
        "bytes_per_sequence": r["cache_bytes_per_sequence"],
        "compare": {k: {n: v[n] for n in _CACHE_KEYS} for k, v in r["compare"].items()},
    }
    if args.cp != 1 or args.tp != 1:
        out["per_rank"] = _per_rank(cfg, args)
    if planned is not None:
        out["capacity"] = planned
    if args.json:
        emit_json(out)
        return 0
    _print_cache(cfg, args, out)
    if "per_rank" in out:
        pr = out["per_rank"]
        print(
            f"per rank at cp={pr['cp']} tp={pr['tp']} (TP replicates the one K = V head; CP deals the "
            f"compressed entries): {format_bytes(pr['bytes_per_sequence_max_rank'])} on the fullest rank"
        )
    if planned is not None:
        print_v4_capacity(planned)
    return 0


def v4_capacity_from_args(cfg: V4Config, args) -> dict | None:
    """`--memory` (with --tp, --cp, --weights-memory, --weights-dtype): the V4 capacity table."""
    from mlakit.commands.capacity import capacity_from_args
    from mlakit.cost.v4_capacity import v4_capacity

    return capacity_from_args(cfg, args, table=v4_capacity)


def _per_rank(cfg: V4Config, args) -> dict:
    from mlakit.commands.ranks import check_ranks
    from mlakit.cost.v4_capacity import sequence_bytes_per_rank

    check_ranks(cfg, args.cp, args.tp)
    total = sequence_bytes_per_rank(cfg, args.context, args.cp, args.dtype)["total"]
    return {"cp": args.cp, "tp": args.tp, "bytes_per_sequence_max_rank": total}


def _say_ignored_cache_flags(args) -> None:
    from mlakit.cost import DEFAULT_GQA_GROUPS

    if args.gqa_groups != ",".join(map(str, DEFAULT_GQA_GROUPS)):
        print(
            "mlakit cache: --gqa-groups ignored for a V4 model (it is compared with V3.2 and V3, "
            "not with GQA layouts of its widths)",
            file=sys.stderr,
        )


def print_v4_capacity(c: dict) -> None:
    from mlakit.commands.capacity import print_weights_line

    print_weights_line(c)
    print(
        f"a sequence of {plural(c['context'], 'token')} on the fullest rank: per layer, the window ring "
        f"(every rank) + ceil(entries / cp {c['cp']}) compressed entries; TP replicates the K = V head"
    )
    print(
        f"{'cache':<9} {'window':>7} {'CSA entries':>12} {'HCA entries':>12} {'per sequence':>13} "
        f"{'sequences':>10}"
    )
    for name, r in c["caches"].items():
        t = r["per_layer_type"]
        csa, hca = t["compressed_sparse_attention"], t["heavily_compressed_attention"]
        print(
            f"{name:<9} {t['sliding_attention']['window_entries']:>7,} {csa['compressed_entries']:>12,} "
            f"{hca['compressed_entries']:>12,} {format_bytes(r['bytes_per_sequence_per_rank']):>13} "
            f"{r['sequences_per_rank']:>10,}  floor({format_bytes(c['free_bytes_per_rank'])} / "
            f"{format_bytes(r['bytes_per_sequence_per_rank'])})"
        )
    if c["free_bytes_per_rank"] == 0:
        print(
            "the weights alone fill the memory: no sequence fits; raise --tp or --memory, or lower "
            "--weights-dtype"
        )


def _print_cache(cfg: V4Config, args, out: dict) -> None:
    seq = out["bytes_per_sequence"]
    print(
        f"{cfg.name}: {plural(cfg.num_layers, 'layer')}, {args.dtype} cache, "
        f"sequence of {plural(args.context, 'token')}"
    )
    print(f"{'layer type':<30} {'layers':>6} {'bytes/token/layer':>18} {'per layer (seq)':>16}")
    for k in LAYER_TYPES:
        print(
            f"{k:<30} {cfg.count(k):>6} {out['bytes_per_token_per_layer'][k]:>18,.2f} "
            f"{format_bytes(seq['per_layer'][k]):>16}"
        )
    print(
        f"window ring: {cfg.sliding_window} entries per layer; "
        f"per sequence in all: {format_bytes(seq['total'])}"
    )
    for name, c in out["compare"].items():
        share = "" if c["cache_vs_v3.2"] is None else f"  ({c['cache_vs_v3.2']:.1%} of V3.2)"
        print(
            f"  {name:<18} {c['cache_bytes_per_token_per_layer']:>10,.1f} B/token/layer "
            f"{format_bytes(c['cache_bytes_per_sequence']):>12}{share}"
        )


def _print_compare(r: dict) -> None:
    print("per decoded token, every layer (FLOPs = 2 x multiply-adds; attention layers only, no MoE/FFN):")
    for name, c in r["compare"].items():
        share = "" if c["cache_vs_v3.2"] is None else f", cache {c['cache_vs_v3.2']:.1%}"
        print(
            f"  {name:<18} {c['flops'] / 1e9:>12,.1f} GFLOPs  ({c['flops_vs_v3.2']:.1%} of V3.2{share}; "
            f"cache {format_bytes(c['cache_bytes_per_sequence'])})"
        )


def v4_models() -> list[dict]:
    """One row per V4 preset, for `mlakit models`: its layer counts and what a token stores per layer."""
    from mlakit.cost.v4 import cache_bytes_per_token

    rows = []
    for name in V4_PRESETS:
        cfg = V4Config.preset(name)
        rows.append(
            {
                "name": name,
                "hidden_size": cfg.hidden_size,
                "num_heads": cfg.num_heads,
                "head_dim": cfg.head_dim,
                "layers": {k: cfg.count(k) for k in LAYER_TYPES},
                "sliding_window": cfg.sliding_window,
                "ratios": {"csa": cfg.csa_ratio, "hca": cfg.hca_ratio},
                "index_topk": cfg.index_topk,
                "bf16_bytes_per_token_per_layer": cache_bytes_per_token(cfg, "bf16"),
            }
        )
    return rows


def print_v4_models(rows: list[dict]) -> None:
    print("\nDeepSeek-V4 presets (mlakit.V4Config; docs/v4.md): bf16 bytes per cached token per layer")
    head = f"{'preset':<20} {'layers window/CSA/HCA':>22} {'heads x dim':>12}"
    print(head + f" {'top-k':>6} {'CSA B':>7} {'HCA B':>6}")
    for r in rows:
        n, b = r["layers"], r["bf16_bytes_per_token_per_layer"]
        counts = "/".join(str(n[k]) for k in LAYER_TYPES)
        print(
            f"{r['name']:<20} {counts:>22} {r['num_heads']:>5} x {r['head_dim']:<4} {r['index_topk']:>6} "
            f"{b['compressed_sparse_attention']:>7g} {b['heavily_compressed_attention']:>6g}"
        )

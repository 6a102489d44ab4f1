"""mlakit crossover: the new-token count where absorb and materialize cost the same."""

from __future__ import annotations

from mlakit.commands import emit_json
from mlakit.commands.args import resolve_model
from mlakit.commands.cost import _tok, add_counting_arg, add_machine_arg, add_model_args, machine_from_arg
from mlakit.config import MLAConfig
from mlakit.cost import (
    CACHE_DTYPES,
    DEFAULT_COUNTING,
    MODELS,
    crossover,
    roofline_crossover,
    sparse_crossover,
)


def register(sub) -> None:
    p = sub.add_parser("crossover", help="new tokens where absorb and materialize cost the same")
    add_model_args(p)
    add_counting_arg(p)
    add_machine_arg(p, None)
    p.add_argument(
        "--dtype", choices=CACHE_DTYPES, default="bf16", help="cache dtype for the roofline (bf16)"
    )
    p.set_defaults(func=run)


def crossover_result(
    cfg: MLAConfig, context: int, counting: str = DEFAULT_COUNTING, machine=None, dtype: str = "bf16"
) -> dict:
    both = {m: crossover(cfg, context, m) for m in MODELS}
    out = {
        "model": cfg.name,
        "context": context,
        "counting": counting,
        "exact": both[counting].exact,
        "asymptotic": both[counting].asymptotic,
        "by_counting": {m: {"exact": c.exact, "asymptotic": c.asymptotic} for m, c in both.items()},
    }
    if machine is not None:
        out["roofline"] = {
            "machine": machine.name,
            "dtype": dtype,
            "counting": counting,
            "exact": roofline_crossover(cfg, context, machine, dtype, counting),
        }
    if cfg.is_sparse:
        out = sparse_top(cfg, context, counting, out)
    return out


def sparse_top(cfg: MLAConfig, context: int, counting: str, dense: dict) -> dict:
    """A DSA model's top level is its sparse answer (exact <= new < below, None: never, per counting);
    the dense layer's figures (exact, asymptotic, by_counting, roofline) move under "dense_layer"."""
    bands = {m: sparse_crossover(cfg, context, m) for m in MODELS}
    keys = ("exact", "asymptotic", "by_counting", "roofline")
    low, high = bands[counting] or (None, None)
    return {
        "model": cfg.name,
        "context": context,
        "counting": counting,
        "exact": low,
        "below": high,
        "by_counting": {
            m: dict(zip(("exact", "below"), b or (None, None), strict=True)) for m, b in bands.items()
        },
        "sparse": sparse_answer(cfg, context, counting),
        "dense_layer": {k: dense[k] for k in keys if k in dense},
    }


def sparse_answer(cfg: MLAConfig, context: int, counting: str) -> dict:
    """A DSA model's one answer: where sparse-materialize costs fewer multiply-adds than sparse-absorb
    (a band of new tokens, or never); the dense figures above are a dense layer's of these widths."""
    band = sparse_crossover(cfg, context, counting)
    return {
        "index_topk": cfg.index_topk,
        "counting": counting,
        "materialize_cheaper": None if band is None else {"from": band[0], "below": band[1]},
        "text": band_text(band),
        "dense_figures": "a dense layer of these widths (no indexer)",
    }


def band_text(band) -> str:
    if band is None:
        return "never: absorb is cheaper at every new-token count"
    upper = "" if band[1] is None else f" < {band[1]:,.1f}"
    return f"{band[0]:,.1f} <= new{upper} new tokens"


def run(args) -> int:
    cfg = resolve_model(args.model, "crossover")
    machine = machine_from_arg(args.machine) if args.machine else None
    r = crossover_result(cfg, args.context, args.counting, machine, args.dtype)
    if args.json:
        emit_json(r)
        return 0
    print(
        f"{cfg.name} (heads {cfg.num_heads}, latent {cfg.kv_lora_rank}, nope {cfg.qk_nope_head_dim}, "
        f"rope {cfg.qk_rope_head_dim}, v {cfg.v_head_dim}) at {args.context:,} cached tokens"
    )
    if "sparse" in r:
        print_sparse_answer(r["sparse"])
    r = r.get("dense_layer", r)  # the figures below: a DSA model's dense layer
    order = [args.counting] + [m for m in MODELS if m != args.counting]
    for m in order:
        tag = " (the default)" if m == DEFAULT_COUNTING else ""
        print(f"  crossover, {m} counting{tag}: {_tok(r['by_counting'][m]['exact'])} new tokens")
    print(f"  long-context limit L·(nope+v)/(2L-nope-v): {_tok(r['asymptotic'])} new tokens")
    if machine is not None:
        roof = _tok(r["roofline"]["exact"])
        print(f"  roofline on {machine.name}, {args.dtype}, {args.counting} counting: {roof} new tokens")
    if cfg.is_sparse:
        print("  (the dense layer's figures: a DSA model runs the sparse answer above)")
    else:
        print("  fewer new tokens than the crossover: absorb is cheaper; more: materialize")
    return 0


def print_sparse_answer(s: dict) -> None:
    print(
        f"  DSA (index_topk {s['index_topk']:,}), {s['counting']} counting: sparse-materialize cheaper than "
        f"sparse-absorb: {s['text']}"
    )
    print("  dense layer of these widths (no indexer), for comparison:")

"""DeepSeek Sparse Attention in the cost model: the indexer's terms, attention over the selection, the
context from which DSA beats dense absorb, and absorb vs materialize under sparsity.

Counts are per layer and per sequence, as in `terms.py`. A query that sees c keys attends to
min(c, k) of them; the indexer scores all c (d_I multiply-adds per head for q·k, one for the weight).
Every query that sees <= k keys is dense attention, and the indexer is skipped (its key is still
cached). Derivations and the headline figures: docs/sparse.md.
"""

from __future__ import annotations

import math

from mlakit.config import MLAConfig
from mlakit.cost.cache_size import VALUE_BYTES, index_key_bytes
from mlakit.cost.terms import _check, check_model, expanded_tokens, keys_seen, widths
from mlakit.cost.traffic import _cache_row_bytes, compute_dtype

SPARSE_MODES = ("sparse-absorb", "sparse-materialize")


def check_sparse(cfg: MLAConfig) -> None:
    if not cfg.is_sparse:
        raise ValueError(f"model {cfg.name!r} has no indexer (index_topk is None): not a DSA model")


def needs_indexer(cfg: MLAConfig, new, cached, model: str = "independent") -> bool:
    """True when some new query sees more than index_topk keys (else DSA is dense attention)."""
    check_sparse(cfg)
    return cached + (new if model == "causal" else 0) > cfg.index_topk


def selected_pairs(cfg: MLAConfig, new, cached, model: str = "independent"):
    """(query, key) pairs attended: Σ_i min(k, keys query i sees)."""
    check_sparse(cfg)
    check_model(model)
    k = cfg.index_topk
    if model == "independent":
        return new * min(k, cached)
    below = max(0, min(new, k - cached))  # queries that see <= k keys: cached+1 .. cached+below
    triangle = below * (below + 1) // 2 if isinstance(below, int) else below * (below + 1) / 2
    return below * cached + triangle + (new - below) * k


def indexer_macs(cfg: MLAConfig, new, cached, model: str = "independent") -> dict:
    """The indexer's projections and its scoring, zero when no query sees more than k keys."""
    _check(new, cached)
    on = needs_indexer(cfg, new, cached, model)
    hi, di, d = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    pairs = keys_seen(new, cached, model) if on else 0
    return {
        "index_wq_b": new * cfg.q_lora_rank * hi * di if on else 0,  # c_q · W_q^I
        "index_wk": new * d * di,  # hidden · W_k^I (always: the key is cached)
        "index_weights": new * d * hi if on else 0,  # hidden · W_w (fp32)
        "index_scores": pairs * hi * (di + 1),  # ReLU(q_I · k_I) per head, then · w
    }


def sparse_absorb_macs(cfg: MLAConfig, new, cached, model: str = "independent") -> dict:
    _check(new, cached)
    h, lat, dn, dr, dv = widths(cfg)
    pairs = selected_pairs(cfg, new, cached, model)
    return {
        "fold_q": new * h * dn * lat,  # q_nope · W_UK per new token
        "scores": pairs * h * (lat + dr),  # q_lat · gathered [c_kv | k_pe]
        "mix_latents": pairs * h * lat,  # probs · gathered c_kv
        "unfold_v": new * h * lat * dv,  # o_lat · W_UV per new token
    }


def sparse_materialize_macs(cfg: MLAConfig, new, cached, model: str = "independent") -> dict:
    """The dense masked form: every visible latent expanded, every visible pair scored."""
    _check(new, cached)
    h, lat, dn, dr, dv = widths(cfg)
    t = expanded_tokens(new, cached, model)
    pairs = keys_seen(new, cached, model)
    return {
        "expand_k": t * h * dn * lat,  # c_kv · W_UK for every visible token
        "expand_v": t * h * dv * lat,  # c_kv · W_UV for every visible token
        "scores": pairs * h * (dn + dr),  # q · K, unselected keys masked after
        "weighted_sum": pairs * h * dv,  # probs · V
    }


def sparse_path_terms(cfg: MLAConfig, mode: str, new, cached, model: str = "independent") -> dict:
    """One sparse path's attention terms plus the indexer's (prefixed index_)."""
    if mode == "sparse-absorb":
        core = sparse_absorb_macs(cfg, new, cached, model)
    elif mode == "sparse-materialize":
        core = sparse_materialize_macs(cfg, new, cached, model)
    else:
        raise ValueError(f"mode must be one of {SPARSE_MODES}, got {mode!r}")
    return {**core, **indexer_macs(cfg, new, cached, model)}


def sparse_path_macs(cfg: MLAConfig, mode: str, new, cached, model: str = "independent"):
    return sum(sparse_path_terms(cfg, mode, new, cached, model).values())


def choose_sparse(cfg: MLAConfig, new: int, cached: int) -> str:
    """The cheaper sparse path in multiply-adds (causal counting: a prefill's queries see each other)."""
    a = sparse_path_macs(cfg, "sparse-absorb", new, cached, "causal")
    m = sparse_path_macs(cfg, "sparse-materialize", new, cached, "causal")
    return "sparse-materialize" if m < a else "sparse-absorb"


def sparse_crossover(
    cfg: MLAConfig, context, model: str = "causal", max_new: float = 2.0**22
) -> tuple[float, float | None] | None:
    """(lower, upper): sparse-materialize costs fewer multiply-adds than sparse-absorb for
    lower <= new < upper new tokens at `context` cached (upper None: up to `max_new`); None: never.

    Materialize pays for every visible pair, absorb for k per query, so under causal counting
    materialize's lead (cheap expansion, narrow dot products) ends again for long chunks.
    """
    _check(0, context)

    def gap(n):
        m = sparse_path_macs(cfg, "sparse-materialize", n, context, model)
        return m - sparse_path_macs(cfg, "sparse-absorb", n, context, model)

    grid = [2.0 ** (i / 8) for i in range(8 * int(math.log2(max_new)) + 1)]
    first = next((i for i, n in enumerate(grid) if gap(n) < 0), None)
    if first is None:
        return None
    lower = grid[0] if first == 0 else _edge(gap, grid[first - 1], grid[first])
    last = next((i for i in range(first, len(grid)) if gap(grid[i]) >= 0), None)
    return lower, None if last is None else _edge(gap, grid[last - 1], grid[last])


def _edge(gap, lo: float, hi: float) -> float:
    """Bisect the sign change of gap between lo and hi to a relative width of 1e-9."""
    neg_hi = gap(hi) < 0
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        if (gap(mid) < 0) == neg_hi:
            hi = mid
        else:
            lo = mid
    return hi


def independent_sparse_crossover(cfg: MLAConfig, context) -> float | None:
    """The independent model's closed form c·L(dn+dv) / (L(dn+dv) + (2L+dr)·k − c(dn+dr+dv)) for
    context c > k (≈ (c/k)·L(dn+dv)/(2L+dr) while c·(dn+dr+dv) is small); None: materialize never wins."""
    h, lat, dn, dr, dv = widths(cfg)
    denom = lat * (dn + dv) + (2 * lat + dr) * cfg.index_topk - context * (dn + dr + dv)
    return context * lat * (dn + dv) / denom if denom > 0 else None


def dense_core_macs(cfg: MLAConfig, cached) -> int:
    """Dense absorb decode's context-dependent terms: H(2L+dr)·T."""
    h, lat, _, dr, _ = widths(cfg)
    return cached * h * (2 * lat + dr)


def sparse_core_macs(cfg: MLAConfig, cached) -> dict:
    """Sparse decode's context-dependent terms: attention H(2L+dr)·min(T,k), scoring H_I(d_I+1)·T."""
    h, lat, _, dr, _ = widths(cfg)
    return {
        "attention": min(cached, cfg.index_topk) * h * (2 * lat + dr),
        "index_scores": cached * cfg.index_n_heads * (cfg.index_head_dim + 1),
    }


def dsa_breakeven(cfg: MLAConfig, include_projections: bool = False) -> float:
    """Cached tokens from which one sparse decode step costs fewer multiply-adds than dense absorb:
    H(2L+dr)·T = H(2L+dr)·k + H_I(d_I+1)·T (+ the indexer projections when asked)."""
    check_sparse(cfg)
    h, lat, _, dr, _ = widths(cfg)
    per_key = h * (2 * lat + dr)
    fixed = per_key * cfg.index_topk
    if include_projections:
        projections = indexer_macs(cfg, 1, cfg.index_topk + 1)
        fixed += sum(v for name, v in projections.items() if name != "index_scores")
    return fixed / (per_key - cfg.index_n_heads * (cfg.index_head_dim + 1))


def dsa_breakeven_bytes(cfg: MLAConfig, dtype: str = "bf16", index_dtype: str | None = None) -> float:
    """Cached tokens from which one sparse decode step reads fewer cache bytes than dense absorb:
    T·row = k·row + T·index_key (row: one token's latent and rope key in `dtype`)."""
    latent, rope = _cache_row_bytes(cfg, dtype)
    row = latent + rope
    return cfg.index_topk * row / (row - index_key_bytes(cfg, index_dtype or dtype))


def indexer_bytes(cfg: MLAConfig, new, cached, model: str = "independent", dtype: str = "bf16") -> dict:
    """Bytes of the indexer: its weights and activations once, every visible indexer key once."""
    _check(new, cached)
    e = VALUE_BYTES[compute_dtype(dtype)]
    hi, di, d = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    on = needs_indexer(cfg, new, cached, model)
    t = expanded_tokens(new, cached, model) if on else 0
    return {
        "index_wq_b": (new * cfg.q_lora_rank + cfg.q_lora_rank * hi * di + new * hi * di) * e if on else 0,
        "index_wk": (new * d + d * di) * e + new * index_key_bytes(cfg, dtype),  # the key is written
        "index_weights": (new * d + d * hi) * 4 + new * hi * 4 if on else 0,  # fp32
        "index_scores": t * index_key_bytes(cfg, dtype) + (new * (hi * di * e + hi * 4) if on else 0),
    }


def sparse_absorb_bytes(cfg: MLAConfig, new, cached, model: str = "independent", dtype: str = "bf16") -> dict:
    """Like absorb_bytes, reading only the selected rows (at most the context, at most new·k)."""
    _check(new, cached)
    h, lat, dn, dr, dv = widths(cfg)
    e = VALUE_BYTES[compute_dtype(dtype)]
    latent, rope = _cache_row_bytes(cfg, dtype)
    rows = min(expanded_tokens(new, cached, model), new * cfg.index_topk)
    nh = new * h
    return {
        "fold_q": nh * dn * e + h * dn * lat * e + nh * lat * e,  # q_nope in, W_UK, q_lat out
        "scores": nh * (lat + dr) * e + rows * (latent + rope) + new * cfg.index_topk * 4,  # + indices
        "mix_latents": nh * lat * e,  # o_lat out
        "unfold_v": nh * lat * e + h * lat * dv * e + nh * dv * e,  # o_lat in, W_UV, output out
    }


def dsa_decode_summary(cfg: MLAConfig, cached: int) -> dict:
    """One decode step at `cached` tokens: dense absorb vs DSA, core terms and with every term."""
    from mlakit.cost.terms import absorb_macs

    check_sparse(cfg)
    core = sparse_core_macs(cfg, cached)
    dense_core = dense_core_macs(cfg, cached)
    sparse_all = sparse_path_terms(cfg, "sparse-absorb", 1, cached)
    dense_all = sum(absorb_macs(cfg, 1, cached).values())
    index_all = sum(v for name, v in sparse_all.items() if name.startswith("index_"))
    return {
        "cached": cached,
        "core": {
            "dense": dense_core,
            "sparse": sum(core.values()),
            "ratio": dense_core / sum(core.values()),
            "indexer_share": core["index_scores"] / sum(core.values()),
        },
        "all_terms": {
            "dense": dense_all,
            "sparse": sum(sparse_all.values()),
            "ratio": dense_all / sum(sparse_all.values()),
            "indexer_share": index_all / sum(sparse_all.values()),
        },
    }


def dsa_report(cfg: MLAConfig, contexts=(4096, 32768, 131072)) -> dict:
    """The figures `mlakit cost` prints for a sparse model (see docs/sparse.md)."""
    check_sparse(cfg)
    return {
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "index_key_bytes": {d: index_key_bytes(cfg, d) for d in ("bf16", "fp8")},
        "breakeven_macs": dsa_breakeven(cfg),
        "breakeven_macs_with_projections": dsa_breakeven(cfg, include_projections=True),
        "breakeven_bytes": {
            "bf16": dsa_breakeven_bytes(cfg, "bf16"),
            "bf16_latent_fp8_index": dsa_breakeven_bytes(cfg, "bf16", "fp8"),
            "fp8": dsa_breakeven_bytes(cfg, "fp8"),
        },
        "decode": [dsa_decode_summary(cfg, c) for c in contexts],
        "sparse_crossover": {str(c): sparse_crossover(cfg, c) for c in (0, *contexts)},
        "sparse_crossover_independent": {str(c): independent_sparse_crossover(cfg, c) for c in contexts},
    }


def sparse_path_bytes(
    cfg: MLAConfig, mode: str, new, cached, model: str = "independent", dtype="bf16"
) -> dict:
    from mlakit.cost.traffic import materialize_bytes

    if mode == "sparse-absorb":
        core = sparse_absorb_bytes(cfg, new, cached, model, dtype)
    elif mode == "sparse-materialize":
        core = materialize_bytes(cfg, new, cached, model, dtype)
    else:
        raise ValueError(f"mode must be one of {SPARSE_MODES}, got {mode!r}")
    return {**core, **indexer_bytes(cfg, new, cached, model, dtype)}


def sparse_cost(
    cfg: MLAConfig, context: int, new: int, dtype: str = "bf16", model: str = "independent"
) -> dict:
    """The sparse section of `mlakit cost`: both sparse paths term by term at (context, new), and the
    model's DSA figures."""
    check_sparse(cfg)
    terms, totals = {}, {}
    for mode in SPARSE_MODES:
        macs = sparse_path_terms(cfg, mode, new, context, model)
        nbytes = sparse_path_bytes(cfg, mode, new, context, model, dtype)
        terms[mode] = {name: {"macs": macs[name], "bytes": nbytes[name]} for name in macs}
        totals[mode] = {"macs": sum(macs.values()), "bytes": sum(nbytes.values())}
    return {
        "dense": not needs_indexer(cfg, new, context, model),
        "terms": terms,
        "totals": totals,
        "fewer_macs": min(SPARSE_MODES, key=lambda m: (totals[m]["macs"], m)),
        "auto_picks": choose_sparse(cfg, new, context),
        "crossover": sparse_crossover(cfg, context, model),  # the report's counting, as the page's
        "summary": dsa_report(cfg),
    }

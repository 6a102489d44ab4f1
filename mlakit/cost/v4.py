"""DeepSeek-V4 in the cost model: the terms of each layer type, the cache it keeps, and V4 against
V3.2 (DSA) and V3 (dense MLA, absorbed) at the same context.

Counts are per layer and per sequence for `new` tokens that each see `context` cached tokens plus
themselves (independent counting, as `terms.py`'s default). A query at position t sees
min(n_win, t+1) window keys and the w < (t+1)//m entries of its layer's ratio; CSA attends to
min(index_topk, entries) of them, scored by the indexer only when there are more than index_topk.
K = V: one product per key for the scores and one for the weighted sum, each H·head_dim wide.
Bytes are the cache bytes a step reads. docs/cost-model.md ("DeepSeek-V4") has the table.
"""

from __future__ import annotations

import math

from mlakit.config import MLAConfig
from mlakit.cost.cache_size import SCALE_BYTES, VALUE_BYTES, check_cache_dtype, index_key_bytes
from mlakit.cost.sparse import indexer_macs, sparse_absorb_macs
from mlakit.cost.terms import absorb_macs, shared_macs

# the layer types (mlakit.v4.config's names; the cost model imports nothing but mlakit.config): a
# V4Config is read through its fields and its ratio(kind) / count(kind), as an MLAConfig is
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
TERMS = ("window", "compressed_dense", "compressed_sparse", "indexer", "compressors", "projections")
# fp8 entries: the non-rope dims in e4m3 with one fp32 scale per 64 (DeepSeek's reference quantizes
# the window and compressed K = V in blocks of 64), the rope dims in bf16
FP8_TILE = 64


def _check(new, context) -> None:
    for name, v in (("new", new), ("context", context)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "new" else 0):
            raise ValueError(f"{name} must be an integer >= {1 if name == 'new' else 0}, got {v!r}")


def entry_bytes(cfg, dtype: str = "bf16") -> int:
    """One K = V entry (window or compressed): head_dim values."""
    check_cache_dtype(dtype)
    if dtype in ("fp8", "int8"):
        nope = cfg.nope_head_dim
        return nope + math.ceil(nope / FP8_TILE) * SCALE_BYTES + cfg.qk_rope_head_dim * 2
    return cfg.head_dim * VALUE_BYTES[dtype]


def index_bytes(cfg, dtype: str = "bf16") -> int:
    """One CSA indexer key (index_head_dim values; fp8: one fp32 scale per 128, as DSA's)."""
    check_cache_dtype(dtype)
    if dtype in ("fp8", "int8"):
        return cfg.index_head_dim + math.ceil(cfg.index_head_dim / 128) * SCALE_BYTES
    return cfg.index_head_dim * VALUE_BYTES[dtype]


def layer_terms(cfg, layer_type: str, context: int, new: int = 1, dtype: str = "bf16") -> dict:
    """{term: {"macs", "bytes"}} of one layer of `layer_type`, every name of TERMS (0 where absent)."""
    _check(new, context)
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {layer_type!r}")
    h, hd = cfg.num_heads, cfg.head_dim
    t = context + 1  # keys up to and including the query (the last new token; others see fewer)
    m = cfg.ratio(layer_type)
    entries = t // m if m else 0
    win = min(cfg.sliding_window, t)
    eb = entry_bytes(cfg, dtype)
    zero = {"macs": 0, "bytes": 0}
    out = {name: dict(zero) for name in TERMS}
    out["window"] = {"macs": new * 2 * h * hd * win, "bytes": win * eb}  # q·k and p·v, K = V
    if layer_type == HCA:
        out["compressed_dense"] = {"macs": new * 2 * h * hd * entries, "bytes": entries * eb}
    if layer_type == CSA:
        picked = min(cfg.index_topk, entries)
        out["compressed_sparse"] = {"macs": new * 2 * h * hd * picked, "bytes": picked * eb}
        out["indexer"] = _indexer(cfg, new, entries, dtype)
    out["compressors"] = _compressors(cfg, layer_type, new)
    out["projections"] = {"macs": new * _projection_macs(cfg), "bytes": 0}
    return out


def _indexer(cfg, new: int, entries: int, dtype: str) -> dict:
    """Queries from the q latent, the head weights and the scores over every entry; none while all
    entries fit in index_topk (the selection is then every entry)."""
    if entries <= cfg.index_topk:
        return {"macs": 0, "bytes": 0}
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    macs = (
        new * cfg.q_lora_rank * hi * di  # q latent · q_b_proj
        + new * cfg.hidden_size * hi  # hidden · weights_proj
        + new * entries * hi * (di + 1)  # relu(q·k) per head, then · weight
    )
    return {"macs": macs, "bytes": entries * index_bytes(cfg, dtype)}


def _compressors(cfg, layer_type: str, new: int) -> dict:
    """kv and gate projections of every new token, and the pooling (2·coff·d per token, amortized)."""
    if layer_type == SLIDING:
        return {"macs": 0, "bytes": 0}
    widths = [(cfg.head_dim, 2 if layer_type == CSA else 1)]
    if layer_type == CSA:
        widths.append((cfg.index_head_dim, 2))
    macs = sum(new * (2 * cfg.hidden_size * coff * w + 2 * coff * w) for w, coff in widths)
    return {"macs": macs, "bytes": 0}


def _projection_macs(cfg) -> int:
    h, hd, d, g, r = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.o_groups, cfg.o_lora_rank
    return (
        d * cfg.q_lora_rank  # hidden · q_a_proj
        + cfg.q_lora_rank * h * hd  # q latent · q_b_proj
        + d * hd  # hidden · kv_proj
        + h * hd * r  # grouped o_a_proj: g groups of (h·hd/g) → r
        + g * r * d  # o_b_proj
    )


def cache_bytes_per_token(cfg, dtype: str = "bf16") -> dict[str, float]:
    """Bytes each cached token adds to one layer of each type, at long context (window amortized)."""
    eb = entry_bytes(cfg, dtype)
    return {
        SLIDING: 0.0,
        CSA: (eb + index_bytes(cfg, dtype)) / cfg.csa_ratio,
        HCA: eb / cfg.hca_ratio,
    }


def sequence_bytes(cfg, context: int, dtype: str = "bf16") -> dict:
    """Bytes one sequence of `context` tokens keeps, per layer type and in all (window included)."""
    _check(1, context)
    eb = entry_bytes(cfg, dtype)
    window = min(cfg.sliding_window, context) * eb
    per_type = {
        SLIDING: window,
        CSA: window + (context // cfg.csa_ratio) * (eb + index_bytes(cfg, dtype)),
        HCA: window + (context // cfg.hca_ratio) * eb,
    }
    total = sum(per_type[t] for t in cfg.layer_types)
    return {"per_layer": per_type, "total": total}


def model_cost(cfg, context: int, new: int = 1, dtype: str = "bf16") -> dict:
    """Terms per layer type, each type's total per layer, and the model's sum over its layers."""
    by_type, totals = {}, {name: {"macs": 0, "bytes": 0} for name in TERMS}
    for kind in LAYER_TYPES:
        terms = layer_terms(cfg, kind, context, new, dtype)
        n = cfg.count(kind)
        by_type[kind] = {
            "layers": n,
            "terms": terms,
            "macs": sum(t["macs"] for t in terms.values()),
            "bytes": sum(t["bytes"] for t in terms.values()),
        }
        for name, t in terms.items():
            totals[name]["macs"] += n * t["macs"]
            totals[name]["bytes"] += n * t["bytes"]
    return {
        "per_layer_type": by_type,
        "terms": totals,
        "macs": sum(t["macs"] for t in totals.values()),
        "bytes_read": sum(t["bytes"] for t in totals.values()),
    }


def mla_cost(cfg: MLAConfig, context: int, new: int = 1, dtype: str = "bf16") -> dict:
    """A V3 (dense, absorbed) or V3.2 (DSA: indexer + sparse absorb) model's per-step figures."""
    per_layer = sum(shared_macs(cfg, new).values())
    if cfg.is_sparse:
        per_layer += sum(sparse_absorb_macs(cfg, new, context).values())
        per_layer += sum(indexer_macs(cfg, new, context).values())
        token_bytes = _latent_bytes(cfg, dtype) + index_key_bytes(cfg, dtype)
    else:
        per_layer += sum(absorb_macs(cfg, new, context).values())
        token_bytes = _latent_bytes(cfg, dtype)
    return {
        "model": cfg.name,
        "layers": cfg.num_layers,
        "macs": per_layer * cfg.num_layers,
        "cache_bytes_per_token_per_layer": token_bytes,
        "cache_bytes_per_token": token_bytes * cfg.num_layers,
        "cache_bytes_per_sequence": token_bytes * cfg.num_layers * context,
    }


def _latent_bytes(cfg: MLAConfig, dtype: str) -> int:
    from mlakit.cost.cache_size import cache_layouts

    return cache_layouts(cfg, ())["mla"].bytes(dtype)


def compare(cfg, context: int, new: int = 1, dtype: str = "bf16") -> dict:
    """V4 beside V3.2 and V3 at one context: FLOPs per step (2 per multiply-add) and cache bytes."""
    v4 = model_cost(cfg, context, new, dtype)
    seq = sequence_bytes(cfg, context, dtype)
    per_token = seq["total"] / (max(context, 1) * cfg.num_layers)  # window included, at this context
    rows = {
        cfg.name: {
            "macs": v4["macs"],
            "cache_bytes_per_sequence": seq["total"],
            "cache_bytes_per_token_per_layer": per_token,
        },
    }
    for name in ("deepseek-v3.2", "deepseek-v3"):
        c = mla_cost(MLAConfig.preset(name), context, new, dtype)
        rows[name] = {
            k: c[k] for k in ("macs", "cache_bytes_per_sequence", "cache_bytes_per_token_per_layer")
        }
    base = rows["deepseek-v3.2"]
    for r in rows.values():
        r["flops"] = 2 * r["macs"]
        r["flops_vs_v3.2"] = r["macs"] / base["macs"]
        r["cache_vs_v3.2"] = (
            r["cache_bytes_per_sequence"] / base["cache_bytes_per_sequence"] if context else None
        )
    return rows


def v4_report(cfg, context: int, new: int = 1, dtype: str = "bf16") -> dict:
    """What `mlakit cost` / `mlakit cache` print for a V4 model (JSON-ready)."""
    cost = model_cost(cfg, context, new, dtype)
    return {
        "model": cfg.name,
        "context": context,
        "new": new,
        "dtype": dtype,
        "layer_types": {kind: cfg.count(kind) for kind in LAYER_TYPES},
        "per_layer_type": cost["per_layer_type"],
        "terms": cost["terms"],
        "macs": cost["macs"],
        "bytes_read": cost["bytes_read"],
        "cache_bytes_per_token_per_layer": cache_bytes_per_token(cfg, dtype),
        "cache_bytes_per_sequence": sequence_bytes(cfg, context, dtype),
        "compare": compare(cfg, context, new, dtype),
    }

"""Capacity planning for DeepSeek-V4: sequences of `context` tokens per rank after the weights, from the
bytes each layer type keeps (mlakit.cost.v4), per rank of cp × tp.

- weights: as for MLA (mlakit.cost.capacity.weights_bytes): split over tp, replicated over cp.
- tensor parallelism splits the heads, not the cache: a V4 layer caches one shared K = V head (and a
  CSA layer one indexer key per entry), so every tp rank holds all of it, as MLA's latent.
- context parallelism deals the compressed entries over the cp ranks (the fullest keeps
  ceil(entries / cp)); the window ring (n_win entries per layer) is counted on every rank, an upper
  bound (only the rank holding the newest tokens needs it).

sequences = floor(free bytes / bytes one sequence keeps on the fullest rank). docs/capacity.md.
"""

from __future__ import annotations

import math

from mlakit.cost.cache_size import check_cache_dtype
from mlakit.cost.capacity import _check_int, weights_bytes
from mlakit.cost.v4 import CSA, HCA, LAYER_TYPES, SLIDING, entry_bytes, index_bytes

V4_DTYPES = ("bf16", "fp8")  # the entry formats compared (int8 entries take fp8's bytes)


def layer_bytes_per_rank(cfg, layer_type: str, context: int, cp: int, dtype: str) -> dict:
    """One layer's bytes for one sequence on the fullest cp rank: its window ring and its entries."""
    eb = entry_bytes(cfg, dtype)
    window = min(cfg.sliding_window, context)
    m = cfg.ratio(layer_type)
    entries = math.ceil((context // m) / cp) if m else 0
    per_entry = eb + (index_bytes(cfg, dtype) if layer_type == CSA else 0)
    return {
        "window_entries": window,
        "compressed_entries": entries,
        "bytes": window * eb + entries * per_entry,
    }


def sequence_bytes_per_rank(cfg, context: int, cp: int, dtype: str) -> dict:
    """Bytes one sequence keeps on the fullest rank: per layer of each type, and over all layers."""
    per_type = {k: layer_bytes_per_rank(cfg, k, context, cp, dtype) for k in LAYER_TYPES}
    total = sum(cfg.count(k) * per_type[k]["bytes"] for k in LAYER_TYPES)
    return {"per_layer_type": per_type, "total": total}


def v4_capacity(
    cfg,
    context: int,
    memory: int,
    dtype: str = "bf16",
    tp: int = 1,
    cp: int = 1,
    weights_memory: int | None = None,
    weights_dtype: str = "bf16",
) -> dict:
    """Concurrent sequences of `context` tokens per rank of `memory` bytes, per entry format."""
    check_cache_dtype(dtype)
    for name, value, low in (("context", context, 1), ("memory", memory, 1), ("tp", tp, 1), ("cp", cp, 1)):
        _check_int(name, value, low)
    if tp > cfg.num_heads:
        raise ValueError(f"tp={tp} exceeds the {cfg.num_heads} heads of {cfg.name}")
    weights = weights_bytes(cfg, weights_dtype, weights_memory)
    weights["bytes_per_rank"] = math.ceil(weights["bytes"] / tp)
    free = max(0, memory - weights["bytes_per_rank"])
    caches = {}
    for d in dict.fromkeys((*V4_DTYPES, dtype)):
        seq = sequence_bytes_per_rank(cfg, context, cp, d)
        sequences = free // seq["total"]
        caches[f"v4-{d}"] = {
            "dtype": d,
            "bytes_per_sequence_per_rank": seq["total"],
            "per_layer_type": seq["per_layer_type"],
            "sequences_per_rank": sequences,
            "arithmetic": f"{free:,} // {seq['total']:,} = {sequences:,}",
        }
    return {
        "model": cfg.name,
        "context": context,
        "memory_bytes": memory,
        "dtype": dtype,
        "tp": tp,
        "cp": cp,
        "weights": weights,
        "free_bytes_per_rank": free,
        "layer_types": {k: cfg.count(k) for k in LAYER_TYPES},
        "ratios": {SLIDING: 0, CSA: cfg.csa_ratio, HCA: cfg.hca_ratio},
        "caches": caches,
    }

"""Capacity planning: how many sequences of `context` tokens fit in one rank's memory after the weights.

Per rank (ranks = cp × tp):

- weights: the model's weights split over the tp ranks, replicated over cp (parameters × bytes per
  parameter of the weight dtype, or the bytes given); what is left of the memory holds the cache.
- MLA: the latent (and a DSA model's indexer key) is replicated by tensor parallelism and split by
  position over cp (blocks of 64 dealt round-robin: the rank owning the most tokens decides).
- expanded K/V, MHA, GQA, MQA: their cached heads split over tp (ceil(heads / tp) per rank: a head is
  replicated once tp exceeds the cached heads), their tokens over cp as above.

sequences = floor(free bytes / bytes one sequence keeps on that rank). Derivation: docs/cache.md.
"""

from __future__ import annotations

import math

from mlakit.config import MLAConfig
from mlakit.cost.cache_size import (
    CACHE_DTYPES,
    DEFAULT_GQA_GROUPS,
    cache_layouts,
    check_cache_dtype,
    index_key_bytes,
)

BLOCK_SIZE = 64  # mlakit.distributed.cp.DEFAULT_BLOCK_SIZE: context parallel deals blocks of 64 tokens
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}  # bytes per parameter
MLA_DTYPES = ("bf16", "fp8", "int8")  # the latent formats compared
# total parameters as published (the model's paper or card, or its name: "-119B" is 119e9); None where
# no figure is published in these sources: give --weights-memory
PARAMETERS: dict[str, float | None] = {
    "deepseek-v2": 236e9,  # DeepSeek-V2 paper: 236B total
    "deepseek-v2-lite": 15.7e9,  # DeepSeek-V2 paper: 15.7B total
    "deepseek-v3": 671e9,  # DeepSeek-V3 report: 671B total (without the 14B MTP module)
    "deepseek-v3.2": 671e9,  # V3.2 is V3's architecture with the indexer added
    "kimi-k2": 1e12,  # Kimi K2: 1 trillion total
    "glm-4.7-flash": 30e9,  # GLM-4.7-Flash, 30B-A3B
    "glm-5": 744e9,  # GLM-5 technical report: 744B total (40B active)
    "minicpm3-4b": 4e9,  # MiniCPM3-4B
    "youtu-llm-2b": 2e9,  # Youtu-LLM-2B
    "ax-k1": 519e9,  # A.X K1 model card: 519B total (33B active)
    "mistral-small-4": 119e9,  # Mistral-Small-4-119B
    "longcat-flash": 560e9,  # LongCat-Flash report: 560B total
    "kimi-linear-48b": 48e9,  # Kimi-Linear-48B-A3B
    "ling-3-flash": None,
    "hy4-preview": None,
    "ax-k2": None,
    "mistral-large-4": 1e12,  # Mistral-Large-4-1T-A52B
    "deepseek-v4-pro": 1.6e12,  # DeepSeek-V4 model card: 1.6T parameters (49B activated)
    "deepseek-v4-flash": 284e9,  # DeepSeek-V4 model card: 284B parameters (13B activated)
}


def owned_tokens_max(context: int, cp: int) -> int:
    """Tokens of a `context`-token sequence on the context-parallel rank that owns the most (rank 0)."""
    full, tail = divmod(context, BLOCK_SIZE)
    return math.ceil(full / cp) * BLOCK_SIZE + (tail if full % cp == 0 else 0)


def weights_bytes(cfg: MLAConfig, weights_dtype: str = "bf16", weights_memory: int | None = None) -> dict:
    """The whole model's weights: given, or the preset's parameter count × bytes per parameter."""
    if weights_dtype not in WEIGHT_BYTES:
        raise ValueError(f"weights_dtype must be one of {tuple(WEIGHT_BYTES)}, got {weights_dtype!r}")
    if weights_memory is not None:
        _check_int("weights_memory", weights_memory, 0)
        return {"source": "given", "parameters": None, "dtype": None, "bytes": weights_memory}
    params = PARAMETERS.get(cfg.name)
    if params is None:
        raise ValueError(
            f"model {cfg.name!r} has no published parameter count here; give the weights' size with "
            "--weights-memory (bytes, or with a unit: 1.3TB, 80GiB)"
        )
    nbytes = round(params * WEIGHT_BYTES[weights_dtype])
    return {"source": "parameters", "parameters": params, "dtype": weights_dtype, "bytes": nbytes}


def per_rank_token_bytes(cfg: MLAConfig, dtype: str, tp: int, gqa_groups=DEFAULT_GQA_GROUPS) -> dict:
    """Bytes one token keeps on one tp rank, all layers: (name, cache dtype) → (bytes per layer, note)."""
    out = {}
    layouts = cache_layouts(cfg, gqa_groups)
    mla_name = "mla+indexer" if cfg.is_sparse else "mla"
    for d in dict.fromkeys((*MLA_DTYPES, dtype)) if dtype == "fp32" else MLA_DTYPES:
        per_layer = layouts["mla"].bytes(d) + (index_key_bytes(cfg, d) if cfg.is_sparse else 0)
        out[f"{mla_name}-{d}"] = (d, per_layer, "latent replicated over tp")
    for name, lay in layouts.items():
        if name == "mla":
            continue
        heads = lay.vectors[0][0]  # the cached heads (key and value vectors come in pairs)
        on_rank = math.ceil(heads / tp)
        per_layer = lay.bytes(dtype) // heads * on_rank
        out[name] = (dtype, per_layer, f"{on_rank} of {heads} cached heads per rank")
    return out


def capacity(
    cfg: MLAConfig,
    context: int,
    memory: int,
    dtype: str = "bf16",
    tp: int = 1,
    cp: int = 1,
    weights_memory: int | None = None,
    weights_dtype: str = "bf16",
    gqa_groups=DEFAULT_GQA_GROUPS,
) -> dict:
    """Concurrent sequences of `context` tokens per rank of `memory` bytes, for every cache kind."""
    check_cache_dtype(dtype)
    _check_int("context", context, 1)
    _check_int("memory", memory, 1)
    _check_int("tp", tp, 1)
    _check_int("cp", cp, 1)
    if tp > cfg.num_heads:
        raise ValueError(f"tp={tp} exceeds the {cfg.num_heads} heads of {cfg.name}")
    weights = weights_bytes(cfg, weights_dtype, weights_memory)
    weights["bytes_per_rank"] = math.ceil(weights["bytes"] / tp)
    free = max(0, memory - weights["bytes_per_rank"])
    tokens = owned_tokens_max(context, cp)
    caches = {}
    for name, (d, per_layer, note) in per_rank_token_bytes(cfg, dtype, tp, gqa_groups).items():
        per_seq = per_layer * cfg.num_layers * tokens
        sequences = free // per_seq
        caches[name] = {
            "dtype": d,
            "bytes_per_token_per_layer_per_rank": per_layer,
            "bytes_per_sequence_per_rank": per_seq,
            "sequences_per_rank": sequences,
            "arithmetic": f"{free:,} // ({per_layer:,} × {cfg.num_layers} × {tokens:,}) = {sequences:,}",
            "note": note,
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
        "tokens_per_rank": tokens,
        "num_layers": cfg.num_layers,
        "caches": caches,
    }


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


__all__ = ["CACHE_DTYPES", "PARAMETERS", "WEIGHT_BYTES", "capacity", "owned_tokens_max", "weights_bytes"]

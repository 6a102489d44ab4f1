"""Context parallel and tensor parallel MLA over torch.distributed (gloo on CPU, NCCL on GPU).

- `ContextParallelMLA(layer, group)` + `ContextParallelCache`: a sequence's latent cache split by
  position over the ranks (round-robin blocks), absorb on each part, one all-gather, log-sum-exp merge.
- `TensorParallelMLA(cfg, state_dict, group)`: heads split over the ranks, latent cache replicated,
  one all-reduce after o_proj.
- `launch_local(fn, world_size)`: spawn a local gloo group (tests, `mlakit cp-check`); under torchrun,
  call `torch.distributed.init_process_group` instead.
- `per_rank_cache_bytes(cfg, context, dtype_bytes, cp, tp)`: the arithmetic, no process group needed.

docs/distributed.md explains the placement, the merge and the cost of TP's replicated cache.
"""

from __future__ import annotations

import math

from mlakit.config import MLAConfig
from mlakit.distributed.cp import (
    DEFAULT_BLOCK_SIZE,
    BlockPlacement,
    ContextParallelCache,
    ContextParallelMLA,
    owned_tokens,
)
from mlakit.distributed.group import DEFAULT_TIMEOUT_S, RankFailure, agree, launch_local
from mlakit.distributed.tp import TensorParallelMLA, head_range, shard_state_dict

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_TIMEOUT_S",
    "BlockPlacement",
    "ContextParallelCache",
    "ContextParallelMLA",
    "RankFailure",
    "TensorParallelMLA",
    "agree",
    "head_range",
    "launch_local",
    "owned_tokens",
    "per_rank_cache_bytes",
    "shard_state_dict",
]


def per_rank_cache_bytes(
    cfg: MLAConfig,
    context: int,
    dtype_bytes: float,
    cp: int = 1,
    tp: int = 1,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    layers: int | None = None,
) -> list[int]:
    """Latent-cache bytes each rank holds for one sequence of `context` tokens, rank = c·tp + t.

    Context parallel deals the tokens round-robin in blocks over `cp` ranks; tensor parallel does
    not divide the cache (every one of the `tp` ranks of a context shard holds all of it). Each token
    costs `cfg.latent_dim · dtype_bytes` per layer, over `layers` layers (default: cfg.num_layers).
    """
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer >= 0, got {context!r}")
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int | float) or not dtype_bytes > 0:
        raise ValueError(f"dtype_bytes must be a number > 0, got {dtype_bytes!r}")
    for name, value in (("cp", cp), ("tp", tp), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if layers is None:
        layers = cfg.num_layers
    elif isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a positive integer or None, got {layers!r}")
    if tp > cfg.num_heads:
        raise ValueError(f"tp={tp} exceeds the {cfg.num_heads} heads of {cfg.name}")
    per_token = cfg.latent_dim * dtype_bytes * layers
    shards = [math.ceil(owned_tokens(context, c, cp, block_size) * per_token) for c in range(cp)]
    return [shards[c] for c in range(cp) for _ in range(tp)]

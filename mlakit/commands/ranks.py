"""Per-rank latent-cache bytes without torch: the arithmetic of mlakit.distributed.per_rank_cache_bytes
(blocks dealt round-robin over the context-parallel ranks; tensor parallel replicates), for `mlakit cache`."""

from __future__ import annotations

import math

from mlakit.config import MLAConfig

DEFAULT_BLOCK_SIZE = 64  # mlakit.distributed.cp.DEFAULT_BLOCK_SIZE
MAX_RANKS = 1 << 16  # cp · tp listed one by one


def owned_tokens(length: int, rank: int, world_size: int, block_size: int) -> int:
    """Tokens among positions 0 .. length-1 in blocks dealt round-robin to `rank` of `world_size`."""
    full, tail = divmod(length, block_size)
    blocks = (full - rank + world_size - 1) // world_size if full > rank else 0
    return blocks * block_size + (tail if full % world_size == rank else 0)


def check_ranks(cfg, cp: int, tp: int) -> None:
    """cp and tp positive integers, at most MAX_RANKS in all, tp at most the heads (MLA or V4)."""
    for name, value in (("cp", cp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if cp * tp > MAX_RANKS:
        raise ValueError(f"--cp × --tp must be at most {MAX_RANKS:,} ranks, got {cp} × {tp} = {cp * tp:,}")
    if tp > cfg.num_heads:
        raise ValueError(f"tp={tp} exceeds the {cfg.num_heads} heads of {cfg.name}")


def per_rank_cache_bytes(cfg: MLAConfig, context: int, value_bytes: float, cp: int, tp: int) -> list[int]:
    """Latent bytes per rank (rank = c·tp + t) for one sequence of `context` tokens over all layers."""
    check_ranks(cfg, cp, tp)
    per_token = cfg.latent_dim * value_bytes * cfg.num_layers
    shards = [math.ceil(owned_tokens(context, c, cp, DEFAULT_BLOCK_SIZE) * per_token) for c in range(cp)]
    return [shards[c] for c in range(cp) for _ in range(tp)]

"""What mlakit's vLLM backend decides, with no vLLM in sight (tested in the main environment).

- `layer_config`: the MLAConfig of one vLLM MLA layer (its heads on this rank, its widths);
- `decode_threshold`: vLLM's `reorder_batch_threshold` from the cost model (or a `mlakit calibrate`
  profile): rows of at most that many new tokens run vLLM's decode (absorbed) path;
- `chunk_path`: absorb or materialize for one prefill chunk over its cached prefix (`mlakit.dispatch`);
- `page_rows`: vLLM's block table as one row id per (request, position) of its flat pool;
- `runs`: consecutive requests with the same query length (one absorbed call each).
"""

from __future__ import annotations

import torch

from mlakit.config import MLAConfig
from mlakit.dispatch import choose


def layer_config(
    num_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None = None,
) -> MLAConfig:
    """The widths the cost model reads (hidden_size is not one of them: the heads stand in for it)."""
    return MLAConfig(
        hidden_size=num_heads,
        num_heads=num_heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
    )


def decode_threshold(cfg: MLAConfig, context: int, profile=None, cap: int = 1024) -> int:
    """The most new tokens a row may have and still be cheaper absorbed than materialized over
    `context` cached tokens, at least 1 and at most `cap`. The crossover grows with the context, so
    a row this short is cheaper absorbed over any longer prefix too: the backend passes one block
    (the shortest prefix a cached chunk has). vLLM splits decode rows from prefill rows by this count
    alone; the rows past it are decided one by one (`chunk_path`), their cached prefix known."""
    if context <= 0:
        raise ValueError(f"context must be > 0, got {context}")
    if choose(cfg, 1, context, profile) == "materialize":
        return 1
    low, high = 1, cap  # absorb at `low`; find the last count where it still wins
    if choose(cfg, high, context, profile) == "absorb":
        return high
    while high - low > 1:
        mid = (low + high) // 2
        if choose(cfg, mid, context, profile) == "absorb":
            low = mid
        else:
            high = mid
    return low


def chunk_path(cfg: MLAConfig, new: int, cached: int, profile=None) -> str:
    """ "absorb" or "materialize" for `new` query tokens over `cached` earlier ones (vLLM always
    materializes there)."""
    if new <= 0 or cached < 0:
        raise ValueError(f"a chunk needs new > 0 and cached >= 0, got new={new}, cached={cached}")
    return choose(cfg, new, cached, profile)


def page_rows(block_table: torch.Tensor, block_size: int, keys: int) -> torch.Tensor:
    """[B, keys] int64 row ids into the pool viewed as [num_blocks · block_size, width]: position t of
    request b sits at row block_table[b, t // block_size] · block_size + t % block_size."""
    if block_size <= 0 or keys < 0:
        raise ValueError(f"block_size must be > 0 and keys >= 0, got {block_size} and {keys}")
    blocks = -(-keys // block_size)
    if blocks > block_table.shape[1]:
        raise ValueError(f"{keys} keys need {blocks} blocks, the block table holds {block_table.shape[1]}")
    table = block_table[:, :blocks].to(torch.long)
    offsets = torch.arange(block_size, dtype=torch.long, device=table.device)
    rows = (table.unsqueeze(-1) * block_size + offsets).reshape(table.shape[0], -1)
    return rows[:, :keys].contiguous()


def runs(query_lens: list[int]) -> list[tuple[int, int, int]]:
    """(first request, last request + 1, query length) of each run of equal query lengths, in order."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(query_lens) + 1):
        if i == len(query_lens) or query_lens[i] != query_lens[start]:
            out.append((start, i, query_lens[start]))
            start = i
    return out

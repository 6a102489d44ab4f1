"""A patched DSA layer's top-k, computed as transformers' own indexer computes it.

`mlakit.ops.sparse` scores keys block by block and breaks ties by lowest position (its documented
rule, kept for `MLAAttention`). A patched transformers model must select what the unpatched model
selects, ties included: keys tie at exactly 0.0 after the ReLU, and `torch.topk` keeps whichever of
them its kernel keeps. So the scores here are transformers' (DeepseekV32Indexer / GlmMoeDsaIndexer
`forward`): the same ops in the same order and precision (fp32 products of the model-dtype q and k,
ReLU, the per-head weights applied by one matmul, the mask added or filled, `topk` over every key of
the cache view), on rows of the same length, so `torch.topk` sees the very same rows.
"""

from __future__ import annotations

import torch

# [B, s, H_I, T] fp32 scores held at once; past this the queries are taken in chunks (per-row
# results are unchanged: each query's dots are the same GEMM, its top-k the same row)
SCORE_BUDGET_BYTES = 1 << 28


@torch.no_grad()
def hf_index_topk(indexer, q_idx, k_idx, hidden, mask, topk: int) -> torch.Tensor:
    """q_idx [B,S,H_I,d_I] and k_idx [B,T,d_I] rotated (model dtype), hidden [B,S,D], mask [b,S,T]
    (bool: True attends; float: added) → int32 [B,S,min(topk,T)], as transformers' indexer returns."""
    batch, new, heads, _ = q_idx.shape
    keys = k_idx.shape[1]
    k_t = k_idx.transpose(-1, -2).float().unsqueeze(1)  # [B, 1, d_I, T]
    w = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * (indexer.n_heads**-0.5)
    step = max(1, min(new, SCORE_BUDGET_BYTES // max(1, 4 * batch * heads * keys)))
    k = min(topk, keys)
    out = []
    for s0 in range(0, new, step):
        s1 = min(new, s0 + step)
        scores = torch.matmul(q_idx[:, s0:s1].float(), k_t) * indexer.softmax_scale  # [B, s, H_I, T]
        scores = torch.relu(scores)
        index = torch.matmul(w[:, s0:s1].unsqueeze(-2), scores).squeeze(-2)  # [B, s, T]
        part = mask[:, s0:s1]
        index = index.masked_fill(~part, float("-inf")) if part.dtype == torch.bool else index + part
        out.append(index.topk(k, dim=-1).indices.to(torch.int32))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def with_selection(mask: torch.Tensor, topk: torch.Tensor, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """transformers' eager/sdpa DSA mask: mask [b,1,S,T] with every key outside topk [B,S,k] hidden
    (bool: False; float: the model dtype's minimum)."""
    batch, new = topk.shape[:2]
    unselected = (
        torch.ones(batch, new, keys, dtype=torch.bool, device=topk.device)
        .scatter(-1, topk.long(), False)
        .unsqueeze(1)
    )  # [B, 1, S, T]
    if mask.dtype == torch.bool:
        return mask & ~unselected
    return mask.masked_fill(unselected, torch.finfo(dtype).min)

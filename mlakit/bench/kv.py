"""MHA, GQA(g) and MQA layers at the MLA model's head width, each with its own K/V cache.

Head width `dh = v_head_dim` for keys and values and the model's head count H: the DeepSeek-V2
paper's comparison (MHA caches 2·H·dh values per token, MLA kv_lora_rank + rope). One set of random
weights serves all three: a layer with g key/value heads uses the first g heads of K and V. No rope:
rotating the new tokens' queries and keys is a negligible part of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KVWeights:
    wq: torch.Tensor  # [H·dh, D]
    wk: torch.Tensor  # [H·dh, D]: heads 0..g-1 serve a layer with g key/value heads
    wv: torch.Tensor  # [H·dh, D]
    wo: torch.Tensor  # [D, H·dh] (may be a transposed view)
    heads: int
    head_dim: int

    @classmethod
    def random(cls, hidden: int, heads: int, head_dim: int, *, dtype, device, seed: int = 0) -> KVWeights:
        """One random [H·dh, D] matrix serves as W_q, W_k, W_v and (transposed) W_o: a step reads each
        projection's bytes all the same, and filling 4× fewer random values keeps the setup short."""
        gen = torch.Generator().manual_seed(seed)
        bound = 1 / math.sqrt(hidden)
        w = torch.empty(heads * head_dim, hidden).uniform_(-bound, bound, generator=gen)
        w = w.to(device=device, dtype=dtype)
        return cls(w, w, w, w.t(), heads, head_dim)


class KVLayer:
    """Attention with `kv_heads` key/value heads (H: MHA, 1: MQA) over a static K/V cache."""

    def __init__(self, weights: KVWeights, kv_heads: int):
        if weights.heads % kv_heads:
            raise ValueError(f"kv_heads must divide the {weights.heads} heads, got {kv_heads}")
        self.w = weights
        self.kv_heads = kv_heads
        width = kv_heads * weights.head_dim
        self.wk, self.wv = weights.wk[:width], weights.wv[:width]
        self.scale = weights.head_dim**-0.5

    def new_cache(self, batch: int, max_len: int, *, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, self.kv_heads, max_len, self.w.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def values_per_token(self) -> int:
        return 2 * self.kv_heads * self.w.head_dim

    def step(self, hidden, cache_k, cache_v, cached: int, attend=None) -> torch.Tensor:
        """hidden [B,S,D]: write the new K/V at cached.., attend over 0..cached+S-1 → [B,S,D]."""
        batch, new, _ = hidden.shape
        heads, dh, g = self.w.heads, self.w.head_dim, self.kv_heads
        q = F.linear(hidden, self.w.wq).view(batch, new, heads, dh).transpose(1, 2)  # [B, H, S, dh]
        k = F.linear(hidden, self.wk).view(batch, new, g, dh).transpose(1, 2)  # [B, g, S, dh]
        v = F.linear(hidden, self.wv).view(batch, new, g, dh).transpose(1, 2)
        end = cached + new
        cache_k[:, :, cached:end] = k
        cache_v[:, :, cached:end] = v
        out = (attend or grouped_sdpa)(q, cache_k[:, :, :end], cache_v[:, :, :end], self.scale)
        return F.linear(out.transpose(1, 2).reshape(batch, new, heads * dh), self.w.wo)


def grouped_sdpa(q, k, v, scale) -> torch.Tensor:
    """q [B,H,S,dh] against k, v [B,g,T,dh] (the last S keys are the queries' own): causal SDPA.

    The H/g query heads of a group are folded into the query rows, so each key/value head is read
    once, never repeated per query head.
    """
    batch, heads, new, dh = q.shape
    groups, keys = k.shape[1], k.shape[2]
    rep = heads // groups
    q = q.reshape(batch, groups, rep * new, dh)  # [B, g, r·S, dh]
    mask = None
    if new > 1:
        query_pos = keys - new + torch.arange(new, device=q.device)
        keep = torch.arange(keys, device=q.device)[None, :] <= query_pos[:, None]  # [S, T]
        mask = keep.repeat(rep, 1)  # [r·S, T]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, g, r·S, dh]
    return out.reshape(batch, heads, new, dh)


def naive_attention(q, k, v, scale) -> torch.Tensor:
    """The oracle for `grouped_sdpa`: fp64, keys repeated per query head, explicit causal softmax."""
    batch, heads, new, dh = q.shape
    keys = k.shape[2]
    rep = heads // k.shape[1]
    kf = k.double().repeat_interleave(rep, dim=1)  # [B, H, T, dh]
    vf = v.double().repeat_interleave(rep, dim=1)
    scores = q.double() @ kf.transpose(2, 3) * scale  # [B, H, S, T]
    hidden = torch.arange(keys)[None, :] > (keys - new + torch.arange(new))[:, None]
    scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
    return (scores.softmax(dim=-1) @ vf).to(q.dtype)

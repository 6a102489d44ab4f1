"""Absorb: fold W_UK into the queries and W_UV after the weighted sum; attend over the latent itself.

Every head scores against the same [c_kv | k_pe] rows (an MQA over the cache): no per-head key or
value is ever built, so memory beyond the cache grows with heads × new tokens only.
"""

from __future__ import annotations

import torch

from mlakit.ops.common import context_mask, query_chunk, softmax_lse


def absorb(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    *,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, new, heads, _ = q_nope.shape
    keys = int(kv_lens.max())
    c_kv, k_pe = c_kv[:, :keys], k_pe[:, :keys]
    q_lat = fold_queries(q_nope, w_uk)  # [B, S, H, L]
    outs, lses = [], []
    step = query_chunk(heads * batch, keys, new)
    for start in range(0, new, step):
        stop = min(new, start + step)
        mask = context_mask(kv_lens, new, start, stop, 0, keys, c_kv.device, key_mask)
        o_lat, lse = latent_attention(q_lat[:, start:stop], q_pe[:, start:stop], c_kv, k_pe, mask, scale)
        outs.append(o_lat)
        lses.append(lse)
    o_lat = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
    return unfold_values(o_lat, w_uv), lse


def fold_queries(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [B,S,H,dn] · W_UK[h] → [B,S,H,L]: one bmm over heads."""
    batch, new, heads, dn = q_nope.shape
    q = q_nope.reshape(batch * new, heads, dn).transpose(0, 1)  # [H, B·S, dn]
    q_lat = torch.bmm(q, w_uk)  # [H, B·S, L]
    return q_lat.transpose(0, 1).reshape(batch, new, heads, -1)


def unfold_values(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [B,S,H,L] · W_UV[h]ᵀ → [B,S,H,dv]."""
    batch, new, heads, latent = o_lat.shape
    o = o_lat.reshape(batch * new, heads, latent).transpose(0, 1)  # [H, B·S, L]
    out = torch.bmm(o, w_uv.transpose(1, 2))  # [H, B·S, dv]
    return out.transpose(0, 1).reshape(batch, new, heads, -1)


def latent_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA over the latent: q_lat [B,s,H,L], q_pe [B,s,H,dr] against c_kv [B,T,L], k_pe [B,T,dr].

    Returns the latent-space output [B,s,H,L] and lse [B,s,H] (fp32).
    """
    batch, new, heads, latent = q_lat.shape
    keys = c_kv.shape[1]
    q_l = q_lat.reshape(batch, new * heads, latent)
    q_r = q_pe.reshape(batch, new * heads, -1)
    rope_scores = torch.bmm(q_r, k_pe.transpose(1, 2))  # [B, s·H, T]
    scores = torch.baddbmm(rope_scores, q_l, c_kv.transpose(1, 2), beta=scale, alpha=scale)
    scores = scores.float()
    if mask is not None:
        scores.view(batch, new, heads, keys).masked_fill_(mask[:, :, None, :], float("-inf"))
    probs, lse = softmax_lse(scores)
    o_lat = torch.bmm(probs.to(c_kv.dtype), c_kv)  # [B, s·H, L]
    return o_lat.view(batch, new, heads, latent), lse.view(batch, new, heads)

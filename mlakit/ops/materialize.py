"""Materialize: expand each cached latent into per-head keys and values, then ordinary attention.

The expansion works through the context `workspace_tokens` keys at a time and merges the partial
results by log-sum-exp, so its extra memory is bounded whatever the context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlakit.ops.common import (
    acc_dtype,
    compute_dtype,
    context_mask,
    query_chunk,
    softmax_lse,
    zero_past_lengths,
)
from mlakit.ops.merge import merge

# 4,096 keeps 512 new tokens over 64K cached at DeepSeek-V3 widths in bf16 at ~1.5 GB of peak tensors
# (docs/cache.md); one shot would expand 5.4 GB of K/V
DEFAULT_WORKSPACE_TOKENS = 4096


def materialize(
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
    workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
    need_lse: bool = True,
    max_keys: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See `mlakit.ops`. With need_lse=False a one-shot call may run through SDPA and returns lse None.
    `max_keys` (a plan's bucket): exactly that many keys, masked past kv_lens, no host read."""
    if workspace_tokens <= 0:
        raise ValueError(f"workspace_tokens must be > 0, got {workspace_tokens}")
    static = max_keys is not None
    keys = max_keys if static else int(kv_lens.max())
    cd = compute_dtype(c_kv.dtype, c_kv.device)
    w_uk, w_uv = w_uk.to(cd), w_uv.to(cd)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2).to(cd)  # [B, H, S, dn+dr]
    if keys <= workspace_tokens and not need_lse and not q.requires_grad:
        latent, rope = (zero_past_lengths(t[:, :keys], kv_lens, 0, static).to(cd) for t in (c_kv, k_pe))
        k, v = expand(latent, rope, w_uk, w_uv)
        return _sdpa(q, k, v, kv_lens, q_nope.shape[1], scale, key_mask, static).to(q_nope.dtype), None
    out = lse = None
    for start in range(0, keys, workspace_tokens):
        stop = min(keys, start + workspace_tokens)
        latent, rope = (
            zero_past_lengths(t[:, start:stop], kv_lens, start, static).to(cd) for t in (c_kv, k_pe)
        )
        k, v = expand(latent, rope, w_uk, w_uv)
        part, part_lse = _attend(q, k, v, kv_lens, start, scale, key_mask, static)
        # free this chunk's K/V before the next is expanded, and fold the part in at once
        del k, v, latent, rope
        out, lse = (part, part_lse) if out is None else merge([out, part], [lse, part_lse])
    return out.to(q_nope.dtype), lse


def expand(
    c_kv: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents [B,T,L] → keys [B,H,T,dn+dr] (shared rope key beside the nope) and values [B,H,T,dv]."""
    heads, dn, latent = w_uk.shape
    batch, keys, _ = c_kv.shape
    k_nope = F.linear(c_kv, w_uk.reshape(heads * dn, latent)).view(batch, keys, heads, dn)
    v = F.linear(c_kv, w_uv.reshape(-1, latent)).view(batch, keys, heads, -1)
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(batch, keys, heads, k_pe.shape[-1])], dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


def _sdpa(q, k, v, kv_lens, new, scale, key_mask, static=False):
    keys = k.shape[2]
    dv = v.shape[-1]
    if dv != q.shape[-1]:
        # fused SDPA kernels want one head width: with V narrower than K (128 vs 192 for V3) the CPU
        # falls back to the math kernel, which holds H·S·T fp32 scores (19 GB at 4K new tokens)
        # (laid out like k: a padded V in another layout sends it back to the math kernel)
        padded = torch.empty_like(k) if dv < k.shape[-1] else None
        if padded is not None:
            padded[..., :dv].copy_(v)
            padded[..., dv:].zero_()
            v = padded
    causal = not static and key_mask is None and new == keys and bool((kv_lens == keys).all())
    mask = None if causal else context_mask(kv_lens, new, 0, new, 0, keys, q.device, key_mask, static)
    if mask is not None:
        mask = ~mask[:, None]  # SDPA keeps True
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and new > 1, scale=scale)
    return out[..., :dv].transpose(1, 2)  # [B, S, H, dv]


def _attend(q, k, v, kv_lens, key_start, scale, key_mask, static=False):
    """Attention of all queries to keys key_start.. of the context: (out [B,S,H,dv] fp32, lse [B,S,H])."""
    batch, heads, new, _ = q.shape
    keys = k.shape[2]
    outs, lses = [], []
    step = query_chunk(batch * heads, keys, new)
    for start in range(0, new, step):
        stop = min(new, start + step)
        scores = torch.matmul(q[:, :, start:stop], k.transpose(2, 3))  # [B, H, s, T]
        scores = scores.to(acc_dtype(scores.dtype))
        mask = context_mask(
            kv_lens, new, start, stop, key_start, key_start + keys, q.device, key_mask, static
        )
        if scores.requires_grad:
            scores = scores * scale
            if mask is not None:
                scores = scores.masked_fill(mask[:, None], float("-inf"))
        else:
            scores.mul_(scale)
            if mask is not None:
                scores.masked_fill_(mask[:, None], float("-inf"))
        probs, lse = softmax_lse(scores)
        outs.append(torch.matmul(probs.to(v.dtype), v).to(probs.dtype).transpose(1, 2))  # [B, s, H, dv]
        lses.append(lse.transpose(1, 2))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)

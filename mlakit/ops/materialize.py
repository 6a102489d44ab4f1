"""Materialize: expand each cached latent into per-head keys and values, then ordinary attention.

The expansion works through the context `workspace_tokens` keys at a time and merges the partial
results by log-sum-exp, so its extra memory is bounded whatever the context length.

Two cores attend over the expanded keys: the fused CPU prefill core (`mlakit.ops.cpu_core`: bf16
products, fp32 scores, the expanded keys and values read in place, the rope key never copied per
head) where it can run, and torch (SDPA, or explicit scores where an lse is wanted) everywhere;
`core=` picks ("auto", "fused", "torch").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlakit.ops import cpu_core
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
    core: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See `mlakit.ops`. With need_lse=False a one-shot call may run through SDPA (or the fused core)
    and returns lse None. `max_keys` (a plan's bucket): exactly that many keys, masked past kv_lens, no
    host read. `core`: "auto" (the fused CPU prefill core where it can run), "fused" (that core or a
    ValueError saying why not), "torch"."""
    if workspace_tokens <= 0:
        raise ValueError(f"workspace_tokens must be > 0, got {workspace_tokens}")
    static = max_keys is not None
    keys = max_keys if static else int(kv_lens.max())
    if _use_fused(core, q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, key_mask):
        return _fused(q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, scale, keys, workspace_tokens, need_lse)
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


def _use_fused(core, q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, key_mask) -> bool:
    """Whether `core` runs the fused prefill core on these tensors ("fused" where it cannot: a
    ValueError naming why)."""
    cpu_core.check_core(core)
    if core == "torch":
        return False
    why = cpu_core.prefill_reason(q_nope, q_pe, w_uv.shape[1])
    if why is None and key_mask is not None:
        why = "a key_mask (left padding)"
    if why is None and any(t.dtype != torch.bfloat16 for t in (c_kv, k_pe, w_uk, w_uv)):
        why = "the cache or the weights are not bf16"
    if why is None and torch.is_grad_enabled() and any(t.requires_grad for t in (c_kv, k_pe, w_uk, w_uv)):
        why = "autograd"
    if why is not None and core == "fused":
        raise ValueError(f"core='fused' cannot run here: {why}")
    return why is None


def _fused(q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, scale, keys, workspace_tokens, need_lse):
    """The fused core over the context, `workspace_tokens` keys at a time (merged by lse). Keys no
    query sees are never read, so nothing past a row's length needs zeroing."""
    w_kv = joined(w_uk, w_uv)
    dn = w_uk.shape[1]
    out = lse = None
    for start in range(0, keys, workspace_tokens):
        stop = min(keys, start + workspace_tokens)
        kv = F.linear(c_kv[:, start:stop], w_kv)  # [B, t, H·(dn+dv)]
        kv = kv.view(*kv.shape[:2], w_uk.shape[0], -1)
        part, part_lse = cpu_core.fused_prefill(
            q_nope,
            q_pe,
            kv[..., :dn],
            k_pe[:, start:stop],
            kv[..., dn:],
            kv_lens,
            scale,
            key_start=start,
            need_lse=need_lse or stop < keys or start > 0,
        )
        del kv
        out, lse = (part, part_lse) if out is None else merge([out, part], [lse, part_lse])
    return out.to(q_nope.dtype), lse


def joined(w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """[H·(dn+dv), L]: each head's w_uk rows then its w_uv rows, the layout of kv_b_proj's weight (one
    GEMM expands keys and values); a view when w_uk and w_uv are the two halves of that weight, as
    the layers' `up_weights` give them, else a copy."""
    heads, dn, latent = w_uk.shape
    width = dn + w_uv.shape[1]
    halves = (
        w_uk.stride() == (width * latent, latent, 1)
        and w_uv.stride() == w_uk.stride()
        and w_uv.untyped_storage().data_ptr() == w_uk.untyped_storage().data_ptr()
        and w_uv.storage_offset() == w_uk.storage_offset() + dn * latent
    )
    if halves:
        return w_uk.as_strided((heads * width, latent), (latent, 1))
    return torch.cat([w_uk, w_uv], dim=1).reshape(heads * width, latent)


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

"""Absorb: fold W_UK into the queries and W_UV after the weighted sum; attend over the latent itself.

Every head scores against the same [c_kv | k_pe] rows (an MQA over the cache): no per-head key or
value is ever built, so memory beyond the cache grows with heads × new tokens only. The cache is
read block by block: each block is converted once to the compute dtype and used for both the
scores and the weighted sum while it is still in cache, with an online softmax across blocks.

Two cores compute the latent attention: the fused CPU core (`mlakit.ops.cpu_core`: bf16 products,
fp32 scores, the cache read in place) where it can run, and the torch core (`latent_attention`) in
`core_dtype` (fp32 for a 16-bit cache on a CPU) everywhere; `core=` picks ("auto", "fused", "torch").
"""

from __future__ import annotations

import torch

from mlakit.ops.common import (
    acc_dtype,
    compute_dtype,
    context_mask,
    core_dtype,
    query_chunk,
    softmax_lse,
)
from mlakit.ops.cpu_core import check_core, few_rows_fit, fold_heads, fused_latent, unfold_heads, use_fused
from mlakit.ops.vnni import UpPacks

# cached tokens per block of the online softmax (1024 × 512 fp32 latents = 2 MB)
KEY_BLOCK = 1024


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
    max_keys: int | None = None,
    core: str = "auto",
    packs: UpPacks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `mlakit.ops`. `max_keys` (a plan's bucket): attend over exactly that many keys, masked past
    kv_lens, without reading kv_lens back to the host. `core`: "auto" (the fused CPU core where it can
    run), "fused" (that core or a ValueError saying why not), "torch". `packs`: packed copies of w_uk
    and w_uv (`mlakit.ops.vnni.UpPacks`) for the folds of bf16 rows on the CPU."""
    check_core(core)
    batch, new, heads, _ = q_nope.shape
    static = max_keys is not None
    keys = max_keys if static else int(kv_lens.max())
    if c_kv.shape[1] != keys:  # a plan's context already has exactly `keys` keys: no slice op
        c_kv, k_pe = c_kv[:, :keys], k_pe[:, :keys]
    cd = compute_dtype(c_kv.dtype, c_kv.device)
    q_lat = fold_queries(q_nope.to(cd), w_uk.to(cd), packs)  # [B, S, H, L]
    q_pe = q_pe.to(cd)
    if use_fused(core, q_lat, c_kv, k_pe, key_mask):
        o_lat, lse = fused_latent(q_lat, q_pe, c_kv, k_pe, kv_lens, scale)
        return unfold_values(o_lat.to(cd), w_uv.to(cd), packs).to(q_nope.dtype), lse
    outs, lses = [], []
    step = query_chunk(heads * batch, min(keys, KEY_BLOCK), new)
    for start in range(0, new, step):
        stop = min(new, start + step)
        mask = context_mask(kv_lens, new, start, stop, 0, keys, c_kv.device, key_mask, static)
        q_l, q_r = (q_lat, q_pe) if stop - start == new else (q_lat[:, start:stop], q_pe[:, start:stop])
        o_lat, lse = latent_attention(q_l, q_r, c_kv, k_pe, mask, scale, static=static)
        outs.append(o_lat)
        lses.append(lse)
    o_lat = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
    return unfold_values(o_lat.to(cd), w_uv.to(cd), packs).to(q_nope.dtype), lse


# rows of one fused `unfold_heads` call, and up to how many rows it runs in such chunks rather than as a
# bf16 bmm over the strided per-head view (which copies the weight first): 16 heads x 512 latent x 128,
# one thread, Intel AVX512-BF16: 32 rows 1.2 vs 2.3 ms, 64 rows 2.5 vs 3.2, 128 rows 5.0 vs 4.9
UNFOLD_ROWS = 8
UNFOLD_CHUNKED_ROWS = 64


def fold_queries(q_nope: torch.Tensor, w_uk: torch.Tensor, packs: UpPacks | None = None) -> torch.Tensor:
    """q_nope [B,S,H,dn] · W_UK[h] → [B,S,H,L]: one bmm over heads (or `packs.fold`: the packed copy
    of W_UK the engine keeps, for bf16 rows on the CPU)."""
    batch, new, heads, dn = q_nope.shape
    flat = q_nope.reshape(batch * new, heads, dn)
    if packs is not None and packs.fold.fits(flat):
        return packs.fold.mm(flat).view(batch, new, heads, -1)
    if w_uk.shape[-1] % 16 == 0 and few_rows_fit(q_nope, w_uk, batch * new):
        # a bf16 bmm over the strided per-head view of kv_b_proj copies the weight first
        return fold_heads(q_nope.reshape(batch * new, heads, dn), w_uk).view(batch, new, heads, -1)
    q = q_nope.reshape(batch * new, heads, dn).transpose(0, 1)  # [H, B·S, dn]
    q_lat = torch.bmm(q, w_uk)  # [H, B·S, L]
    return q_lat.transpose(0, 1).reshape(batch, new, heads, -1)


def unfold_values(o_lat: torch.Tensor, w_uv: torch.Tensor, packs: UpPacks | None = None) -> torch.Tensor:
    """o_lat [B,S,H,L] · W_UV[h]ᵀ → [B,S,H,dv] (or through `packs.unfold`, as `fold_queries`)."""
    batch, new, heads, latent = o_lat.shape
    rows = batch * new
    if packs is not None and packs.unfold.fits(o_lat.reshape(rows, heads, latent)):
        return packs.unfold.mm(o_lat.reshape(rows, heads, latent)).view(batch, new, heads, -1)
    if few_rows_fit(o_lat, w_uv, min(rows, UNFOLD_ROWS), limit=UNFOLD_ROWS) and rows <= UNFOLD_CHUNKED_ROWS:
        # the fused core takes 8 rows a call; each row's sums are its own, so chunks change nothing
        flat = o_lat.reshape(rows, heads, latent)
        if rows <= UNFOLD_ROWS:
            return unfold_heads(flat, w_uv).view(batch, new, heads, -1)
        parts = [unfold_heads(flat[i : i + UNFOLD_ROWS], w_uv) for i in range(0, rows, UNFOLD_ROWS)]
        return torch.cat(parts).view(batch, new, heads, -1)
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
    *,
    static: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA over the latent: q_lat [B,s,H,L], q_pe [B,s,H,dr] against c_kv [B,T,L], k_pe [B,T,dr].

    `mask` [B,s,T] is True where a key is hidden. Returns the latent-space output [B,s,H,L] in fp32
    and lse [B,s,H] (fp32). `static`: mask hidden keys' values without checking whether any is hidden.
    The torch core: matmuls in `core_dtype` (fp32 scores from a 16-bit cache on a CPU).
    """
    batch, new, heads, latent = q_lat.shape
    if c_kv.shape[1] == 0:
        # no keys: nothing to mix, and a softmax denominator of zero
        acc = acc_dtype(q_lat.dtype)
        lse = torch.full((batch, new, heads), float("-inf"), dtype=acc, device=q_lat.device)
        return torch.zeros(batch, new, heads, latent, dtype=acc, device=q_lat.device), lse
    cd = core_dtype(c_kv.dtype, c_kv.device)
    q_l = q_lat.reshape(batch, new * heads, latent).to(cd)
    q_r = q_pe.reshape(batch, new * heads, -1).to(cd)
    if mask is not None:
        mask = mask[:, :, None, :]  # [B, s, 1, T]: the same for every head
    grad = torch.is_grad_enabled() and (q_l.requires_grad or c_kv.requires_grad)
    if not grad and c_kv.shape[1] <= KEY_BLOCK and cd == acc_dtype(cd):
        # the scale rides on the score matmuls (alpha/beta) instead of two query multiplies
        o_lat, lse = _single_block(q_l, q_r, c_kv.to(cd), k_pe.to(cd), mask, static, scale)
        return o_lat.view(batch, new, heads, latent), lse.view(batch, new, heads)
    q_l, q_r = q_l * scale, q_r * scale
    if grad:
        o_lat, lse = _one_block(q_l, q_r, c_kv.to(cd), k_pe.to(cd), mask, static)
    else:
        o_lat, lse = _blocked(q_l, q_r, c_kv, k_pe, mask, cd, static)
    return o_lat.view(batch, new, heads, latent), lse.view(batch, new, heads)


def _scores(q_l, q_r, c, kp, mask, scale: float = 1.0):
    """Scores [B, s·H, T] (times `scale`) in fp32 with hidden keys at -inf."""
    scores = torch.bmm(q_r, kp.transpose(1, 2)).baddbmm_(q_l, c.transpose(1, 2), beta=scale, alpha=scale)
    scores = scores.to(acc_dtype(scores.dtype))
    if mask is not None:
        batch, rows, keys = scores.shape
        shaped = scores.view(batch, mask.shape[1], rows // mask.shape[1], keys)
        if torch.is_grad_enabled() and scores.requires_grad:
            scores = shaped.masked_fill(mask, float("-inf")).view(batch, rows, keys)
        else:
            shaped.masked_fill_(mask, float("-inf"))
    return scores


def _visible_values(c: torch.Tensor, mask: torch.Tensor | None, static: bool = False) -> torch.Tensor:
    """c [B,t,L] with the keys no query sees zeroed: they get probability 0, but 0 × NaN is NaN, and
    whatever a slot held past its length (a released request, a rejected draft) must not leak in."""
    if mask is None:
        return c
    unseen = mask.all(dim=1).transpose(1, 2)  # [B, t, 1]
    if not static and not bool(unseen.any()):
        return c
    return c.masked_fill(unseen, 0)


def _one_block(q_l, q_r, c, kp, mask, static=False):
    """Differentiable form: all keys at once."""
    c = _visible_values(c, mask, static)
    probs, lse = softmax_lse(_scores(q_l, q_r, c, kp, mask))
    return torch.bmm(probs.to(c.dtype), c).to(probs.dtype), lse


def _single_block(q_l, q_r, c, kp, mask, static=False, scale=1.0):
    """No autograd, one key block, fp32/fp64 matmuls: the softmax in one pass, in place (the online
    softmax's bookkeeping is ~20 ops a call, most of the decode cost at small widths)."""
    c = _visible_values(c, mask, static)
    scores = _scores(q_l, q_r, c, kp, mask, scale)  # [B, s·H, T]
    lse = scores.logsumexp(dim=-1)  # -inf where every key is hidden
    # such rows: exp(-inf - 0) = 0, zero probabilities as softmax_lse gives
    probs = scores.sub_(lse.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)[..., None]).exp_()
    return torch.bmm(probs, c), lse


def _blocked(q_l, q_r, c_kv, k_pe, mask, cd, static=False):
    """Online softmax over key blocks: running max, denominator and unnormalized output in fp32.

    Converted blocks and scores live in buffers allocated once per call: a fresh multi-MB tensor per
    block costs page faults that were measured to be slower than the conversion itself.
    """
    batch, rows = q_l.shape[:2]
    keys = c_kv.shape[1]
    block = min(KEY_BLOCK, keys)
    f = {"dtype": acc_dtype(cd), "device": q_l.device}
    peak = torch.full((batch, rows), float("-inf"), **f)
    denom = torch.zeros(batch, rows, **f)
    acc = torch.zeros(batch, rows, c_kv.shape[-1], **f)
    c_buf = _buffer(c_kv, block, cd)
    k_buf = _buffer(k_pe, block, cd)
    s_buf = torch.empty(batch * rows * block, dtype=cd, device=q_l.device)
    for k0 in range(0, keys, block):
        k1 = min(keys, k0 + block)
        block_mask = None if mask is None else mask[..., k0:k1]
        c = _visible_values(
            _convert(c_kv[:, k0:k1], c_buf), block_mask, static
        )  # [B, t, L]: converted once, used twice
        scores = s_buf[: batch * rows * (k1 - k0)].view(batch, rows, k1 - k0)
        torch.bmm(q_r, _convert(k_pe[:, k0:k1], k_buf).transpose(1, 2), out=scores)
        scores = scores.baddbmm_(q_l, c.transpose(1, 2)).to(acc.dtype)
        if block_mask is not None:
            scores.view(batch, block_mask.shape[1], -1, k1 - k0).masked_fill_(block_mask, float("-inf"))
        new_peak = torch.maximum(peak, scores.amax(dim=-1))
        safe = torch.where(torch.isinf(new_peak), torch.zeros_like(new_peak), new_peak)
        probs = scores.sub_(safe[..., None]).exp_()
        rescale = torch.exp(peak - safe)
        denom.mul_(rescale).add_(probs.sum(dim=-1))
        acc.mul_(rescale[..., None])
        if cd == acc.dtype:
            acc.baddbmm_(probs, c)
        else:
            acc.add_(torch.bmm(probs.to(cd), c).to(acc.dtype))
        peak = new_peak
    lse = peak + torch.log(denom)
    return acc.div_(denom.clamp_min(torch.finfo(acc.dtype).tiny)[..., None]), lse


def biased_block(q_lat, q_pe, c_kv, k_pe, bias, scale: float) -> torch.Tensor:
    """One key block against an additive mask built once per step: q_lat [B,s,H,L], q_pe [B,s,H,dr],
    c_kv [B,T,L], k_pe [B,T,dr], bias [B,s,T] (0 visible, -inf hidden; every query sees at least one
    key) -> o_lat [B,s,H,L] in the core dtype, no lse. The scores start from the mask (the first
    matmul's input), so a decode step's attention core is four ops. Keys hidden from every query must
    hold finite values (0 x NaN is NaN): every cache reads zeros past a slot's length."""
    batch, new, heads, latent = q_lat.shape
    cd = core_dtype(c_kv.dtype, c_kv.device)
    q_l = q_lat.reshape(batch, new * heads, latent).to(cd)
    q_r = q_pe.reshape(batch, new * heads, -1).to(cd)
    c, kp = c_kv.to(cd), k_pe.to(cd)
    if new > 1:  # the same mask row for every head of a query
        bias = bias[:, :, None, :].expand(batch, new, heads, bias.shape[-1]).reshape(batch, new * heads, -1)
    scores = torch.baddbmm(bias, q_r, kp.transpose(1, 2), alpha=scale)
    scores.baddbmm_(q_l, c.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1), c).view(batch, new, heads, latent)


def absorb_one_block(q_nope, q_pe, c_kv, k_pe, bias, w_uk, w_uv, scale: float) -> torch.Tensor:
    """Absorb over one key block in the storage dtype (fp32/fp64: nothing converted), against a plan's
    additive mask bias [B,s,T]: fold, scores, softmax, weighted sum, unfold in ~16 tensor calls (the
    arithmetic of `fold_queries` + `biased_block` + `unfold_values`). Returns out [B,s,H,dv]."""
    batch, new, heads, dn = q_nope.shape
    rows = batch * new
    q_lat = torch.bmm(q_nope.reshape(rows, heads, dn).transpose(0, 1), w_uk).transpose(0, 1)  # [B·s, H, L]
    if new > 1:  # the same mask row for every head of a query; queries (s, H) flattened per row
        bias = bias[:, :, None, :].expand(batch, new, heads, bias.shape[-1]).reshape(batch, new * heads, -1)
        q_lat = q_lat.reshape(batch, new * heads, -1)
    q_r = q_pe.reshape(batch, new * heads, -1)
    scores = torch.baddbmm(bias, q_r, k_pe.transpose(1, 2), alpha=scale)
    scores.baddbmm_(q_lat, c_kv.transpose(1, 2), alpha=scale)
    o_lat = torch.bmm(torch.softmax(scores, dim=-1), c_kv)  # [B, s·H, L]
    out = torch.bmm(o_lat.view(rows, heads, -1).transpose(0, 1), w_uv.transpose(1, 2))  # [H, B·s, dv]
    return out.transpose(0, 1).view(batch, new, heads, -1)


def _buffer(x: torch.Tensor, block: int, cd: torch.dtype) -> torch.Tensor | None:
    """A [B, block, width] buffer in `cd` when x must be converted, else None."""
    if x.dtype == cd:
        return None
    return torch.empty(x.shape[0], block, x.shape[-1], dtype=cd, device=x.device)


def _convert(x: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    if buf is None:
        return x
    out = buf[:, : x.shape[1]]
    out.copy_(x)
    return out

"""Absorb over a context read chunk by chunk (pages of a paged cache), merged by log-sum-exp.

Same result as `absorb` over the gathered context, without gathering it: each chunk of
`chunk_tokens` keys is read (and dequantized) into a small buffer, attended by every query, and
merged into a running (latent output, lse) pair in fp32. Extra memory: one chunk, whatever the context.

Where the fused CPU core runs (`mlakit.ops.cpu_core`) and `pages` are given, the pages are read in
place instead: one call over the rows of every key, no chunk gathered; quantized pages are still read
(dequantized) chunk by chunk and each chunk goes through the fused core.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlakit.ops.absorb import (
    KEY_BLOCK,
    absorb_one_block,
    biased_block,
    fold_queries,
    latent_attention,
    unfold_values,
)
from mlakit.ops.common import acc_dtype, compute_dtype, context_mask, query_chunk
from mlakit.ops.cpu_core import check_core, fused_latent, use_fused
from mlakit.ops.merge import merge
from mlakit.ops.vnni import UpPacks

DEFAULT_CHUNK_TOKENS = 1024

# read(start, stop) -> (c_kv [B, stop-start, L], k_pe [B, stop-start, dr]): keys start..stop-1 of each row
Reader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def absorb_chunked(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    read: Reader,
    kv_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    max_keys: int | None = None,
    pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    core: str = "auto",
    bias: torch.Tensor | None = None,
    packs: UpPacks | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`absorb` (see `mlakit.ops`) with the context given as a reader of key ranges. `max_keys` (a
    plan's bucket): read exactly that many keys, masked past kv_lens, no host read. `pages`: (c_kv
    rows [N, L], k_pe rows [N, dr], rows [B, >= keys] long) of an unquantized pool, for the fused core
    to read in place. `core`: as `absorb`'s. `bias` [B, S, max_keys] (a plan's additive mask, keys
    past kv_lens reading zeros): a context of one key block without autograd runs `biased_block` and
    returns lse None. `packs`: as `absorb`'s."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    check_core(core)
    static = max_keys is not None
    keys = max_keys if static else int(kv_lens.max())
    if keys <= 0:
        raise ValueError(f"kv_lens {kv_lens.tolist()} hold no key to attend")
    # the matmuls run in the compute dtype (fp32 for bf16 on a CPU without native bf16), as absorb's
    cd = compute_dtype(q_nope.dtype, q_nope.device)
    if pages is not None and use_fused(core, q_nope, pages[0], pages[1]):  # pages read in place
        q_lat = fold_queries(q_nope.to(cd), w_uk.to(cd), packs)  # [B, S, H, L]
        rows = pages[2][:, :keys]
        o_lat, lse = fused_latent(q_lat, q_pe.to(cd), pages[0], pages[1], kv_lens, scale, rows=rows)
        return unfold_values(o_lat.to(cd), w_uv.to(cd), packs).to(q_nope.dtype), lse
    if (
        bias is not None
        and keys <= min(chunk_tokens, KEY_BLOCK)
        and (q_nope.dtype is torch.float32 or q_nope.dtype is torch.float64)
        and not (torch.is_grad_enabled() and (q_nope.requires_grad or w_uk.requires_grad))
    ):
        # fp32/fp64 (no fused core, nothing to convert): the one-block form straight away
        c_kv, k_pe = read(0, keys)
        return absorb_one_block(q_nope, q_pe, c_kv, k_pe, bias, w_uk, w_uv, scale), None
    q_lat = fold_queries(q_nope.to(cd), w_uk.to(cd), packs)  # [B, S, H, L]
    q_pe = q_pe.to(cd)
    if bias is not None and keys <= min(chunk_tokens, KEY_BLOCK) and not _records(q_lat):
        c_kv, k_pe = read(0, keys)
        if not use_fused(core, q_lat, c_kv, k_pe):
            o_lat = biased_block(q_lat, q_pe, c_kv, k_pe, bias, scale)
            return unfold_values(o_lat.to(cd), w_uv.to(cd), packs).to(q_nope.dtype), None
    o_lat, lse = None, None
    for start in range(0, keys, chunk_tokens):
        stop = min(keys, start + chunk_tokens)
        c_kv, k_pe = read(start, stop)
        if use_fused(core, q_lat, c_kv, k_pe):
            part = fused_latent(q_lat, q_pe, c_kv, k_pe, kv_lens, scale, key_start=start)
        else:
            part = _attend_keys(q_lat, q_pe, c_kv, k_pe, kv_lens, start, scale, static)
        o_lat, lse = part if o_lat is None else merge([o_lat, part[0]], [lse, part[1]])
    return unfold_values(o_lat.to(cd), w_uv.to(cd), packs).to(q_nope.dtype), lse


def _records(q_lat: torch.Tensor) -> bool:
    """Whether autograd records this call (the one-block mask form is for inference only)."""
    return torch.is_grad_enabled() and q_lat.requires_grad


def _attend_keys(q_lat, q_pe, c_kv, k_pe, kv_lens, key_start, scale, static=False):
    """Every query against keys key_start.. (global positions): (o_lat [B,S,H,L] fp32, lse [B,S,H])."""
    batch, new, heads, _ = q_lat.shape
    keys = c_kv.shape[1]
    outs, lses = [], []
    step = query_chunk(heads * batch, keys, new)
    for start in range(0, new, step):
        stop = min(new, start + step)
        mask = context_mask(kv_lens, new, start, stop, key_start, key_start + keys, c_kv.device, None, static)
        q_l, q_r = (q_lat, q_pe) if stop - start == new else (q_lat[:, start:stop], q_pe[:, start:stop])
        o, lse = latent_attention(q_l, q_r, c_kv, k_pe, mask, scale, static=static)
        outs.append(o.to(acc_dtype(o.dtype)))  # fp32, or fp64 for fp64 (never demoted)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def page_rows(
    cache, layer: int, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`pages` for `absorb_chunked`: (c_kv rows, k_pe rows) typed views of one layer's pool of an
    unquantized PagedLatentCache, and `rows`; None for quantized pages (read chunk by chunk instead)."""
    fields = getattr(cache, "_fields", None)
    if cache.layout.quant is not None or fields is None:
        return None
    latent, rope = fields(layer)
    return latent, rope, rows

"""The absorbed core over a paged latent cache as two Triton kernels: split-KV attention, then an LSE merge.

Stage 1: program (row tile, split, b) holds `block_m` query rows (token, head) of row b — they all
score against the same keys, an MQA — and walks its split's keys `block_n` at a time. Each key tile
is gathered from the pages through the block table (a key's page is `table[b, t // block_size]`),
dequantized in registers when the rows are fp8/int8, and used twice: scores `q_lat·c_kv + q_pe·k_pe`
and the weighted sum of latents. Online softmax in fp32 (base 2), accumulators in fp32. Each
(row, split) writes its normalized latent output and its lse. Stage 2: program (b, row) merges the
splits by log-sum-exp.

Keys at or past a row's length are never loaded (masked loads), so unused pages, sentinel
block-table entries and rows past the end of the last page are never read. A query sees keys up to
its own position (causal inside the query block); a query that sees none gets lse -inf and zeros.
"""

from __future__ import annotations

import functools

import torch

from mlakit.cache.quant import Field, TokenLayout
from mlakit.kernels.checks import check_inputs
from mlakit.kernels.configs import (
    KernelConfig,
    choose_splits,
    latent_format,
    next_pow2,
    pick_config,
    sm_count,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without Triton; launching needs it
    triton = tl = None

LOG2E = 1.4426950408889634


def _stage1(
    q_lat_ptr,  # [B, M, L] M = S·H rows, row r = token r // H, head r % H
    q_pe_ptr,  # [B, M, R]
    lat_ptr,  # latents of token rows: element (page, offset, l) at page·lat_page + offset·lat_row + l
    scale_ptr,  # fp32 scales of quantized latents (unused otherwise)
    rope_ptr,  # rope keys of token rows
    table_ptr,  # [B, table_stride] int32 page of each block of each row
    lens_ptr,  # [B] keys of each row, the S queries' tokens included
    o_ptr,  # [B, M, NS, L] fp32
    lse_ptr,  # [B, M, NS] fp32
    qk_scale,  # softmax scale · log2(e)
    M,
    H,
    S,
    L,
    R,
    num_blocks,
    table_stride,
    table_width,
    lat_page,
    lat_row,
    scale_page,
    scale_row,
    rope_page,
    rope_row,
    NS,  # splits (a runtime value: a new split count does not recompile)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    QUANT: tl.constexpr,  # 0 exact rows, 1 fp8 rows (a scale per group), 2 int8 rows (a scale per token)
    NUM_SCALES: tl.constexpr,  # fp8 scales per token
    SCALE_GROUP: tl.constexpr,  # latent values per fp8 scale; BLOCK_G · SCALE_GROUP == BLOCK_L
    BLOCK_G: tl.constexpr,
    COMPUTE_F32: tl.constexpr,  # tiles in fp32 (interpreter, fp32 caches) or in the rope dtype
    IEEE: tl.constexpr,  # fp32 dots without tf32
):
    # row tiles vary fastest: the tiles of one (row, split) run side by side and share its keys in L2
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2)
    cd = tl.float32 if COMPUTE_F32 else rope_ptr.dtype.element_ty
    kv_len = tl.load(lens_ptr + pid_b).to(tl.int32)
    split_len = ((kv_len + NS - 1) // NS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    qpos = kv_len - S + rows // H  # [BM] position of each row's token
    cols = tl.arange(0, BLOCK_L)
    col_ok = cols < L
    rcols = tl.arange(0, BLOCK_R)
    rcol_ok = rcols < R
    q_rows = (pid_b * M + rows).to(tl.int64)
    q = tl.load(
        q_lat_ptr + q_rows[:, None] * L + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
    ).to(cd)
    qr = tl.load(
        q_pe_ptr + q_rows[:, None] * R + rcols[None, :], mask=row_ok[:, None] & rcol_ok[None, :], other=0.0
    ).to(cd)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_L], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = (t < hi) & (t // BLOCK_SIZE < table_width)
        page = tl.load(table_ptr + pid_b.to(tl.int64) * table_stride + t // BLOCK_SIZE, mask=t_ok, other=0)
        ok = t_ok & (page >= 0) & (page < num_blocks)
        page = tl.where(ok, page, 0).to(tl.int64)
        off = (t % BLOCK_SIZE).to(tl.int64)
        k = _latent_tile(
            lat_ptr + (page * lat_page + off * lat_row)[:, None] + cols[None, :],
            scale_ptr + page * scale_page + off * scale_row,
            ok,
            col_ok,
            cd,
            BLOCK_N,
            BLOCK_L,
            QUANT,
            NUM_SCALES,
            SCALE_GROUP,
            BLOCK_G,
        )  # [BN, BL]
        kr = tl.load(
            rope_ptr + (page * rope_page + off * rope_row)[:, None] + rcols[None, :],
            mask=ok[:, None] & rcol_ok[None, :],
            other=0.0,
        ).to(cd)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            qk = tl.dot(qr, tl.trans(kr), acc=qk, input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
            qk = tl.dot(qr, tl.trans(kr), acc=qk)
        visible = ok[None, :] & (t[None, :] <= qpos[:, None])
        qk = tl.where(visible, qk * qk_scale, float("-inf"))  # [BM, BN] base-2 logits
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = tl.dot(p.to(cd), k, acc=acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(cd), k, acc=acc * alpha[:, None])
        m_i = m_new

    seen = l_i > 0
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    part = (pid_b * M + rows).to(tl.int64) * NS + pid_s  # [BM]
    tl.store(o_ptr + part[:, None] * L + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(lse_ptr + part, lse, mask=row_ok)


def _latent_tile(
    lat_ptrs,  # [BN, BL] pointers to the latents of BLOCK_N keys
    scale_ptrs,  # [BN] pointers to each key's first scale
    ok,  # [BN] keys to load (the rest read as zeros)
    col_ok,  # [BL]
    cd: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    QUANT: tl.constexpr,
    NUM_SCALES: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """The latent tile of BLOCK_N keys in the compute dtype `cd`, dequantized in registers."""
    k = tl.load(lat_ptrs, mask=ok[:, None] & col_ok[None, :], other=0.0)
    if QUANT == 1:
        # fp8: NUM_SCALES fp32 scales per key, one per SCALE_GROUP values, broadcast over their group
        g = tl.arange(0, BLOCK_G)
        sc = tl.load(
            scale_ptrs[:, None] + g[None, :], mask=ok[:, None] & (g < NUM_SCALES)[None, :], other=0.0
        )
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_G, SCALE_GROUP)), (BLOCK_N, BLOCK_L))
        k = (k.to(tl.float32) * sc).to(cd)
    elif QUANT == 2:
        # int8: one fp32 scale per key
        k = (k.to(tl.float32) * tl.load(scale_ptrs, mask=ok, other=0.0)[:, None]).to(cd)
    else:
        k = k.to(cd)
    return k


if triton is not None:
    _latent_tile = triton.jit(_latent_tile)


def _stage2(
    o_part_ptr,  # [B·M, NS, L] fp32
    lse_part_ptr,  # [B·M, NS] fp32
    o_ptr,  # [B·M, L]
    lse_ptr,  # [B·M] fp32
    L,
    NS,
    BLOCK_NS: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_NS)
    sp_ok = sp < NS
    cols = tl.arange(0, BLOCK_L)
    col_ok = cols < L
    lse = tl.load(lse_part_ptr + row * NS + sp, mask=sp_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top_safe)  # [BNS], 0 for splits that saw nothing
    total = tl.sum(w, 0)
    parts = tl.load(
        o_part_ptr + (row * NS + sp)[:, None] * L + cols[None, :],
        mask=sp_ok[:, None] & col_ok[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + row * L + cols, out.to(o_ptr.dtype.element_ty), mask=col_ok)
    tl.store(lse_ptr + row, tl.where(total > 0, top_safe + tl.log(tl.where(total > 0, total, 1.0)), top))


def absorb_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    layout: TokenLayout,
    scale: float,
    *,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
    interpret: bool | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Folded queries against the paged cache: (o_lat [B,S,H,L] in `out_dtype`, lse [B,S,H] fp32).

    - q_lat [B,S,H,L] (q_nope · W_UK), q_pe [B,S,H,dr]: the last S tokens of each row, causal among
      themselves (token i of row b sits at position kv_lens[b] - S + i);
    - pages: the uint8 pool [num_blocks, block_size, row_bytes] of one layer laid out by `layout`
      (`mlakit.cache.quant.token_layout`), or a typed view of it with the same rows;
    - block_table [B, NB] int32/int64 on the pages' device: page of block j of row b; entries past
      a row's blocks may hold anything (BLOCK_SENTINEL) — they are never read;
    - kv_lens [B] on the pages' device, <= NB · block_size: keys of each row, the S tokens included.

    Trusted, not checked (checking would read device memory: a sync in every layer): the table's
    entries below each row's length are pages of the pool (a negative, sentinel or out-of-range id
    masks its keys silently) and kv_lens fits the table (past it, a row reads NaN with lse -inf).
    `absorb_paged` checks both where they are host facts, and with `check=True` anywhere.

    Launch shapes come from static facts only (no device read): `num_splits` (default: from the
    block-table width, B, the row tiles and the SM count) and `config` (default: `configs.pick_config`).
    `interpret` (default: on CPU tensors) runs Triton's interpreter, tiles in fp32.
    """
    if triton is None:
        raise RuntimeError("mlakit.kernels needs Triton: pip install -e '.[triton]' in the checkout")
    u8 = check_inputs(q_lat, q_pe, pages, block_table, kv_lens, layout, out_dtype, num_splits)
    interp = _interpret(pages.device, interpret)
    batch, new, heads, latent = q_lat.shape
    rope, rows, block_size = q_pe.shape[-1], new * heads, u8.shape[1]
    fmt = latent_format(layout.quant, layout.rope.dtype)
    cfg = pick_config(rows, heads, fmt, interpret=interp, override=config)
    tiles = -(-rows // cfg.block_m)
    splits = num_splits
    if num_splits is None:
        splits = choose_splits(batch, tiles, block_table.shape[1] * block_size, sm_count(pages.device))
    lat, sc, rp = (_field(u8, f) for f in (layout.latent, layout.scale or layout.latent, layout.rope))
    f32 = {"dtype": torch.float32, "device": pages.device}
    o_part = torch.empty(batch, rows, splits, latent, **f32)
    lse_part = torch.empty(batch, rows, splits, **f32)
    compute_f32 = interp or layout.rope.dtype == torch.float32
    launch = {} if interp else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _kernels()[0][(tiles, splits, batch)](
        q_lat.reshape(batch, rows, latent).contiguous(),
        q_pe.reshape(batch, rows, rope).contiguous(),
        lat, sc, rp, block_table, kv_lens, o_part, lse_part,
        float(scale) * LOG2E,
        rows, heads, new, latent, rope, u8.shape[0], block_table.stride(0), block_table.shape[1],
        lat.stride(0), lat.stride(1), sc.stride(0), sc.stride(1), rp.stride(0), rp.stride(1),
        NS=splits,
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_L=max(16, next_pow2(latent)),
        BLOCK_R=max(16, next_pow2(rope)),
        **_quant_args(layout),
        COMPUTE_F32=compute_f32,
        IEEE=compute_f32,
        **launch,
    )  # fmt: skip
    o_lat, lse = _merge(o_part, lse_part, out_dtype, interp)
    return o_lat.view(batch, new, heads, latent), lse.view(batch, new, heads)


def _merge(o_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype, interp: bool):
    """Stage 2: (o [B·M, L], lse [B·M]) from the splits [B, M, NS, L]; one split in fp32 is the answer."""
    batch, rows, splits, latent = o_part.shape
    if splits == 1 and out_dtype == torch.float32:
        return o_part.view(batch * rows, latent), lse_part.view(batch * rows)
    o_lat = torch.empty(batch * rows, latent, dtype=out_dtype, device=o_part.device)
    lse = torch.empty(batch * rows, dtype=torch.float32, device=o_part.device)
    _kernels()[1][(batch * rows,)](
        o_part, lse_part, o_lat, lse, latent,
        NS=splits, BLOCK_NS=next_pow2(splits), BLOCK_L=next_pow2(latent),
        **({} if interp else {"num_warps": 4}),
    )  # fmt: skip
    return o_lat, lse


@functools.cache
def _kernels() -> tuple:
    """(stage 1, stage 2) as Triton JIT functions (interpreted ones when TRITON_INTERPRET was set)."""
    return triton.jit(_stage1), triton.jit(_stage2)


def interpreting() -> bool:
    """Whether Triton was imported under TRITON_INTERPRET=1: its own library functions (tl.cdiv, tl.sum)
    are wrapped then, so the interpreter works only if the variable was set before `import triton`."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def _interpret(device: torch.device, interpret: bool | None) -> bool:
    """Resolve `interpret` (None: the interpreter for CPU tensors) against how Triton was imported."""
    mode = interpreting()
    want = (device.type != "cuda" or mode) if interpret is None else bool(interpret)
    if want and not mode:
        raise RuntimeError(
            "Triton's interpreter needs TRITON_INTERPRET=1 in the environment before triton is imported"
        )
    if not want and (mode or device.type != "cuda"):
        raise ValueError(
            f"interpret=False needs CUDA tensors and Triton imported without TRITON_INTERPRET, "
            f"got pages on {device}, TRITON_INTERPRET {'set' if mode else 'unset'}"
        )
    return want


def _quant_args(layout: TokenLayout) -> dict:
    """QUANT, NUM_SCALES, SCALE_GROUP, BLOCK_G of a layout: fp8 groups tile the padded latent exactly."""
    if layout.quant != "fp8":
        return {"QUANT": 2 if layout.quant == "int8" else 0, "NUM_SCALES": 1, "SCALE_GROUP": 1, "BLOCK_G": 1}
    groups = layout.scale.count
    block_g = next_pow2(groups)
    return {
        "QUANT": 1,
        "NUM_SCALES": groups,
        "SCALE_GROUP": max(16, next_pow2(layout.latent.count)) // block_g,
        "BLOCK_G": block_g,
    }


def _field(u8: torch.Tensor, field: Field) -> torch.Tensor:
    """Typed view [num_blocks, block_size, count] of one field of the uint8 pool."""
    size = field.dtype.itemsize
    return u8[..., field.offset : field.offset + size * field.count].view(field.dtype)

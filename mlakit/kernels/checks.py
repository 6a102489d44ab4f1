"""Argument checks of `absorb_decode`: shapes, dtypes and devices only, so nothing waits on the device."""

from __future__ import annotations

import torch


def check_inputs(
    q_lat, q_pe, pages, block_table, kv_lens, layout, out_dtype, num_splits=None
) -> torch.Tensor:
    """Shapes, dtypes and devices (no device read); returns the pool as uint8 [blocks, block_size, row]."""
    if q_lat.dim() != 4 or q_pe.dim() != 4 or q_lat.shape[:3] != q_pe.shape[:3]:
        raise ValueError(
            "q_lat and q_pe must be [B,S,H,L] and [B,S,H,dr], "
            f"got {tuple(q_lat.shape)} and {tuple(q_pe.shape)}"
        )
    batch, new, heads, latent = q_lat.shape
    if min(batch, new, heads) < 1:
        raise ValueError(f"q_lat has shape {tuple(q_lat.shape)}; B, S and H must be >= 1")
    if latent != layout.latent.count or q_pe.shape[-1] != layout.rope.count:
        raise ValueError(
            f"queries are {latent}+{q_pe.shape[-1]} wide, "
            f"the layout holds {layout.latent.count}+{layout.rope.count}"
        )
    if pages.dim() != 3 or pages.stride(-1) != 1:
        raise ValueError(
            f"pages must be [num_blocks, block_size, row] with unit last stride, got {tuple(pages.shape)}"
        )
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise ValueError(f"num_splits must be a positive integer, got {num_splits!r}")
    u8 = pages if pages.dtype == torch.uint8 else pages.view(torch.uint8)
    if u8.shape[-1] != layout.row_bytes:
        raise ValueError(f"pages hold rows of {u8.shape[-1]} bytes, the layout has {layout.row_bytes}")
    if (
        block_table.dim() != 2
        or block_table.shape[0] != batch
        or block_table.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"block_table must be int32/int64 [{batch}, blocks], "
            f"got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if kv_lens.shape != (batch,) or kv_lens.dtype.is_floating_point or kv_lens.dtype == torch.bool:
        raise ValueError(f"kv_lens must be {batch} integers, got {kv_lens.dtype} {tuple(kv_lens.shape)}")
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("block_table", block_table), ("kv_lens", kv_lens)):
        if t.device != pages.device:
            raise ValueError(f"{name} is on {t.device}, pages are on {pages.device}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be fp32, bf16 or fp16, got {out_dtype}")
    return u8


def check_table(block_table: torch.Tensor, kv_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """What the kernel trusts, checked on the host (reading device tensors back: a sync): every row's
    length fits its table (0..NB·block_size) and every page holding one of its keys is a block of the
    pool (not negative, not the sentinel, < num_blocks). ValueError naming the argument."""
    table = block_table.detach().to("cpu", torch.long)
    lens = kv_lens.detach().to("cpu", torch.long)
    width = table.shape[1]
    cap = width * block_size
    bad = ((lens < 0) | (lens > cap)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"kv_lens {lens[bad].tolist()} of rows {bad} outside 0..{cap} (the block table holds {width} "
            f"pages of {block_size} tokens per row)"
        )
    used = torch.arange(width)[None, :] < (-(-lens // block_size))[:, None]  # [B, NB]
    wrong = (used & ((table < 0) | (table >= num_blocks))).nonzero().tolist()
    if wrong:
        pages = [int(table[r, c]) for r, c in wrong[:4]]
        raise ValueError(
            f"block_table names pages {pages} at (row, block) {wrong[:4]} below kv_lens, outside "
            f"0..{num_blocks - 1} (a sentinel or corrupt entry: those keys would be skipped silently)"
        )

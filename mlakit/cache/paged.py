"""PagedLatentCache: the latent cache in fixed-size pages handed out by a BlockManager, optionally fp8/int8.

A drop-in for `LatentCache` in `MLAAttention.forward`: same `lengths`, `append`, `release`, `view`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlakit.cache.blocks import BlockManager, blocks_for
from mlakit.cache.contiguous import LatentCache, row_counts
from mlakit.cache.quant import dequantize, field_view, quantize, token_layout
from mlakit.config import MLAConfig

# unused block-table entries: out of range for any pool, so a stray read fails loudly
BLOCK_SENTINEL = 2**31 - 1


class PagedLatentCache:
    """`pages [num_blocks, block_size, bytes_per_token]` (uint8) of token rows laid out by `mlakit.quant`.

    `lengths` (a CPU LongTensor [max_batch]) counts the tokens of each slot. Lowering an entry drops
    the newest tokens; the whole blocks they no longer use go back to the free list at the next call
    that reads lengths (`check_lengths`, `append`, `view`, `block_table`, `free_blocks`, ...). Raising
    an entry past the tokens written is an error there.
    """

    # the contiguous cache's slot rules and append (checks, then the methods below)
    resolve_slots = LatentCache.resolve_slots
    append = LatentCache.append

    def __init__(
        self,
        cfg: MLAConfig,
        num_blocks: int,
        block_size: int = 64,
        *,
        max_batch: int,
        dtype: torch.dtype = torch.float32,
        quant: str | None = None,
        device: torch.device | str | None = None,
    ):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_batch", max_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.blocks = BlockManager(num_blocks, block_size, max_batch)
        if num_blocks >= BLOCK_SENTINEL:
            raise ValueError(
                f"num_blocks must be < {BLOCK_SENTINEL} (an int32 block table), got {num_blocks}"
            )
        self.cfg = cfg
        self.layout = token_layout(cfg, dtype, quant)
        self._dtype = dtype
        # one zero row past the last page: positions of a view past a slot's length read it
        self._rows = torch.zeros(
            num_blocks * block_size + 1, self.layout.row_bytes, dtype=torch.uint8, device=device
        )
        self.pages = self._rows[:-1].view(num_blocks, block_size, self.layout.row_bytes)
        self.lengths = torch.zeros(max_batch, dtype=torch.long)
        self.last_slot_mapping: torch.Tensor | None = None

    @property
    def quant(self) -> str | None:
        return self.layout.quant

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: what `append` takes and `view` returns."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._rows.device

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    max_batch = batch_size

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes stored per token per layer (latent, its scales, rope key)."""
        return self.layout.row_bytes

    @property
    def free_blocks(self) -> int:
        self.check_lengths()
        return self.blocks.num_free

    def check_lengths(self) -> None:
        """Validate `lengths` against the tokens written, then free the blocks of dropped tokens."""
        written = torch.tensor(self.blocks.tokens, dtype=torch.long)
        bad = (self.lengths < 0) | (self.lengths > written)
        if bool(bad.any()):
            raise ValueError(
                f"cache lengths {self.lengths.tolist()} outside 0..tokens written {written.tolist()}; "
                "lengths can only be lowered"
            )
        for slot in torch.nonzero(self.lengths < written).flatten().tolist():
            self.blocks.truncate(slot, int(self.lengths[slot]))

    def check_append(self, new_tokens: int | torch.Tensor, slots: torch.Tensor) -> None:
        """Raise before any write if the free blocks cannot take `new_tokens` (one count or one per row)."""
        counts = row_counts(new_tokens, slots.numel())
        self.check_lengths()
        self.blocks.check_append(slots.tolist(), counts.tolist())

    def _write(self, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
        """Allocate and write S tokens per row (checked by `check_append`); quantizes the latent."""
        batch, new, _ = c_kv.shape
        rows = [self.blocks.append(int(s), new) for s in slots.tolist()]
        mapping = torch.tensor(rows, dtype=torch.long).view(batch, new)
        target = mapping.reshape(-1).to(self.device)
        lay = self.layout
        latent = c_kv.detach().reshape(batch * new, -1)
        with torch.no_grad():
            if lay.quant is None:
                field_view(self._rows, lay.latent)[target] = latent
            else:
                values, scale = quantize(latent, lay.quant)
                field_view(self._rows, lay.latent)[target] = values
                field_view(self._rows, lay.scale)[target] = scale
            field_view(self._rows, lay.rope)[target] = k_pe.detach().reshape(batch * new, -1)
        self.lengths[slots] += new
        self.last_slot_mapping = mapping

    def release(self, slot: int) -> None:
        """Empty `slot` for reuse and free its blocks."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.batch_size:
            raise ValueError(f"slot {slot!r} out of range, expected 0..{self.batch_size - 1}")
        self.check_lengths()
        self.blocks.release(slot)
        self.lengths[slot] = 0

    def table(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """Block tables of `slots` as a CPU LongTensor [B, width], BLOCK_SENTINEL past each slot's blocks."""
        out = torch.full((slots.numel(), width), BLOCK_SENTINEL, dtype=torch.long)
        for row, slot in enumerate(slots.tolist()):
            blocks = self.blocks.tables[slot][:width]
            out[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        return out

    @property
    def block_table(self) -> torch.Tensor:
        """int32 [max_batch, max blocks of a slot] on the cache's device, for a kernel to read pages."""
        self.check_lengths()
        width = max(1, max(len(t) for t in self.blocks.tables))
        return self.table(torch.arange(self.batch_size), width).to(torch.int32).to(self.device)

    def slot_mapping(self, slots: torch.Tensor, max_len: int) -> torch.Tensor:
        """Flat row (block·block_size + offset) of each cached token [B, max_len]; -1 past a slot's length."""
        self.check_lengths()
        size = self.block_size
        t = torch.arange(max_len)
        flat = self.table(slots, blocks_for(max_len, size))[:, t // size] * size + t % size  # [B, T]
        return torch.where(t < self.lengths[slots][:, None], flat, torch.full_like(flat, -1))

    def reader(
        self, slots: torch.Tensor, max_len: int
    ) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """read(start, stop) -> (c_kv [B, stop-start, L], k_pe [B, stop-start, dr]): tokens start..stop-1
        of `slots` (stop <= max_len) in the compute dtype, zeros past each slot's length.

        Each call gathers those tokens' rows from the pages, dequantizing fp8/int8 latents on the way.
        """
        mapping = self.slot_mapping(slots, max_len)
        pad = self.num_blocks * self.block_size  # the zero row
        rows = torch.where(mapping < 0, torch.full_like(mapping, pad), mapping).to(self.device)  # [B, T]

        def read(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self._gather(rows[:, start:stop])

        return read

    def view(self, slots: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [B, max_len, L], k_pe [B, max_len, dr]) of `slots` in the compute dtype; zeros past lengths.

        A copy: the slots' pages gathered (and dequantized) into contiguous tensors.
        """
        return self.reader(slots, max_len)(0, max_len)

    def _gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, tokens = rows.shape
        flat = rows.reshape(-1)
        lay = self.layout
        rope = field_view(self._rows, lay.rope).index_select(0, flat)
        latent = field_view(self._rows, lay.latent).index_select(0, flat)
        if lay.quant is not None:
            scale = field_view(self._rows, lay.scale).index_select(0, flat)
            latent = dequantize(latent, scale, self.dtype)
        return latent.view(batch, tokens, -1), rope.view(batch, tokens, -1)

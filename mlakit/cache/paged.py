"""PagedLatentCache: the latent cache in fixed-size pages handed out by a BlockPool, optionally fp8/int8.

A drop-in for `LatentCache`: same `lengths`, `plan`/`commit`, `append`, `release`, `view`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlakit.cache.blocks import BlockPool, blocks_for
from mlakit.cache.checks import check_allocation, check_positive, check_slot, check_slots, int_list
from mlakit.cache.plan import StepPlan, key_bucket
from mlakit.cache.quant import (
    dequantize,
    field_view,
    hadamard,
    index_groups,
    index_rotated,
    put_fields,
    quantize,
    token_layout,
)
from mlakit.cache.step import StepCache, row_counts
from mlakit.config import MLAConfig

# unused block-table entries: out of range for any pool, so a stray read fails loudly
BLOCK_SENTINEL = 2**31 - 1
# host bytes of bookkeeping per block (a free-list entry) and per slot (a table, a count, a length)
HOST_BYTES_PER_BLOCK = 40
HOST_BYTES_PER_SLOT = 128


class PagedLatentCache(StepCache):
    """Per layer, `num_blocks` pages of `block_size` token rows (uint8, laid out by `mlakit.quant`).

    One BlockPool (`blocks`: its own, or the engine's `pool`, shared with whoever starts slots on
    pages other slots wrote) and one block table serve every layer: page p holds the same tokens in
    each layer's pool (`layer_pages(l)` [num_blocks, block_size, bytes_per_token]; `pages` is layer 0's).
    `lengths` (a CPU LongTensor [max_batch]) counts the tokens of each slot. Lowering an entry drops
    the newest tokens; the whole blocks they no longer use go back to the free list at the next call
    that reads lengths (`check_lengths`, `plan`, `append`, `view`, `block_table`, `free_blocks`, ...).
    Raising an entry past the tokens written is an error there.
    """

    def __init__(
        self,
        cfg: MLAConfig,
        num_blocks: int,
        block_size: int = 64,
        *,
        max_batch: int,
        num_layers: int = 1,
        dtype: torch.dtype = torch.float32,
        quant: str | None = None,
        device: torch.device | str | None = None,
        pool: BlockPool | None = None,
    ):
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("max_batch", max_batch),
            ("num_layers", num_layers),
        ):
            check_positive(name, value)
        if num_blocks >= BLOCK_SENTINEL:
            raise ValueError(
                f"num_blocks must be < {BLOCK_SENTINEL} (an int32 block table), got {num_blocks}"
            )
        want = (num_blocks, block_size, max_batch)
        if pool is not None and not (isinstance(pool, BlockPool) and pool.shape == want):
            raise ValueError(
                f"pool must be None or a BlockPool of (num_blocks, block_size, max_batch) {want}, "
                f"got {pool!r}"
            )
        layout = token_layout(cfg, dtype, quant)
        per_layer = num_blocks * block_size + 2
        check_allocation(
            f"PagedLatentCache of num_layers={num_layers} x num_blocks={num_blocks} "
            f"x block_size={block_size}",
            num_layers * per_layer * layout.row_bytes,
            device,
            "num_blocks, block_size or num_layers",
        )
        check_allocation(
            f"PagedLatentCache bookkeeping of num_blocks={num_blocks} and max_batch={max_batch}",
            num_blocks * HOST_BYTES_PER_BLOCK + max_batch * HOST_BYTES_PER_SLOT,
            "cpu",
            "num_blocks or max_batch",
        )
        self.blocks = BlockPool(num_blocks, block_size, max_batch) if pool is None else pool
        self.cfg = cfg
        self.layout = layout
        self.num_layers = num_layers
        self._dtype = dtype
        # per layer: every page's rows, a zero row (keys past a slot's length read it), a spare row
        # (padding of ragged rows is written there)
        # unquantized rows hold values of one dtype: stored typed, so that writes and reads are plain
        # slices (a compiled graph of uint8 views reinterpreted as floats copies whole pools); the
        # uint8 view `_rows` is what kernels and byte-level readers see
        if quant is None:
            store_dtype, width = dtype, layout.row_bytes // dtype.itemsize
        else:
            store_dtype, width = torch.uint8, layout.row_bytes
        self._store = torch.zeros(num_layers, per_layer, width, dtype=store_dtype, device=device)
        self._views: dict = {}  # views made once: per-layer fields
        self.lengths = torch.zeros(max_batch, dtype=torch.long)
        self.last_slot_mapping: torch.Tensor | None = None
        self._init_step(cfg, device)

    def __getstate__(self) -> dict:
        # kept views share memory with the store only in this process: made again after loading
        state = self.__dict__.copy()
        state["_views"] = {}
        return state

    @property
    def _rows(self) -> torch.Tensor:
        """Every layer's rows as bytes [num_layers, rows, bytes_per_token] (a view of the store)."""
        return self._store if self._store.dtype == torch.uint8 else self._store.view(torch.uint8)

    def _field(self, layer: int, field) -> torch.Tensor:
        """Typed view [rows, count] of one field of one layer's rows."""
        if self._store.dtype == torch.uint8:
            return field_view(self._store[layer], field)
        start = field.offset // field.dtype.itemsize
        return self._store[layer, :, start : start + field.count]

    def _fields(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent, rope) typed views of one layer; made once in eager mode (4 view ops a call saved),
        inline under torch.compile (a graph takes the store itself)."""
        if torch.compiler.is_compiling():
            return self._field(layer, self.layout.latent), self._field(layer, self.layout.rope)
        key = ("fields", torch.is_inference_mode_enabled())
        views = self._views.get(key)
        if views is None:
            lay = self.layout
            views = self._views[key] = [
                (self._field(i, lay.latent), self._field(i, lay.rope)) for i in range(self.num_layers)
            ]
        return views[layer]

    @property
    def quant(self) -> str | None:
        return self.layout.quant

    @property
    def index_rotation(self) -> bool:
        """True when the indexer keys are stored Hadamard-rotated (fp8): queries must be rotated too."""
        return index_rotated(self.cfg, self.layout.quant)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: what `append` takes and `view` returns."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._store.device

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
    def zero_row(self) -> int:
        return self.num_blocks * self.block_size

    def layer_pages(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s pool [num_blocks, block_size, bytes_per_token] (a view)."""
        return self._rows[layer, : self.zero_row].view(self.num_blocks, self.block_size, -1)

    @property
    def pages(self) -> torch.Tensor:
        return self.layer_pages(0)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (tests compare them bit for bit)."""
        return [self._rows, self.lengths]  # bytes: NaN pages still compare equal bit for bit

    @property
    def free_blocks(self) -> int:
        self.check_lengths()
        return self.blocks.num_free

    def resolve_slots(self, slots, rows: int) -> torch.Tensor:
        """Check `slots` for `rows` batch rows (default: row b → slot b); a CPU LongTensor [rows]."""
        return torch.tensor(check_slots(slots, rows, self.batch_size), dtype=torch.long)

    @property
    def slot_capacity(self) -> None:
        return None  # pages are shared: any one slot may take every free block

    @property
    def step_capacity(self) -> int:
        """The most tokens one row of a step can bring: the whole pool."""
        return self.num_blocks * self.block_size

    def _tokens(self) -> list[int]:
        """Tokens held per slot (a plan's reserved rows included)."""
        return self.blocks.tokens

    def _truncate(self, slot: int, tokens: int) -> None:
        self.blocks.truncate(slot, tokens)

    def check_append(self, new_tokens: int | torch.Tensor, slots: torch.Tensor) -> None:
        """Raise if the free blocks cannot take `new_tokens` (one count or one per row) as a new step:
        counted as after the step's plan gives back the rows past `lengths` (an open plan's reserved
        rows among them: a new plan supersedes it). Changes nothing."""
        counts = row_counts(new_tokens, slots.numel()).tolist()
        lengths = self._checked_lengths()
        size, pool = self.block_size, self.blocks
        # pages past the lengths that only their slot references come back when the plan settles them
        free = pool.num_free + sum(
            pool.refs[p] == 1 for s, n in enumerate(lengths) for p in pool.tables[s][blocks_for(n, size) :]
        )
        slot_ids = slots.tolist()
        need = sum(
            blocks_for(lengths[s] + c, size) - blocks_for(lengths[s], size)
            for s, c in zip(slot_ids, counts, strict=True)
        )
        if need > free:
            raise ValueError(
                f"out of blocks: appending {counts} tokens to slots {slot_ids} needs {need} more blocks of "
                f"{size} tokens, {free} of {self.num_blocks} are free"
            )

    def _reserve(self, slots: list[int], counts: list[int], seq_len: int) -> torch.Tensor:
        """Allocate the step's blocks; rows [B, S] of its tokens (padding: the spare row)."""
        spare = self.zero_row + 1
        rows = [
            self.blocks.append(s, n) + [spare] * (seq_len - n) for s, n in zip(slots, counts, strict=True)
        ]
        mapping = torch.tensor(rows, dtype=torch.long)
        self.last_slot_mapping = mapping
        return mapping

    def _undo_point(self) -> torch.Tensor | None:
        self.blocks.begin()  # recorded until the plan is made (`_reserved`) or undone
        return self.last_slot_mapping

    def _undo(self, point) -> None:
        self.last_slot_mapping = point
        self.blocks.undo()

    def _reserved(self) -> None:
        self.blocks.end()

    def _zero_rows(self, layer: int, rows: torch.Tensor) -> None:
        """Zero token rows `rows` [N] of one layer (every field: a zero latent, scale, rope key)."""
        with torch.no_grad():
            self._store[layer].index_fill_(0, rows, 0)

    def _bucket(self, keys: int) -> int:
        return key_bucket(keys, multiple=self.block_size)

    def _rows_of(self, slots: torch.Tensor):
        def rows_of(rows: torch.Tensor, key_len: int):
            read = self._read_rows(slots[rows], key_len)
            return None, None, read.to(self.device)

        return rows_of

    def _read_rows(self, slots: torch.Tensor, key_len: int) -> torch.Tensor:
        """Row of each of the first key_len tokens of `slots` [R, key_len] as they will be after the
        step (blocks already reserved); the zero row past the tokens written."""
        size = self.block_size
        t = torch.arange(key_len)
        table = self.table(slots, blocks_for(key_len, size))
        flat = table[:, t // size] * size + t % size  # [R, T]
        written = torch.tensor([self.blocks.tokens[s] for s in slots.tolist()], dtype=torch.long)
        return torch.where(t < written[:, None], flat, torch.full_like(flat, self.zero_row))

    def _table_of(self, slots: torch.Tensor):
        """table_of(key_len): int32 block tables [B, key_len / block_size] of `slots` on the device."""

        def table_of(key_len: int) -> torch.Tensor:
            width = blocks_for(key_len, self.block_size)
            return self.table(slots, width).to(torch.int32).to(self.device)

        return table_of

    def write(self, plan: StepPlan, layer: int, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Write one layer's new tokens (c_kv [N, L], k_pe [N, dr] packed, or the caller's rectangle) at
        the plan's rows (`plan.slot_mapping`); quantizes the latent."""
        step, c_kv, k_pe = self._check_write(plan, layer, c_kv, k_pe)
        lay, target = self.layout, plan.slot_mapping
        with torch.no_grad():  # no_grad: the cache never joins the graph (no detach needed)
            if lay.quant is None and torch.compiler.is_compiling():
                self._put_rows(layer, target, [(lay.latent, c_kv), (lay.rope, k_pe)])
            elif lay.quant is None:
                latent, rope = self._fields(layer)
                latent.index_put_((target,), c_kv)
                rope.index_put_((target,), k_pe)
            else:
                values, scale = quantize(c_kv.detach(), lay.quant)
                rope = k_pe.detach().to(lay.rope.dtype)
                self._put_rows(layer, target, [(lay.latent, values), (lay.scale, scale), (lay.rope, rope)])
        step.ran.add(layer)

    def write_in_place(self, plan: StepPlan, layer: int, fn):
        """For a caller that writes one layer's new tokens itself (the fused decode layer,
        mlakit/engine/decode.py): `fn(latent, rope, rows)` gets the layer's typed views (latent [R, L],
        rope [R, dr]) and the rows to write (`plan.slot_mapping`, [N] int64), after `write`'s checks of
        the plan and the layer; the layer is recorded as written once fn returns. Unquantized caches
        only (a ValueError else, before fn runs). Returns fn's result."""
        step = self._open_layer(plan, layer)
        if self.layout.quant is not None:
            raise ValueError(f"write_in_place: the cache is quantized ({self.layout.quant}); use write()")
        latent, rope = self._fields(layer)
        out = fn(latent, rope, plan.slot_mapping)
        step.ran.add(layer)
        return out

    def _put_rows(self, layer: int, target: torch.Tensor, fields) -> None:
        """Fields of token rows `target` [N] written by one `index_put_` of whole rows into the store:
        under torch.compile, a write into a column, dtype or layer view of the store makes inductor
        copy the whole store back at every write (docs/compile.md)."""
        store = self._store
        if store.dtype == torch.uint8:
            put_fields(store, layer, target, fields)
            return
        new = store[layer].index_select(0, target)  # [N, width]
        for field, values in fields:
            start = field.offset // field.dtype.itemsize
            new[:, start : start + field.count] = values.reshape(target.numel(), -1)
        store.index_put_((torch.full_like(target, layer), target), new)

    def write_index(self, plan: StepPlan, layer: int, k_idx: torch.Tensor) -> None:
        """Write one layer's new DSA indexer keys k_idx [N, d_I] (or [B, S, d_I]) in the same rows as
        their latents; refused (ValueError naming `plan`, `layer` or `k_idx`) as `write` refuses,
        before any change."""
        keys = self._check_write_index(plan, layer, k_idx).detach()
        target = plan.slot_mapping
        lay = self.layout
        with torch.no_grad():
            if lay.quant is None and torch.compiler.is_compiling():
                self._put_rows(layer, target, [(lay.index, keys)])
            elif lay.quant is None:
                self._field(layer, lay.index).index_copy_(0, target, keys)
            else:
                if self.index_rotation:
                    keys = hadamard(keys)
                groups = index_groups(keys.shape[-1], lay.quant)
                values, scale = quantize(keys, lay.quant, groups, pow2=lay.quant == "fp8")
                self._put_rows(layer, target, [(lay.index, values), (lay.index_scale, scale)])

    # the context interface every cache kind provides: keys, key_reader, in_place, index_keys, selected
    def keys(self, layer: int, group) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [R, key_len, L], k_pe [R, key_len, dr]) of a row group, gathered (and dequantized)."""
        return self.gather(layer, group.read_rows)

    def key_reader(self, layer: int, group):
        """read(start, stop) over a row group's keys, gathered chunk by chunk."""
        return rows_reader(self, layer, group.read_rows)

    def in_place(self, layer: int, group):
        """(c_kv rows, k_pe rows, key rows) for the fused core to read the pages in place; None when
        the pages are quantized."""
        if self.layout.quant is not None:
            return None
        latent, rope = self._fields(layer)
        return latent, rope, group.read_rows

    def index_keys(self, layer: int, group, key_len: int | None = None) -> torch.Tensor:
        """A row group's cached indexer keys [R, key_len, d_I] in the compute dtype (zeros past lengths);
        Hadamard-rotated when `index_rotation`."""
        rows = group.read_rows if key_len is None else group.read_rows[:, :key_len]
        flat = rows.reshape(-1)
        lay, pool = self.layout, self._store[layer]
        keys = self._field(layer, lay.index).index_select(0, flat)
        if lay.quant is not None:
            keys = dequantize(keys, field_view(pool, lay.index_scale).index_select(0, flat), self.dtype)
        return keys.view(*rows.shape, -1)

    def selected(self, layer: int, group, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [R,s,k,L], k_pe [R,s,k,dr]) at context positions [R,s,k] (0 <= p < key_len) of a group."""
        r, s, k = positions.shape
        rows = group.read_rows.gather(1, positions.reshape(r, s * k))
        c_kv, k_pe = self.gather(layer, rows)
        return c_kv.view(r, s, k, -1), k_pe.view(r, s, k, -1)

    def release(self, slot: int) -> None:
        """Empty `slot` for reuse and free its blocks; an open plan that writes it goes stale (a
        cancelled request: its reserved blocks are given back too)."""
        self._release_slot(check_slot(slot, self.batch_size))

    def adopt(self, slot: int, pages) -> None:
        """Start the empty `slot` on `pages`: whole pages already written (another slot's, held or
        cached in the pool, e.g. a prefix found by its hash); `lengths[slot]` becomes
        len(pages)·block_size. Refused (ValueError) when the slot is not empty (a length, or rows an
        open plan reserved) or a page is out of range, repeated, or free with nothing cached in it;
        lowered lengths are settled first, as by every call that reads them."""
        slot = check_slot(slot, self.batch_size)
        lengths = self._checked_lengths()
        plan = self._open
        if lengths[slot] or (plan is not None and plan.state == "open" and slot in plan.slots.tolist()):
            raise ValueError(
                f"slot {slot} holds {lengths[slot]} tokens or an open plan's rows, expected an empty slot"
            )
        pages = int_list(pages, "pages")
        self._settle(lengths)
        self.blocks.adopt(slot, pages, len(pages) * self.block_size)
        self.lengths[slot] = len(pages) * self.block_size

    def table(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """Block tables of `slots` as a CPU LongTensor [B, width], BLOCK_SENTINEL past each slot's blocks."""
        tables = self.blocks.tables
        rows = [tables[slot][:width] for slot in slots.tolist()]
        # one tensor from host lists (a tensor and a copy per row cost ~8 us a row at 32 rows)
        return torch.tensor([r + [BLOCK_SENTINEL] * (width - len(r)) for r in rows], dtype=torch.long).view(
            len(rows), width
        )

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
        self, slots: torch.Tensor, max_len: int, *, layer: int = 0
    ) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """read(start, stop) -> (c_kv [B, stop-start, L], k_pe [B, stop-start, dr]): tokens start..stop-1
        of `slots` (stop <= max_len) in the compute dtype, zeros past each slot's length.

        Each call gathers those tokens' rows from the pages, dequantizing fp8/int8 latents on the way.
        """
        mapping = self.slot_mapping(slots, max_len)
        rows = torch.where(mapping < 0, torch.full_like(mapping, self.zero_row), mapping).to(self.device)
        return rows_reader(self, layer, rows)

    def view(self, slots: torch.Tensor, max_len: int, *, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [B, max_len, L], k_pe [B, max_len, dr]) of `slots` in the compute dtype; zeros past lengths.

        A copy: the slots' pages gathered (and dequantized) into contiguous tensors.
        """
        return self.reader(slots, max_len, layer=layer)(0, max_len)

    def gather(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [B, T] of one layer's pool → (c_kv [B, T, L], k_pe [B, T, dr]) in the compute dtype."""
        batch, tokens = rows.shape
        flat = rows.reshape(-1)
        lay, pool = self.layout, self._store[layer]
        latent_rows, rope_rows = self._fields(layer)
        rope = rope_rows.index_select(0, flat)
        latent = latent_rows.index_select(0, flat)
        if lay.quant is not None:
            scale = field_view(pool, lay.scale).index_select(0, flat)
            latent = dequantize(latent, scale, self.dtype)
        return latent.view(batch, tokens, -1), rope.view(batch, tokens, -1)


def rows_reader(cache: PagedLatentCache, layer: int, rows: torch.Tensor):
    """read(start, stop) over key rows [B, T] of one layer's pool."""

    def read(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return cache.gather(layer, rows[:, start:stop])

    return read

"""LatentCache: per slot, the normalized latent and the rotated rope key of every cached token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlakit.cache.checks import check_allocation, check_compute_dtype, check_positive, check_slot, check_slots
from mlakit.cache.plan import StepPlan, key_bucket
from mlakit.cache.step import StepCache, row_counts  # noqa: F401  (re-exported)
from mlakit.config import MLAConfig

Slots = torch.Tensor | Sequence[int] | None


class LatentCache(StepCache):
    """Contiguous slots of `max_seq_len` tokens for each of `num_layers` layers.

    Layer l's latents are `layer_view(l)` = (c_kv [batch, max_seq_len, L], k_pe [.., dr]); `c_kv` and
    `k_pe` are layer 0's. The latent and the rope key are kept in two tensors so that both score
    matmuls and the value-side matmul of absorb read rows with unit stride. `lengths` (a CPU
    LongTensor, shared by every layer) counts the tokens of each slot; lowering it drops the newest
    tokens (what a rejected speculative draft does); raising it past the tokens written is refused.
    """

    def __init__(
        self,
        cfg: MLAConfig,
        batch_size: int,
        max_seq_len: int,
        *,
        num_layers: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        for name, value in (
            ("batch_size", batch_size),
            ("max_seq_len", max_seq_len),
            ("num_layers", num_layers),
        ):
            check_positive(name, value)
        check_compute_dtype(dtype)
        per_layer = batch_size * max_seq_len + 1
        itemsize = torch.empty((), dtype=dtype).element_size()
        check_allocation(
            f"LatentCache of num_layers={num_layers} x batch_size={batch_size} x max_seq_len={max_seq_len}",
            num_layers * per_layer * (cfg.latent_dim + (cfg.index_head_dim or 0)) * itemsize
            + 16 * batch_size,
            device,
            "batch_size, max_seq_len or num_layers",
        )
        self.cfg = cfg
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.num_layers = num_layers
        # per layer: every slot's rows, then one spare row where padding of ragged rows is written
        self._c_rows = torch.zeros(num_layers, per_layer, cfg.kv_lora_rank, dtype=dtype, device=device)
        self._k_rows = torch.zeros(num_layers, per_layer, cfg.qk_rope_head_dim, dtype=dtype, device=device)
        # DSA: the indexer key of every token, in the same rows (None for dense MLA)
        self._i_rows = (
            torch.zeros(num_layers, per_layer, cfg.index_head_dim, dtype=dtype, device=device)
            if cfg.is_sparse
            else None
        )
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.written = [0] * batch_size  # tokens written per slot: lengths may only be lowered below it
        # rows of each slot that may hold data (never lowered but by zeroing them): rows at or past a
        # slot's length read by a step are zero, so that a masked key's value is 0, never a stale NaN
        self._dirty = [0] * batch_size
        self._make_aliases()
        self._init_step(cfg, device)

    def _make_aliases(self) -> None:
        """Per layer, aliases of the row buffers with a version counter of their own: every eager read
        and write goes through them, so autograd (a planned call under grad mode saves context views
        for its backward) sees each write to a layer's rows, and only that layer's."""
        self._aliases = [
            tuple(None if t is None else _alias(t[layer]) for t in (self._c_rows, self._k_rows, self._i_rows))
            for layer in range(self.num_layers)
        ]

    def __getstate__(self) -> dict:
        # aliases and kept views share memory with the buffers only in this process: made again on load
        state = self.__dict__.copy()
        state.pop("_aliases", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._make_aliases()

    @property
    def dtype(self) -> torch.dtype:
        return self._c_rows.dtype

    @property
    def device(self) -> torch.device:
        return self._c_rows.device

    @property
    def bytes_per_token(self) -> int:
        """Bytes stored per token per layer (the DSA indexer key included)."""
        return (self.cfg.latent_dim + (self.cfg.index_head_dim or 0)) * self._c_rows.element_size()

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [batch, max_seq_len, L], k_pe [batch, max_seq_len, dr]) of one layer: views."""
        shape = (self.batch_size, self.max_seq_len)
        c_rows, k_rows = self._layer_rows(layer)
        return c_rows[:-1].view(*shape, -1), k_rows[:-1].view(*shape, -1)

    @property
    def c_kv(self) -> torch.Tensor:
        return self.layer_view(0)[0]

    @property
    def k_pe(self) -> torch.Tensor:
        return self.layer_view(0)[1]

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (tests compare them bit for bit)."""
        return [t for t in (self._c_rows, self._k_rows, self._i_rows, self.lengths) if t is not None]

    def resolve_slots(self, slots: Slots, rows: int) -> torch.Tensor:
        """Check `slots` for `rows` batch rows (default: row b → slot b); a CPU LongTensor [rows]."""
        return torch.tensor(check_slots(slots, rows, self.batch_size), dtype=torch.long)

    @property
    def slot_capacity(self) -> int:
        """The most tokens one slot holds."""
        return self.max_seq_len

    step_capacity = slot_capacity

    def _tokens(self) -> list[int]:
        """Tokens written per slot (a plan's reserved rows included)."""
        return self.written

    def _truncate(self, slot: int, tokens: int) -> None:
        # the rows past `tokens` are zeroed when a step next writes the slot (see `_reserve`)
        self.written[slot] = tokens

    def check_append(self, new_tokens: int | torch.Tensor, slots: torch.Tensor) -> None:
        """Raise before any write if `new_tokens` (one count or one per row) do not fit in `slots`."""
        single = isinstance(new_tokens, int)
        counts = (
            [new_tokens] * slots.numel() if single else [int(c) for c in torch.as_tensor(new_tokens).tolist()]
        )
        lengths = [int(self.lengths[s]) for s in slots.tolist()]
        over = [i for i, (n, c) in enumerate(zip(lengths, counts, strict=True)) if n + c > self.max_seq_len]
        if over:
            bad = [int(slots[i]) for i in over]
            shown = new_tokens if single else [counts[i] for i in over]
            raise ValueError(
                f"appending {shown} tokens overflows slots {bad}: lengths "
                f"{[lengths[i] for i in over]} + {shown} > max_seq_len {self.max_seq_len}"
            )

    def _reserve(self, slots: list[int], counts: list[int], seq_len: int) -> torch.Tensor:
        """Rows [B, S] of the step's tokens (padding: the spare row); records them as written. Rows of
        these slots past their lengths that held data (dropped tokens, a released request) are zeroed
        in every layer once the plan is made (`_reserved`: the step's first change to the buffers)."""
        spare = self.batch_size * self.max_seq_len
        rows, self._to_zero = [], []
        for slot, n in zip(slots, counts, strict=True):
            start = int(self.lengths[slot])
            first = slot * self.max_seq_len
            if self._dirty[slot] > start:
                self._to_zero.append((first + start, first + self._dirty[slot]))
            real = [first + start + i for i in range(n)]
            rows.append(real + [spare] * (seq_len - n))
            self.written[slot] = self._dirty[slot] = start + n
        return torch.tensor(rows, dtype=torch.long)

    def _reserved(self) -> None:
        with torch.no_grad():
            for lo, hi in self.__dict__.pop("_to_zero", ()):
                for rows_of_layer in self._aliases:
                    for t in rows_of_layer:
                        if t is not None:
                            t[lo:hi].zero_()

    def _undo_point(self) -> tuple[list[int], list[int]]:
        return list(self.written), list(self._dirty)

    def _undo(self, point) -> None:
        self.written[:], self._dirty[:] = point
        self.__dict__.pop("_to_zero", None)

    def _zero_rows(self, layer: int, rows: torch.Tensor) -> None:
        """Zero token rows `rows` [N] of one layer (latent, rope key, indexer key)."""
        with torch.no_grad():
            for t in self._aliases[layer]:
                if t is not None:
                    t.index_fill_(0, rows, 0)

    def _index_rows(self, layer: int) -> torch.Tensor:
        return self._i_rows[layer] if torch.compiler.is_compiling() else self._aliases[layer][2]

    def _rows_of(self, slots: torch.Tensor):
        def rows_of(rows: torch.Tensor, key_len: int):
            s = slots[rows]
            first = int(s[0])
            consecutive = s.tolist() == list(range(first, first + s.numel()))
            return s.to(self.device), first if consecutive else None, None

        return rows_of

    def _bucket(self, keys: int) -> int:
        return key_bucket(keys, cap=self.max_seq_len)

    def write(self, plan: StepPlan, layer: int, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Write one layer's new latents c_kv [N, L] and rope keys k_pe [N, dr] (packed; or the caller's
        rectangle [B, S, ...]) at the plan's rows (`plan.slot_mapping`)."""
        step, c_kv, k_pe = self._check_write(plan, layer, c_kv, k_pe)
        rows = plan.slot_mapping
        with torch.no_grad():  # no_grad: the cache never joins the graph (no detach needed)
            if torch.compiler.is_compiling():
                # into the buffers themselves: a write into a layer's view makes inductor copy the
                # whole buffer back at every layer (docs/compile.md)
                at = (torch.full_like(rows, layer), rows)
                self._c_rows.index_put_(at, c_kv)
                self._k_rows.index_put_(at, k_pe)
            else:
                c_rows, k_rows = self._layer_rows(layer)  # made once: two select ops a call saved
                c_rows.index_put_((rows,), c_kv)
                k_rows.index_put_((rows,), k_pe)
        step.ran.add(layer)

    def _layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(c rows [rows, L], k rows [rows, dr]) of one layer: its aliases (see `_make_aliases`); a
        compiled graph takes the buffers themselves."""
        if torch.compiler.is_compiling():
            return self._c_rows[layer], self._k_rows[layer]
        return self._aliases[layer][0], self._aliases[layer][1]

    # the context interface every cache kind provides (`LocalContext` for a cache-less step too):
    # keys, key_reader, in_place, index_keys, selected
    def keys(self, layer: int, group) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [R, key_len, L], k_pe [R, key_len, dr]) of a row group: a view when its slots are
        consecutive, else a gather."""
        return self.context(layer, group, group.key_len)

    def key_reader(self, layer: int, group):
        """read(start, stop) over a row group's keys (views of its context)."""
        c, k = self.keys(layer, group)
        return lambda start, stop: (c[:, start:stop], k[:, start:stop])

    def in_place(self, layer: int, group) -> None:
        """Pages for the fused core to read in place: none (the context is a view already)."""
        return None

    def context(self, layer: int, group, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [R, key_len, L], k_pe [R, key_len, dr]) of a row group: a view when its slots are
        consecutive, else a gather."""
        if group.slot_start is not None:
            # consecutive slots: their rows straight from the layer's buffer (4 view ops per tensor)
            s0, r, t = group.slot_start, group.kv_lens.shape[0], self.max_seq_len
            rows = slice(s0 * t, (s0 + r) * t)
            c_rows, k_rows = self._layer_rows(layer)  # the layer's own version counter (eager)
            c = c_rows[rows].view(r, t, -1)
            k = k_rows[rows].view(r, t, -1)
            return (c, k) if key_len == t else (c[:, :key_len], k[:, :key_len])
        c_all, k_all = self.layer_view(layer)
        return c_all[group.slots, :key_len], k_all[group.slots, :key_len]

    def write_index(self, plan: StepPlan, layer: int, k_idx: torch.Tensor) -> None:
        """Write one layer's new DSA indexer keys k_idx [N, d_I] (or [B, S, d_I]) in the same rows as
        their latents; refused (ValueError naming `plan`, `layer` or `k_idx`) as `write` refuses,
        before any change."""
        keys = self._check_write_index(plan, layer, k_idx).detach()
        rows = plan.slot_mapping
        with torch.no_grad():
            if torch.compiler.is_compiling():  # into the buffer itself, as in `write`
                self._i_rows.index_put_((torch.full_like(rows, layer), rows), keys)
                return
            self._index_rows(layer).index_copy_(0, rows, keys)

    def index_keys(self, layer: int, group, key_len: int | None = None) -> torch.Tensor:
        """A row group's cached indexer keys [R, key_len, d_I]: a view when its slots are consecutive."""
        key_len = group.key_len if key_len is None else key_len
        keys = self._index_rows(layer)[:-1].view(self.batch_size, self.max_seq_len, -1)
        if group.slot_start is not None:
            s0, r = group.slot_start, group.kv_lens.shape[0]
            return keys[s0 : s0 + r, :key_len]
        return keys[group.slots, :key_len]

    def selected(self, layer: int, group, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [R,s,k,L], k_pe [R,s,k,dr]) at context positions [R,s,k] (0 <= p < key_len) of a group."""
        r, s, k = positions.shape
        if group.slot_start is not None:
            slots = torch.arange(group.slot_start, group.slot_start + r, device=positions.device)
        else:
            slots = group.slots
        rows = (slots[:, None] * self.max_seq_len + positions.reshape(r, s * k)).reshape(-1)
        c_kv = self._c_rows[layer].index_select(0, rows).view(r, s, k, -1)
        return c_kv, self._k_rows[layer].index_select(0, rows).view(r, s, k, -1)

    def release(self, slot: int) -> None:
        """Empty `slot` for reuse; an open plan that writes it goes stale (a cancelled request)."""
        self._release_slot(check_slot(slot, self.batch_size))

    def view(self, slots: torch.Tensor, max_len: int, *, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [B, max_len, L], k_pe [B, max_len, dr]) of `slots`; no copy when slots are consecutive."""
        c_all, k_all = self.layer_view(layer)
        first = int(slots[0])
        if slots.tolist() == list(range(first, first + slots.numel())):
            return c_all[first : first + slots.numel(), :max_len], k_all[
                first : first + slots.numel(), :max_len
            ]
        idx = slots.to(self.device)
        return c_all[idx, :max_len], k_all[idx, :max_len]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory (same sizes and strides) with a version counter of its own."""
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )

"""V4Cache: what each DeepSeek-V4 layer keeps between steps, on the MLA caches' step protocol.

Per layer, per slot (R rows of a ring hold positions p at row p mod R; every buffer has one spare row
at the end, where padding and dropped writes land):
- the window ring: the K = V entry of the last `sliding_window + max_rollback` tokens;
- CSA / HCA: the compressed entries (one per m tokens, never rewritten but by re-completion), and the
  compressor's carried state: projections (kv, gate + position bias) of the last coff·m + max_rollback
  tokens, from which an entry is pooled when its group completes (CSA also needs the previous group);
- CSA: the indexer's own compressed keys and carried state, the same way at index_head_dim.

`plan = cache.plan(new_tokens, slots=None)`, `layer(hidden, plan)` for each layer, `cache.commit(plan)`.
The bookkeeping is the MLA caches' (`mlakit.cache.protocol`: StepLife, StepBook): commit refuses
while a layer has not written the step, stale and superseded plans are refused on use, every refusal
changes nothing. A layer's write overwrites ring rows that `lengths` still covers (position p replaces
p − R), so each layer saves those rows before its first write of a step and a plan given up uncommitted
(discarded, superseded, stale) puts them back: the cache is then as it was before the plan.
Lowering `lengths` (rollback) is exact while every ring still holds what the shorter length needs;
`rollback(slot, length)` refuses otherwise, naming the lowest length it can go back to.
"""

from __future__ import annotations

import torch

from mlakit.cache.checks import (
    check_allocation,
    check_counts,
    check_positive,
    check_slot,
    check_slots,
    int_list,
)
from mlakit.cache.protocol import StepBook, lengths_seen
from mlakit.v4.config import CSA, HCA, SLIDING, V4Config
from mlakit.v4.plan import V4Plan, compress_plan, undo_rows, window_plan

# the buffers of a layer each kind of undo rows indexes
_RINGS = ("ring_kv", "ring_gate", "index_ring_kv", "index_ring_gate")
_STORES = ("store", "index_store")


class V4Cache(StepBook):
    def __init__(
        self,
        cfg: V4Config,
        batch_size: int,
        max_seq_len: int,
        *,
        num_layers: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        max_rollback: int = 0,
        layers: list[int] | None = None,
    ):
        if not isinstance(cfg, V4Config):
            raise ValueError(f"cfg must be a V4Config, got {type(cfg).__name__}")
        num_layers = cfg.num_layers if num_layers is None else num_layers
        for name, value in (
            ("batch_size", batch_size),
            ("max_seq_len", max_seq_len),
            ("num_layers", num_layers),
        ):
            check_positive(name, value)
        if num_layers > cfg.num_layers:
            raise ValueError(
                f"num_layers {num_layers} is more than the config's {cfg.num_layers} layer_types"
            )
        if isinstance(max_rollback, bool) or not isinstance(max_rollback, int) or max_rollback < 0:
            raise ValueError(f"max_rollback must be an integer >= 0, got {max_rollback!r}")
        self.cfg, self.batch_size, self.max_seq_len = cfg, batch_size, max_seq_len
        self.num_layers, self.max_rollback = num_layers, max_rollback
        self.layers = list(range(num_layers)) if layers is None else list(layers)
        check_allocation(
            f"V4Cache of {len(self.layers)} layers x {batch_size} slots x {max_seq_len} tokens",
            self._bytes(dtype) + 16 * batch_size,
            device,
        )
        self.state = {layer: self._allocate(cfg.layer_types[layer], dtype, device) for layer in self.layers}
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        # most tokens any ring of the slot has been written up to (what an exact rollback checks), and
        # the tokens the slot holds (an open plan's included; what `lengths` may go back up to)
        self.high = [0] * batch_size
        self.written = [0] * batch_size
        # the plan whose step is not yet committed (open, or stale until settled)
        self._open: V4Plan | None = None
        self.dtype, self.device = dtype, torch.device(device) if device is not None else torch.device("cpu")

    def ring(self, kind: str) -> int:
        """Rows of a ring per slot: window, or the carried tokens of a CSA / HCA compressor."""
        extra = self.max_rollback
        return {SLIDING: self.cfg.sliding_window, CSA: 2 * self.cfg.csa_ratio, HCA: self.cfg.hca_ratio}[
            kind
        ] + extra

    def per_slot(self, kind: str) -> int:
        return self.max_seq_len // self.cfg.ratio(kind)

    def _bytes(self, dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for layer in self.layers:
            kind = self.cfg.layer_types[layer]
            total += self.batch_size * self.ring(SLIDING) * self.cfg.head_dim * size
            if kind != SLIDING:
                widths = [self.cfg.head_dim] + ([self.cfg.index_head_dim] if kind == CSA else [])
                coff = 2 if kind == CSA else 1
                for d in widths:
                    total += self.batch_size * (
                        self.per_slot(kind) * d * size + self.ring(kind) * coff * d * (size + 4)
                    )
        return total

    def _allocate(self, kind: str, dtype, device) -> dict:
        cfg, b = self.cfg, self.batch_size
        st = {"window": torch.zeros(b * self.ring(SLIDING) + 1, cfg.head_dim, dtype=dtype, device=device)}
        if kind == SLIDING:
            return st
        coff = 2 if kind == CSA else 1
        names = [("", cfg.head_dim)] + ([("index_", cfg.index_head_dim)] if kind == CSA else [])
        for prefix, d in names:
            rows = b * self.ring(kind) + 1
            st[prefix + "ring_kv"] = torch.zeros(rows, coff * d, dtype=dtype, device=device)
            gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            st[prefix + "ring_gate"] = torch.zeros(rows, coff * d, dtype=gate_dtype, device=device)
            st[prefix + "store"] = torch.zeros(b * self.per_slot(kind) + 1, d, dtype=dtype, device=device)
        return st

    def grow(self, max_seq_len: int) -> None:
        """Make room for `max_seq_len` tokens per slot (the compressed stores grow; rings do not)."""
        check_positive("max_seq_len", max_seq_len)
        if max_seq_len <= self.max_seq_len:
            return
        self._refuse_open("growing")
        old = {kind: self.per_slot(kind) for kind in (CSA, HCA)}
        self.max_seq_len = max_seq_len
        for layer, st in self.state.items():
            kind = self.cfg.layer_types[layer]
            for name in [n for n in st if n.endswith("store")]:
                t, per = st[name], self.per_slot(kind)
                new = t.new_zeros(self.batch_size * per + 1, t.shape[1])
                rows = self.batch_size * old[kind]
                new[:-1].view(self.batch_size, per, -1)[:, : old[kind]] = t[:rows].view(
                    self.batch_size, old[kind], -1
                )
                st[name] = new

    # what StepBook reads

    @property
    def slot_capacity(self) -> int:
        return self.max_seq_len

    def _tokens(self) -> list[int]:
        return self.written

    def _truncate(self, slot: int, tokens: int) -> None:
        self.written[slot] = tokens

    def _held_layers(self) -> list[int]:
        return list(self.layers)

    def _checked_lengths(self) -> list[int]:
        """StepBook's checks of `lengths` (0..max_seq_len, never above the tokens a slot holds), and
        every lowered length an exact rollback (the rings still hold what it reads). Changes nothing."""
        lengths = super()._checked_lengths()
        for s, n in enumerate(lengths):
            if not self._exact(n, self.high[s]):
                raise ValueError(
                    f"lengths[{s}] = {n} is not an exact rollback; the nearest allowed length is "
                    f"{self.lowest_exact(s)} (or 0)"
                )
        return lengths

    def plan(self, new_tokens, slots=None, *, seq_len: int | None = None) -> V4Plan:
        """Check one step and build what its layers read; every refusal (ValueError) comes first, and
        changes nothing (not an open plan either). A plan made while another is open supersedes it."""
        if slots is not None:
            rows = len(int_list(slots, "slots"))
        elif isinstance(new_tokens, int) or hasattr(new_tokens, "__index__"):
            rows = self.batch_size
        else:
            rows = len(int_list(new_tokens, "new_tokens"))
        counts, _ = check_counts(new_tokens, rows)
        width = max(counts) if seq_len is None else check_positive("seq_len", seq_len)
        if max(counts) > width:
            raise ValueError(f"new_tokens {counts} outside 1..{width} (the padded width seq_len)")
        slot_ids = check_slots(slots, rows, self.batch_size)
        lengths = self._checked_lengths()
        starts = [lengths[s] for s in slot_ids]
        over = [s for s, n, c in zip(slot_ids, starts, counts, strict=True) if n + c > self.max_seq_len]
        if over:
            raise ValueError(f"new_tokens {counts} overflow slots {over} (max_seq_len {self.max_seq_len})")
        # built before any change (it reads no ring): should it fail (memory), nothing changed
        plan = self._build(slot_ids, torch.tensor(starts, dtype=torch.long), torch.tensor(counts), width)
        self._supersede()
        self._settle(lengths)  # the superseded plan's rows are put back (`_given_up`)
        for s, st, n in zip(slot_ids, starts, counts, strict=True):
            self.written[s] = st + n
        self._open = plan
        plan.seen = lengths_seen(self.lengths)
        return plan

    def _build(self, slot_ids: list[int], starts, counts, width: int) -> V4Plan:
        cfg, slots = self.cfg, torch.tensor(slot_ids, dtype=torch.long)
        rw = self.ring(SLIDING)
        spare_w = self.batch_size * rw
        positions, win_rows, win_visible, win_write = window_plan(
            starts, counts, width, cfg.sliding_window, rw, slots, spare_w
        )
        dev = self.device
        plan = V4Plan(
            cache=self,
            slots=slots,
            starts=starts,
            counts=counts,
            width=width,
            positions=positions.to(dev),
            win_rows=win_rows.to(dev),
            win_visible=win_visible.to(dev),
            win_write=win_write.to(dev),
            win_undo=undo_rows(win_write, spare_w).to(dev),
        )
        for kind in {cfg.layer_types[layer] for layer in self.layers} - {SLIDING}:
            ring, per = self.ring(kind), self.per_slot(kind)
            spare = {"ring": self.batch_size * ring, "store": self.batch_size * per}
            cp = compress_plan(
                starts, counts, width, cfg.ratio(kind), 2 if kind == CSA else 1, ring, per, slots, spare
            )
            cp.ring_undo = undo_rows(cp.ring_write, spare["ring"])
            cp.store_undo = undo_rows(cp.entry_write, spare["store"])
            for name in (
                "ring_rows",
                "src",
                "src_valid",
                "entry_pos",
                "entry_write",
                "ring_write",
                "bias_idx",
                "ring_undo",
                "store_undo",
            ):
                setattr(cp, name, getattr(cp, name).to(dev))
            cp.store_rows, cp.visible = cp.store_rows.to(dev), cp.visible.to(dev)
            plan.compress[kind] = cp
        return plan

    def _undo_rows(self, plan: V4Plan, layer: int) -> list[tuple[str, torch.Tensor]]:
        """(buffer name, rows) of every buffer of `layer` the step writes."""
        kind = self.cfg.layer_types[layer]
        out = [("window", plan.win_undo)]
        if kind != SLIDING:
            cp = plan.compress[kind]
            st = self.state[layer]
            out += [(n, cp.ring_undo) for n in _RINGS if n in st]
            out += [(n, cp.store_undo) for n in _STORES if n in st]
        return out

    def _begin_layer(self, plan: V4Plan, layer: int, module) -> None:
        """Before `module` writes layer `layer` of the step (its call's checks passed): claim the layer
        for it (a second module with the same layer_idx is refused), and save the rows the write
        overwrites the first time this layer runs the step (a retry rewrites the same rows). No host
        read of a tensor value."""
        plan.claim(layer, module)
        if layer not in plan.saved:
            st, rows_of = self.state[layer], self._undo_rows(plan, layer)
            with torch.no_grad():
                plan.saved[layer] = [(name, rows, st[name].index_select(0, rows)) for name, rows in rows_of]

    def _given_up(self, plan: V4Plan) -> None:
        """Put back what the layers of an uncommitted plan overwrote: the cache is as before the plan."""
        saved, plan.saved = plan.saved, {}
        with torch.no_grad():
            for layer, buffers in saved.items():
                st = self.state[layer]
                for name, rows, values in buffers:
                    st[name].index_copy_(0, rows, values)

    def commit(self, plan: V4Plan, *, layers=None) -> None:
        """Advance `lengths` by the plan's new tokens: the step is done.

        Refused (ValueError naming them) while a layer of the cache has not written the step: every
        layer the cache holds by default; `layers` (a list of layer indices) names the layers this
        step writes when that is on purpose fewer. In the layers that did not write, the step's tokens
        then read as zeros: the window rows, the compressors' (and indexer's) carried projections and
        gates, and the entries the step completes are zeroed (never what the rows held before). A
        stale plan (a slot released, a length changed since it was made) is refused too."""
        self._check_plan(plan)
        self._check_commit(plan, layers)
        if layers is not None:
            with torch.no_grad():
                for layer in self.layers:
                    if layer in plan.ran:
                        continue
                    st = self.state[layer]
                    for name, rows in self._undo_rows(plan, layer):
                        st[name].index_fill_(0, rows[:-1], 0)  # the real rows, not the spare one
        self._commit_step(plan)
        for s, n in zip(plan.slots.tolist(), (plan.starts + plan.counts).tolist(), strict=True):
            self.high[s] = max(self.high[s], n)
        plan.saved = {}

    def discard(self, plan: V4Plan) -> None:
        """Give up a plan that is open or stale (a layer failed, a request was cancelled): `lengths`
        stay, and every row its layers overwrote is put back."""
        self._check_plan(plan)
        self._discard_step(plan)

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, V4Plan):
            raise ValueError(f"plan must be a V4Plan from V4Cache.plan(...), got {type(plan).__name__}")
        if plan.cache is not self:
            raise ValueError("plan was made by another cache")

    def _refuse_open(self, doing: str) -> None:
        if self._open is not None:
            raise ValueError(f"a plan is {self._open.state}; commit or discard it before {doing} the cache")

    def release(self, slot: int) -> None:
        """Empty `slot` for reuse (always exact: a length of 0 reads nothing); an open plan that writes
        it goes stale (a cancelled request)."""
        slot = check_slot(slot, self.batch_size)
        self._release_slot(slot)
        self.high[slot] = 0

    def reorder(self, index) -> None:
        """Rebuild the slots from `index` (beam search): new slot i is old slot index[i], every per-slot
        state (window ring, compressed entries, compressor and indexer carried state, lengths, high-water
        marks) with it. `index` may repeat or drop slots; its length is the new batch size."""
        idx = self._check_index(index)
        self._refuse_open("reordering")
        b, n = self.batch_size, len(idx)
        for st in self.state.values():
            for name, t in st.items():
                per = (t.shape[0] - 1) // b
                new = t.new_zeros(n * per + 1, t.shape[1])
                new[:-1] = t[:-1].view(b, per, -1).index_select(0, idx.to(t.device)).reshape(n * per, -1)
                st[name] = new
        self.lengths = self.lengths.index_select(0, idx)
        self.high = [self.high[i] for i in idx.tolist()]
        self.written = [self.written[i] for i in idx.tolist()]
        self.batch_size = n

    def _check_index(self, index) -> torch.Tensor:
        what = f"a 1-D sequence of at least one slot index in 0..{self.batch_size - 1}"
        try:
            idx = torch.as_tensor(index).detach().cpu()
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"index must be {what}, got {index!r}") from None
        if idx.dim() != 1 or idx.numel() == 0 or idx.dtype.is_floating_point or idx.dtype.is_complex:
            raise ValueError(f"index must be {what}, got {index!r}")
        if idx.dtype == torch.bool:
            raise ValueError(f"index must be {what} (not a boolean mask), got {index!r}")
        bad = [int(i) for i in idx.tolist() if not 0 <= i < self.batch_size]
        if bad:
            raise ValueError(f"index must be {what}, got {index!r} (out of range: {bad})")
        return idx.long()

    def lowest_exact(self, slot: int) -> int:
        """The lowest length above 0 `slot` can go back to: every ring still holds what it needs
        (exactness only grows with the length, so a bisection finds it)."""
        high = self.high[slot]
        lo, hi = 1, max(high, 1)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._exact(mid, high) else (mid + 1, hi)
        return lo

    def _exact(self, length: int, high: int) -> bool:
        """Every position a step at `length` reads from a ring is still there (not overwritten by a
        token up to `high` − 1)."""
        if length == 0 or length >= high:
            return True
        # a query at t >= length sees the window t - n_win + 1 .. t: ring positions from length - n_win + 1
        needs = [(max(0, length - self.cfg.sliding_window + 1), self.ring(SLIDING))]
        for kind in {self.cfg.layer_types[layer] for layer in self.layers} - {SLIDING}:
            m, coff = self.cfg.ratio(kind), 2 if kind == CSA else 1
            needs.append((max(0, (length // m - coff + 1) * m), self.ring(kind)))
        return all(first >= length or first + ring >= high for first, ring in needs)

    def rollback(self, slot: int, length: int) -> None:
        """Lower `lengths[slot]` to `length` (drop the newest tokens) where that is exact; an open plan
        that writes the slot goes stale (its rows are put back)."""
        slot = check_slot(slot, self.batch_size)
        current = int(self.lengths[slot])
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= current:
            raise ValueError(
                f"length must be an integer in 0..{current} (slot {slot}'s length), got {length!r}"
            )
        if not self._exact(length, self.high[slot]):
            raise ValueError(
                f"rollback of slot {slot} to {length} is not exact: its rings were overwritten past it; "
                f"the nearest allowed length is {self.lowest_exact(slot)} "
                f"(or 0; max_rollback={self.max_rollback})"
            )
        lengths = self._checked_lengths()  # the other slots' lengths, edited in place, are checked too
        self.lengths[slot] = length
        lengths[slot] = length
        self._settle(lengths)

    @property
    def bytes_per_token(self) -> dict[str, float]:
        """Bytes stored per cached token per layer type, at long context (rings amortized away)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        cfg = self.cfg
        return {
            SLIDING: 0.0,
            CSA: (cfg.head_dim + cfg.index_head_dim) * size / cfg.csa_ratio,
            HCA: cfg.head_dim * size / cfg.hca_ratio,
        }

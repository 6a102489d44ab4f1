"""StepCache: plan / commit / discard / append / write's checks, shared by the contiguous and the paged
cache (the bookkeeping of lengths and open plans: `protocol.StepBook`).

A subclass provides `check_lengths`, `resolve_slots`, `check_append` (checks that change nothing),
`_reserve` (the step's rows), `_rows_of` and `_bucket` (what each row group reads) and `write`.
"""

from __future__ import annotations

import torch

from mlakit.cache.checks import check_counts, check_positive, int_list
from mlakit.cache.plan import StepPlan, decide_paths, make_plan
from mlakit.cache.protocol import StepBook, lengths_seen
from mlakit.dispatch import check_mode
from mlakit.rope import RotaryTable


class StepCache(StepBook):
    def _init_step(self, cfg, device) -> None:
        self.rope = RotaryTable(cfg)
        # the plan whose rows are reserved and not yet committed (open, or stale until settled)
        self._open: StepPlan | None = None

    def _table_of(self, slots: torch.Tensor):
        return None

    def plan(
        self,
        new_tokens,
        slots=None,
        *,
        mode: str = "auto",
        profile=None,
        seq_len: int | None = None,
        batch: int | None = None,
        bucket: bool = True,
    ) -> StepPlan:
        """Check one step and reserve its rows; every refusal (ValueError) comes before any change, to
        the cache and to an open plan alike. A plan made while another is open supersedes it.

        `new_tokens`: one count for every row or one per row; `slots`: the cache slot of each row
        (default: row b -> slot b); `seq_len`: the padded width S of the hidden states (default: the
        largest count); `batch`: the rows when neither slots nor per-row counts say it (default: every
        slot); `mode`: "auto" (the crossover, or `profile` when it matches) or a path for every row;
        `bucket=False`: attend over exactly the longest context instead of its key bucket (an eager
        one-off step: no masked work, but shapes change every step, so no graph can be reused).
        """
        check_mode(mode)
        if profile is not None and not callable(getattr(profile, "decide", None)):
            raise ValueError(
                "profile must be a CrossoverProfile (mlakit.calibration) or None, "
                f"got {type(profile).__name__}"
            )
        if not isinstance(bucket, bool):
            raise ValueError(f"bucket must be True or False, got {bucket!r}")
        rows = self._rows_for(new_tokens, slots, batch)
        counts, uniform = check_counts(new_tokens, rows)
        width = max(counts) if seq_len is None else check_positive("seq_len", seq_len)
        if max(counts) > width:
            raise ValueError(f"new_tokens {counts} outside 1..{width} (the padded width seq_len)")
        lengths = self._checked_lengths()
        slot_ids = self.resolve_slots(slots, rows)
        # what each row writes is checked (its count); padding goes to a spare row, so the padded width
        # is only refused past any row a step could bring (a typo: host lists of seq_len per row)
        self.check_append(counts[0] if uniform else torch.tensor(counts), slot_ids)
        widest = max(self.cfg.max_position_embeddings, self.step_capacity)
        if width > widest:
            raise ValueError(
                f"seq_len {width} is wider than any step can be ({widest}: the larger of the model's "
                f"max_position_embeddings {self.cfg.max_position_embeddings} and the {self.step_capacity} "
                "tokens one row of this cache can take); expected the padded width of the step's hidden "
                "states"
            )
        # the path of each row: the last thing that can fail (a profile's `decide` may raise anything),
        # decided before any change
        starts = [lengths[s] for s in slot_ids.tolist()]
        paths = decide_paths(self.cfg, starts, counts, uniform, mode, profile)
        slot_list = slot_ids.tolist()
        return self._make(slot_list, counts, uniform, width, mode, profile, bucket, paths, starts, lengths)

    def step_plan(
        self, counts: list[int], slots: list[int], *, bucket: bool = True, profile=None
    ) -> StepPlan:
        """The plan of a serving engine's step: `plan(counts, slots, mode="auto")` without the checks of
        the caller's arguments, which the engine's scheduler guarantees (distinct slots in range, counts
        >= 1 that the pages can take, one plan at a time). The bookkeeping is the same: the plan is open,
        commit / discard / stale work as for any plan, and a failure while reserving undoes itself."""
        lengths = self.lengths.tolist()
        starts = [lengths[s] for s in slots]
        paths = decide_paths(self.cfg, starts, counts, False, "auto", profile)
        return self._make(slots, counts, False, max(counts), "auto", profile, bucket, paths, starts, lengths)

    def _make(self, slots, counts, uniform, width, mode, profile, bucket, paths, starts, lengths) -> StepPlan:
        """Reserve the step's rows and build its plan (every check has passed); should anything still
        fail (memory), the bookkeeping and the open plan are put back as they were."""
        slot_t = torch.tensor(slots, dtype=torch.long)
        undo = self._undo_point()
        try:
            superseded = self._supersede()
            self._open = None
            self._settle(lengths)
            write_rows = self._reserve(slots, counts, width)
            plan = make_plan(
                self,
                slots,
                counts,
                uniform,
                width,
                mode,
                profile,
                write_rows,
                self._bucket if bucket else _exact_keys,
                self._rows_of(slot_t),
                self._table_of(slot_t),
                paths=paths,
                starts=starts,
            )
        except BaseException:
            self._undo(undo)
            self._unsupersede(superseded)
            raise
        self._reserved()
        self._open = plan
        plan.seen = lengths_seen(self.lengths)
        return plan

    def _undo_point(self):
        """What `_undo` needs to put the host bookkeeping back as it is now (cheap: no copy of a pool's
        free list)."""
        return None

    def _undo(self, point) -> None:
        """Put the bookkeeping back as it was at `point` (a plan that failed after its checks)."""

    def _reserved(self) -> None:
        """The plan is made: the changes to the buffers `_reserve` left for after (none by default)."""

    def _rows_for(self, new_tokens, slots, batch) -> int:
        if batch is not None:
            rows = check_positive("batch", batch)
            if rows > self.batch_size:
                raise ValueError(f"batch of {rows} rows, but the cache has {self.batch_size} slots")
            return rows
        if slots is not None:
            return len(int_list(slots, "slots"))
        if not isinstance(new_tokens, int) and not hasattr(new_tokens, "__index__"):
            return len(int_list(new_tokens, "new_tokens"))
        return self.batch_size

    def commit(self, plan: StepPlan, *, layers=None) -> None:
        """Advance `lengths` by the plan's new tokens: the step is done.

        Refused (ValueError naming them) while a layer of the cache has not written the step's rows:
        every layer by default; `layers` (a list of layer indices) names the layers this step writes
        when that is on purpose fewer (the step's rows in the layers that did not write are then
        zeroed: they never show what a reused row held before). A stale
        plan (a slot released, a length changed since it was made) is refused too.
        """
        self._check_plan(plan)
        step = plan.step
        self._check_commit(step, layers)
        if layers is not None:
            # the layers that did not write keep no stale rows under the new tokens (a reused page
            # may hold a released request's latents): zeroed, as the contiguous cache's new rows are
            rows = step.slot_mapping
            for i in range(self.num_layers):
                if i not in step.ran:
                    self._zero_rows(i, rows)
        self._commit_step(step)

    def discard(self, plan: StepPlan) -> None:
        """Give up a plan that is open or stale (a layer failed, a request was cancelled): `lengths`
        stay; the rows reserved for it are given back."""
        self._check_plan(plan)
        self._discard_step(plan.step)

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, StepPlan):
            raise ValueError(f"plan must be a StepPlan from cache.plan(...), got {type(plan).__name__}")
        if plan.cache is not self or plan.step.cache is not self:
            raise ValueError("plan was made by another cache")

    def append(self, c_kv: torch.Tensor, k_pe: torch.Tensor, slots=None, *, layer: int = 0) -> torch.Tensor:
        """Write normalized latents [B,S,L] and rotated rope keys [B,S,dr] of one layer and advance
        `lengths` (plan / write / commit in one call); returns the slots used. A cache of one layer
        only: `lengths` are shared by every layer, so on a cache of several layers one step is
        `plan`, then `write` for each layer, then `commit` (refused here, before any change)."""
        self._check_entries(c_kv, k_pe)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer!r} out of range, expected 0..{self.num_layers - 1}")
        if self.num_layers > 1:
            raise ValueError(
                f"append(layer={layer}) on a cache of {self.num_layers} layers would advance lengths for "
                "every layer after writing one: plan = cache.plan(...), cache.write(plan, layer, c_kv, "
                "k_pe) for each layer, then cache.commit(plan)"
            )
        b, s, _ = c_kv.shape
        if s == 0:
            raise ValueError(f"appending 0 tokens; expected at least 1 (c_kv has shape {tuple(c_kv.shape)})")
        plan = self.plan(s, slots, batch=b, mode="absorb")
        self.write(plan, layer, c_kv, k_pe)
        self.commit(plan)
        return plan.slots

    def _check_write(self, plan, layer, c_kv, k_pe) -> tuple:
        """Checks of `write` (host facts only: no tensor op, no device sync; ~1 us when they pass);
        returns (the plan's step, on which the write then records `layer`, c_kv [N, L], k_pe [N, dr]
        packed: the caller's rectangle [B, S, ...] is packed here)."""
        step = self._open_layer(plan, layer)
        (n, b, s, latent, rope), dtype, device = plan.write_facts
        ok = (
            isinstance(c_kv, torch.Tensor)
            and isinstance(k_pe, torch.Tensor)
            and c_kv.dtype is dtype
            and k_pe.dtype is dtype
            # the device index (-1: the CPU): cheaper than building torch.device objects
            and c_kv.get_device() == k_pe.get_device() == device
        )
        if ok and c_kv.shape == (n, latent) and k_pe.shape == (n, rope):
            return step, c_kv, k_pe
        if ok and c_kv.shape == (b, s, latent) and k_pe.shape == (b, s, rope):
            return step, pack_rows(c_kv, plan), pack_rows(k_pe, plan)
        self._refuse_write((plan.batch, plan.seq_len), c_kv, k_pe, n)

    def _open_layer(self, plan, layer) -> StepPlan:
        """The step a write of `layer` in `plan` records on, after checking both (`write`'s checks that
        come before its tensors')."""
        if type(plan) is not StepPlan or plan.cache is not self:
            self._check_plan(plan)
        step = plan if plan.host is None else plan.host
        step.check_open()
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer!r} out of range, expected 0..{self.num_layers - 1}")
        return step

    def _check_write_index(self, plan, layer, k_idx) -> torch.Tensor:
        """Checks of `write_index` (host facts only, as `_check_write`): the plan open, `layer` in range,
        k_idx [N, index_head_dim] (or the rectangle [B, S, index_head_dim]) in the cache's dtype and on
        its device; returns it packed."""
        if type(plan) is not StepPlan or plan.cache is not self:
            self._check_plan(plan)
        plan.check_open()
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer!r} out of range, expected 0..{self.num_layers - 1}")
        width = self.cfg.index_head_dim
        if not self.cfg.is_sparse:
            raise ValueError("k_idx: this cache holds no indexer keys (its config is dense MLA, not DSA)")
        packed, want = (plan.num_tokens, width), (plan.batch, plan.seq_len, width)
        device = plan.write_facts[2]
        if not isinstance(k_idx, torch.Tensor) or k_idx.shape not in (packed, want):
            shape = tuple(k_idx.shape) if isinstance(k_idx, torch.Tensor) else type(k_idx).__name__
            raise ValueError(f"k_idx has shape {shape}, the plan writes {want} (or {packed} packed)")
        if k_idx.dtype is not self.dtype or k_idx.get_device() != device:
            raise ValueError(
                f"k_idx is {k_idx.dtype} on {k_idx.device}, the cache takes {self.dtype} on {self.device}"
            )
        return k_idx if k_idx.dim() == 2 else pack_rows(k_idx, plan)

    def _refuse_write(self, rows: tuple, c_kv, k_pe, packed: int) -> None:
        cfg = self.cfg
        pairs = (("c_kv", c_kv, cfg.kv_lora_rank), ("k_pe", k_pe, cfg.qk_rope_head_dim))
        two_d = isinstance(c_kv, torch.Tensor) and c_kv.dim() == 2
        for name, t, width in pairs:
            want = (packed, width) if two_d else (*rows, width)
            if not isinstance(t, torch.Tensor) or t.shape != want:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} has shape {shape}, the plan writes {(*rows, width)} "
                    f"(or {(packed, width)} packed)"
                )
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError(
                    f"{name} is {t.dtype} on {t.device}, the cache takes {self.dtype} on {self.device}"
                )

    def _check_entries(self, c_kv, k_pe) -> None:
        cfg = self.cfg
        for name, t in (("c_kv", c_kv), ("k_pe", k_pe)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor [B,S,width], got {type(t).__name__}")
        if c_kv.dim() != 3 or k_pe.dim() != 3:
            raise ValueError(
                f"c_kv and k_pe must be [B,S,width], got {tuple(c_kv.shape)} and {tuple(k_pe.shape)}"
            )
        b, s, width = c_kv.shape
        if width != cfg.kv_lora_rank:
            raise ValueError(f"c_kv has width {width}, cache expects kv_lora_rank {cfg.kv_lora_rank}")
        if tuple(k_pe.shape) != (b, s, cfg.qk_rope_head_dim):
            raise ValueError(f"k_pe has shape {tuple(k_pe.shape)}, expected {(b, s, cfg.qk_rope_head_dim)}")
        for name, t in (("c_kv", c_kv), ("k_pe", k_pe)):
            if t.dtype != self.dtype:
                raise ValueError(f"{name} has dtype {t.dtype}, cache holds {self.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, cache is on {self.device}")


def pack_rows(x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """The caller's rectangle x [B, S, ...] as the plan's packed tokens [N, ...]."""
    flat = x.reshape(plan.batch * plan.seq_len, *x.shape[2:])
    return flat if plan.pack is None else flat.index_select(0, plan.pack)


def _exact_keys(keys: int) -> int:
    return keys


def row_counts(new_tokens: int | torch.Tensor, rows: int) -> torch.Tensor:
    """New tokens per row as a CPU LongTensor [rows], from one count for all rows or one per row (>= 1)."""
    return torch.tensor(check_counts(new_tokens, rows, "new token counts")[0], dtype=torch.long)

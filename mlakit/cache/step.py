"""StepCache: plan / commit / append, shared by the contiguous and the paged cache.

A subclass provides `check_lengths`, `resolve_slots`, `check_append` (checks that change nothing),
`_reserve` (the step's rows), `_rows_of` and `_bucket` (what each row group reads) and `write`.
"""

from __future__ import annotations

import torch

from mlakit.cache.checks import check_counts, check_positive, int_list
from mlakit.cache.plan import StepPlan, make_plan
from mlakit.dispatch import check_mode
from mlakit.rope import RotaryTable


class StepCache:
    def _init_step(self, cfg, device) -> None:
        self.rope = RotaryTable(cfg)
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
        """Check one step and reserve its rows; every refusal (ValueError) comes before any change.

        `new_tokens`: one count for every row or one per row; `slots`: the cache slot of each row
        (default: row b -> slot b); `seq_len`: the padded width S of the hidden states (default: the
        largest count); `batch`: the rows when neither slots nor per-row counts say it (default: every
        slot); `mode`: "auto" (the crossover, or `profile` when it matches) or a path for every row;
        `bucket=False`: attend over exactly the longest context instead of its key bucket (an eager
        one-off step: no masked work, but shapes change every step, so no graph can be reused).
        """
        check_mode(mode)
        rows = self._rows_for(new_tokens, slots, batch)
        counts, uniform = check_counts(new_tokens, rows)
        width = max(counts) if seq_len is None else check_positive("seq_len", seq_len)
        if max(counts) > width:
            raise ValueError(f"new_tokens {counts} outside 1..{width} (the padded width seq_len)")
        self.check_lengths()
        slot_ids = self.resolve_slots(slots, rows)
        self.check_append(counts[0] if uniform else torch.tensor(counts), slot_ids)
        # every check passed: from here on the step's rows are reserved
        if self._open is not None:
            self._open.state = "superseded"
        write_rows = self._reserve(slot_ids.tolist(), counts, width)
        plan = make_plan(
            self,
            slot_ids.tolist(),
            counts,
            uniform,
            width,
            mode,
            profile,
            write_rows,
            self._bucket if bucket else _exact_keys,
            self._rows_of(slot_ids),
            self._table_of(slot_ids),
        )
        self._open = plan
        return plan

    def _rows_for(self, new_tokens, slots, batch) -> int:
        if batch is not None:
            return check_positive("batch", batch)
        if slots is not None:
            return len(int_list(slots, "slots"))
        if not isinstance(new_tokens, int) and not hasattr(new_tokens, "__index__"):
            return len(int_list(new_tokens, "new_tokens"))
        return self.batch_size

    def commit(self, plan: StepPlan) -> None:
        """Advance `lengths` by the plan's new tokens: the step is done for every layer."""
        self._check_plan(plan)
        if not torch.equal(self.lengths[plan.slots], plan.starts):
            raise ValueError(
                f"lengths of slots {plan.slots.tolist()} changed since the plan "
                f"({plan.starts.tolist()} -> {self.lengths[plan.slots].tolist()}); plan the step again"
            )
        self.lengths[plan.slots] = plan.starts + plan.counts
        plan.state = "committed"
        self._open = None

    def discard(self, plan: StepPlan) -> None:
        """Give up an open plan (a layer failed): `lengths` stay; rows reserved for it are dropped."""
        self._check_plan(plan)
        plan.state = "discarded"
        self._open = None
        self.check_lengths()

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, StepPlan):
            raise ValueError(f"plan must be a StepPlan from cache.plan(...), got {type(plan).__name__}")
        if plan.cache is not self:
            raise ValueError("plan was made by another cache")
        plan.check_open()

    def append(self, c_kv: torch.Tensor, k_pe: torch.Tensor, slots=None, *, layer: int = 0) -> torch.Tensor:
        """Write normalized latents [B,S,L] and rotated rope keys [B,S,dr] of one layer and advance
        `lengths` (plan / write / commit in one call); returns the slots used."""
        self._check_entries(c_kv, k_pe)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer!r} out of range, expected 0..{self.num_layers - 1}")
        b, s, _ = c_kv.shape
        if s == 0:
            raise ValueError(f"appending 0 tokens; expected at least 1 (c_kv has shape {tuple(c_kv.shape)})")
        plan = self.plan(s, slots, batch=b, mode="absorb")
        self.write(plan, layer, c_kv, k_pe)
        self.commit(plan)
        return plan.slots

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


def _exact_keys(keys: int) -> int:
    return keys


def row_counts(new_tokens: int | torch.Tensor, rows: int) -> torch.Tensor:
    """New tokens per row as a CPU LongTensor [rows], from one count for all rows or one per row (>= 1)."""
    return torch.tensor(check_counts(new_tokens, rows, "new token counts")[0], dtype=torch.long)

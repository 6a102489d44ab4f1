"""StepBook: the host bookkeeping of the step protocol (plan -> every layer -> commit) that both caches
share: which rows an open plan holds, when it goes stale, what `lengths` may be. Plain Python over
`lengths.tolist()`: no tensor op, no device sync.

A cache provides `lengths`, `_open` (the plan whose rows are reserved, or None), `num_layers`,
`slot_capacity` (None: no fixed room per slot), `_tokens()` (tokens held per slot, reserved rows
included) and `_truncate(slot, tokens)`.
"""

from __future__ import annotations

from mlakit.cache.checks import int_list
from mlakit.cache.plan import StepPlan, lengths_seen


class StepBook:
    def check_step(self, plan: StepPlan) -> None:
        """Refuse (and mark stale) an open plan whose slots' lengths changed since it was made."""
        lengths = self.lengths.tolist()
        changed = [
            (s, st, lengths[s])
            for s, st in zip(plan.slots.tolist(), plan.starts.tolist(), strict=True)
            if lengths[s] != st
        ]
        if changed:
            plan.state = "stale"
            plan.why = (
                f"lengths of slots {[c[0] for c in changed]} changed since the plan "
                f"({[c[1] for c in changed]} -> {[c[2] for c in changed]})"
            )
            plan.check_open()
        plan.seen = lengths_seen(self.lengths)

    def check_lengths(self) -> None:
        """Validate `lengths`, then settle them: an open plan whose slots' lengths changed goes stale,
        and the rows past each slot's length are given back (but an open plan's reserved rows)."""
        self._settle(self._checked_lengths())

    def _checked_lengths(self) -> list[int]:
        """`lengths` as a list, refused (ValueError) when one is negative, past the slot's capacity, or
        past the tokens it holds (an open plan's slots: its tokens before the step). Changes nothing."""
        lengths = self.lengths.tolist()
        held = list(self._tokens())
        plan = self._open
        if plan is not None:
            for s, start in zip(plan.slots.tolist(), plan.starts.tolist(), strict=True):
                held[s] = min(held[s], start)
        cap = self.slot_capacity
        if cap is not None and any(not 0 <= n <= cap for n in lengths):
            raise ValueError(f"cache lengths {lengths} outside 0..{cap}")
        if any(not 0 <= n <= h for n, h in zip(lengths, held, strict=True)):
            raise ValueError(
                f"cache lengths {lengths} outside 0..tokens written {held}; lengths can only be lowered"
            )
        return lengths

    def _settle(self, lengths: list[int]) -> None:
        """Mark the open plan stale if its slots' lengths changed; give back every row past `lengths`
        except those the open plan (still open) reserved."""
        plan = self._open
        keep = list(lengths)
        if plan is not None and plan.state == "open":
            slots, starts = plan.slots.tolist(), plan.starts.tolist()
            changed = [s for s, st in zip(slots, starts, strict=True) if lengths[s] != st]
            if changed:
                plan.state = "stale"
                plan.why = f"lengths of slots {changed} changed since the plan"
            else:
                for s, st, n in zip(slots, starts, plan.counts.tolist(), strict=True):
                    keep[s] = st + n
                plan.seen = lengths_seen(self.lengths)
        if plan is not None and plan.state != "open":
            self._open = None
        for s, (n, held) in enumerate(zip(keep, list(self._tokens()), strict=True)):
            if n < held:
                self._truncate(s, n)

    def _release_slot(self, slot: int) -> None:
        """Empty `slot`: an open plan that writes it goes stale (a cancelled request)."""
        lengths = self._checked_lengths()
        plan = self._open
        if plan is not None and plan.state == "open" and slot in plan.slots.tolist():
            plan.state, plan.why = "stale", f"slot {slot} was released after the plan was made"
        self.lengths[slot] = 0
        lengths[slot] = 0
        self._settle(lengths)

    def _layers_arg(self, layers) -> list[int]:
        if layers is None:
            return list(range(self.num_layers))
        got = int_list(list(layers) if isinstance(layers, range) else layers, "layers")
        if not got or any(not 0 <= i < self.num_layers for i in got) or len(set(got)) != len(got):
            raise ValueError(
                f"layers {got} must be distinct layer indices in 0..{self.num_layers - 1}, at least one"
            )
        return got

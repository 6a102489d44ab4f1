"""The step protocol (plan -> every layer -> commit) that every cache shares: the lifecycle of a plan
(`StepLife`) and the host bookkeeping of the cache that made it (`StepBook`): which rows an open plan
holds, when it goes stale, what `lengths` may be, what commit and discard check. Plain Python over
`lengths.tolist()`: no tensor op, no device sync. The MLA caches (`mlakit.cache.step.StepCache`) and
DeepSeek-V4's `mlakit.v4.cache.V4Cache` both keep their steps this way.

A cache provides `lengths`, `_open` (the plan whose rows are reserved, or None), `num_layers`,
`slot_capacity` (None: no fixed room per slot), `_tokens()` (tokens held per slot, reserved rows
included) and `_truncate(slot, tokens)`; optionally `_held_layers()` (the layer indices a full commit
needs: every one of 0..num_layers-1 by default) and `_given_up(plan)` (a plan left uncommitted:
superseded, stale or discarded, is dropped; V4 puts back the ring rows its layers overwrote).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlakit.cache.checks import int_list

# a plan's states: "open" until one of the others (`StepLife.state`)
OPEN, COMMITTED, DISCARDED, SUPERSEDED, STALE = "open", "committed", "discarded", "superseded", "stale"


def lengths_seen(lengths: torch.Tensor) -> tuple:
    """(lengths, its version counter): what `check_open` compares. An inference tensor keeps no version
    (None): every check then reads the lengths (host values, still no tensor op)."""
    try:
        return lengths, lengths._version
    except RuntimeError:
        return lengths, None


@dataclass(eq=False, kw_only=True)
class StepLife:
    """The lifecycle of one plan, the same for every cache: "open" until committed, discarded,
    superseded by a newer plan, or made stale (a slot released or a length changed since it was made);
    `why` says how it left "open". Host bookkeeping only (layers never read it; no device sync).

    A plan class inherits it and declares `cache`, `slots`, `starts`, `counts` (CPU long tensors [B]:
    the slots, their lengths before the step, the new tokens of each row) and optionally `host` (the
    plan whose step this one serves; None: itself)."""

    state: str = OPEN
    # the layers that wrote the step's rows (the cache records them after each layer's write)
    ran: set = field(default_factory=set, repr=False)
    # layer_idx -> id of the module that ran it: each layer_idx runs a step in one module only
    owners: dict = field(default_factory=dict, repr=False)
    why: str | None = field(default=None, repr=False)
    # the `lengths` tensor and its version when last seen: a cheap test that no length changed since
    seen: tuple | None = field(default=None, repr=False)

    host = None  # not a field here: a plan class that refills plans declares its own

    @property
    def step(self):
        """The plan whose step this one serves: itself, or the plan it was last refilled from."""
        return self if self.host is None else self.host

    def end(self, state: str, why: str | None = None) -> None:
        """Leave "open" for `state` (committed / discarded / superseded / stale), saying `why`."""
        self.state, self.why = state, why

    def check_open(self) -> None:
        """Refuse (ValueError saying why) a plan that no longer serves an open step: committed,
        discarded, superseded by a newer plan, or stale (a slot released or a length changed since)."""
        plan = self if self.host is None else self.host
        if plan.state != OPEN:
            why = "" if plan.why is None else f" ({plan.why})"
            raise ValueError(
                f"plan is {plan.state}{why}; a plan serves one step: discard it if it is still open "
                "and make a new one with cache.plan(...)"
            )
        cache = plan.cache
        if cache is not None and not torch.compiler.is_dynamo_compiling():
            seen, lengths = plan.seen, cache.lengths
            # `lengths` untouched since last seen (one attribute read, no tensor op): nothing to check
            if seen is None or lengths is not seen[0] or seen[1] is None or lengths._version != seen[1]:
                cache.check_step(plan)

    def claim(self, layer_idx: int, module) -> None:
        """Record that `module` runs layer `layer_idx` of this step; a second module with the same
        layer_idx is refused (two layers of a stack built with one index) before it writes. The same
        module may run again (a retry after it raised rewrites the same rows)."""
        step = self if self.host is None else self.host
        if step.owners.setdefault(layer_idx, id(module)) != id(module):
            raise ValueError(
                f"layer_idx {layer_idx} already ran this step in another module: two layers of the stack "
                "have the same layer_idx (build layer i with layer_idx=i)"
            )


class StepBook:
    def check_step(self, plan: StepLife) -> None:
        """Refuse (and mark stale) an open plan whose slots' lengths changed since it was made."""
        lengths = self.lengths.tolist()
        changed = [
            (s, st, lengths[s])
            for s, st in zip(plan.slots.tolist(), plan.starts.tolist(), strict=True)
            if lengths[s] != st
        ]
        if changed:
            plan.state = STALE
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
        if plan is not None and plan.state == OPEN:
            slots, starts = plan.slots.tolist(), plan.starts.tolist()
            changed = [s for s, st in zip(slots, starts, strict=True) if lengths[s] != st]
            if changed:
                plan.state = STALE
                plan.why = f"lengths of slots {changed} changed since the plan"
            else:
                for s, st, n in zip(slots, starts, plan.counts.tolist(), strict=True):
                    keep[s] = st + n
                plan.seen = lengths_seen(self.lengths)
        if plan is not None and plan.state != OPEN:
            self._open = None
            self._given_up(plan)
        for s, (n, held) in enumerate(zip(keep, list(self._tokens()), strict=True)):
            if n < held:
                self._truncate(s, n)

    def _release_slot(self, slot: int) -> None:
        """Empty `slot`: an open plan that writes it goes stale (a cancelled request)."""
        lengths = self._checked_lengths()
        plan = self._open
        if plan is not None and plan.state == OPEN and slot in plan.slots.tolist():
            plan.state, plan.why = STALE, f"slot {slot} was released after the plan was made"
        self.lengths[slot] = 0
        lengths[slot] = 0
        self._settle(lengths)

    def _given_up(self, plan) -> None:
        """`plan` left `_open` uncommitted (superseded, stale, discarded): nothing by default (the MLA
        caches' rows past `lengths` are free anyway); a cache whose layers overwrite rows that `lengths`
        still covers (V4's rings) puts them back here."""

    def _held_layers(self) -> list[int]:
        """The layer indices a full commit needs: every layer of the cache."""
        return list(range(self.num_layers))

    def _layers_arg(self, layers) -> list[int]:
        held = self._held_layers()
        if layers is None:
            return held
        got = int_list(list(layers) if isinstance(layers, range) else layers, "layers")
        if not got or any(i not in held for i in got) or len(set(got)) != len(got):
            where = (
                f"in 0..{self.num_layers - 1}"
                if held == list(range(self.num_layers))
                else f"of the layers this cache holds {held}"
            )
            raise ValueError(f"layers {got} must be distinct layer indices {where}, at least one")
        return got

    # the lifecycle's transitions, shared by every cache's plan / commit / discard

    def _supersede(self) -> tuple:
        """A newer plan is being made: the open plan (if any, and still open) becomes superseded.
        Returns what `_unsupersede` needs should the new plan fail before it is made."""
        old = self._open
        was = None if old is None else (old.state, old.why)
        if old is not None and old.state == OPEN:
            old.end(SUPERSEDED, "a newer plan was made")
        return old, was

    def _unsupersede(self, undo: tuple) -> None:
        """The new plan failed after `_supersede`: the old plan is open (or stale) again, as it was."""
        old, was = undo
        if old is not None:
            old.state, old.why = was
        self._open = old

    def _check_commit(self, step, layers=None) -> list[int]:
        """What commit checks, in order, each a ValueError before any change (a plan found stale is
        only marked so): the step still open (not committed, discarded, superseded or stale), its
        slots' lengths unchanged since it was made, and every layer `layers` names (default: every
        layer of the cache) wrote the step's rows. Returns the layers named."""
        step.check_open()
        self.check_step(step)
        need = self._layers_arg(layers)
        missing = [i for i in need if i not in step.ran]
        if missing:
            wrote = sorted(step.ran)
            raise ValueError(
                f"layers {missing} did not write this step (layers that wrote: {wrote}); run them with "
                "this plan, name the layers the step writes with commit(plan, layers=[...]), or "
                "cache.discard(plan)"
            )
        return need

    def _commit_step(self, step) -> None:
        """The step is done (after `_check_commit`): `lengths` advance by its new tokens."""
        self.lengths[step.slots] = step.starts + step.counts
        step.end(COMMITTED)
        self._open = None

    def _discard_step(self, step) -> None:
        """Give up a step that is open or stale (refused otherwise, saying what happened to it):
        `lengths` stay; what it reserved is given back (`_given_up`, then `_settle`)."""
        if step.state not in (OPEN, STALE):
            step.check_open()  # says what happened to it
        lengths = self._checked_lengths()
        step.state = DISCARDED  # `why` keeps what made it stale, if it was
        if self._open is step:
            self._open = None
            self._given_up(step)
        self._settle(lengths)

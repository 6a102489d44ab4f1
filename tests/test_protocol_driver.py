"""A seeded random driver of the step protocol itself, on both caches, against a float64 oracle.

Steps are planned over random slots and ragged counts, and between the layers of a step (or before
its commit) the driver does what a careless or unlucky caller does: plans refused while the step is
open, a layer that raises (retried or the plan discarded), a slot of the step released (a cancelled
request) or rolled back, a slot outside it released or rolled back, a second module with layer_idx 0,
a commit before the last layer, and steps replayed through a captured plan (`copy_from`). After every
operation: `lengths` equal the oracle's, and no slot's visible latents changed except by a committed
step (or by its own rollback / release); every committed step's output equals the fp64 stack.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from support.cache import CFG, MAX_LEN, SLOTS, assert_same, make_cache, make_layers, state, visible
from support.common import make_layer, naive_mla, randn

OPS = 150
BAD = [
    lambda c: c.plan(1, [SLOTS]),
    lambda c: c.plan(1, [0, 0]),
    lambda c: c.plan(10**6, [0]),
    lambda c: c.plan(1, [0], mode="fast"),
    lambda c: c.plan(1, [0], profile="x"),
    lambda c: c.plan(1, [0], bucket="no"),
    lambda c: c.plan(1, [0], seq_len=10**9),
    lambda c: c.plan(1, batch=10**9),
    lambda c: c.release(SLOTS),
    lambda c: c.commit(object()),
]
INTERRUPTS = ["none", "refused", "raise", "release-in", "rollback-in", "release-out", "rollback-out"]
INTERRUPTS += ["duplicate", "early-commit"]


class Abandoned(Exception):
    """The step's plan was discarded: nothing of it is committed."""


class Driver:
    def __init__(self, kind: str, seed: int):
        self.cache, self.layers = make_cache(kind), make_layers()
        self.twin = make_layer(CFG, seed=99)  # another module built with layer_idx 0
        self.rng, self.seed = random.Random(seed), seed
        self.hidden = [[] for _ in range(SLOTS)]  # layer-0 inputs [D] of each committed token
        self.seen = [[visible(self.cache, s, i) for i in range(2)] for s in range(SLOTS)]
        self.counts = {}

    def randn(self, *shape):
        self.seed += 1
        return randn(*shape, seed=self.seed)

    # ------------------------------------------------------------ the oracle's side
    def check(self) -> None:
        cache = self.cache
        assert cache.lengths.tolist() == [len(h) for h in self.hidden]
        for s in range(SLOTS):
            for i in range(2):
                got, want = visible(cache, s, i), self.seen[s][i]
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"slot {s} layer {i}"
        if hasattr(cache, "blocks"):
            cache.blocks.check()

    def committed(self, slots, counts, h, out) -> None:
        for b, (s, n) in enumerate(zip(slots, counts, strict=True)):
            x = torch.stack(self.hidden[s] + list(h[b, :n]))[None].double()
            for layer in self.layers:
                x = naive_mla(layer, x)
            want, got = x[0, -n:], out[b, :n].double()
            err = (got - want).abs().max() / want.abs().max()
            assert err < 1e-4, f"slot {s}: output off the fp64 stack by {err:.2e}"
            self.hidden[s] += list(h[b, :n])
            old = self.seen[s]
            self.seen[s] = [visible(self.cache, s, i) for i in range(2)]
            for (c0, k0), (c1, k1) in zip(old, self.seen[s], strict=True):
                assert torch.equal(c1[: len(c0)], c0) and torch.equal(k1[: len(k0)], k0)

    def dropped(self, slot: int, keep: int) -> None:
        self.hidden[slot] = self.hidden[slot][:keep]
        self.seen[slot] = [(c[:keep], k[:keep]) for c, k in self.seen[slot]]

    # ------------------------------------------------------------ operations
    def run(self, ops: int = OPS) -> None:
        for _ in range(ops):
            op = self.rng.choice(["step"] * 6 + ["release", "rollback"])
            self.counts[op] = self.counts.get(op, 0) + 1
            if op == "step":
                self.step()
            elif op == "release":
                slot = self.rng.randrange(SLOTS)
                self.cache.release(slot)
                self.dropped(slot, 0)
            else:
                slot = self.rng.randrange(SLOTS)
                keep = self.rng.randrange(len(self.hidden[slot]) + 1)
                self.cache.lengths[slot] = keep
                self.dropped(slot, keep)
            self.check()

    def step(self) -> None:
        room = [s for s in range(SLOTS) if len(self.hidden[s]) < MAX_LEN]
        if not room:
            return
        slots = self.rng.sample(room, self.rng.randint(1, len(room)))
        counts = [self.rng.randint(1, min(3, MAX_LEN - len(self.hidden[s]))) for s in slots]
        width = max(counts)
        h = self.randn(len(slots), width, CFG.hidden_size)
        for b, n in enumerate(counts):
            h[b, n:] = float("nan")  # padding: never read
        kind = self.rng.choice(INTERRUPTS)
        at = self.rng.randrange(3)  # before layer 0, before layer 1, or before the commit
        self.counts[kind] = self.counts.get(kind, 0) + 1
        plan, run_on = self.plans(slots, counts, width)
        try:
            x = h
            for i, layer in enumerate(self.layers):
                if i == at:
                    x = self.interrupt(kind, plan, run_on, slots, i, x)
                x = self.retry(layer, x, run_on, kind == "raise" and i == at)
            if at == 2:
                self.interrupt(kind, plan, run_on, slots, 2, x)
        except Abandoned:
            return
        self.cache.commit(plan)
        self.committed(slots, counts, h, x)

    def plans(self, slots, counts, width):
        """The step's plan, and the plan the layers run: itself, or (one step in five) a plan captured
        earlier and refilled by copy_from, after a copy_from from a plan of other facts was refused."""
        cache = self.cache
        if self.rng.random() < 0.8:
            plan = cache.plan(counts, slots, seq_len=width)
            return plan, plan
        static = cache.plan(counts, slots, seq_len=width)
        other = cache.plan(counts, slots, seq_len=width + 1)
        before = state(cache)
        with pytest.raises(ValueError, match="differ in shape"):
            static.copy_from(other)
        assert_same(cache, before, "a refused copy_from")
        plan = cache.plan(counts, slots, seq_len=width)
        static.copy_from(plan)
        return plan, static

    def retry(self, layer, x, plan, fail: bool):
        """The layer's call; `fail`: it raises first (before or after its write), then it is retried."""
        if fail:
            name = self.rng.choice(["kv_a_proj_with_mqa", "o_proj"])
            module = getattr(layer, name)
            module.forward = lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))
            try:
                with pytest.raises(RuntimeError, match="injected"):
                    layer(x, plan)
            finally:
                del module.forward
            if self.rng.random() < 0.3:
                self.cache.discard(plan)
                raise Abandoned
        return layer(x, plan)

    def interrupt(self, kind, plan, run_on, slots, i, x):
        cache = self.cache
        outside = [s for s in range(SLOTS) if s not in slots]
        if kind == "refused":
            before = state(cache)
            with pytest.raises(ValueError):
                self.rng.choice(BAD)(cache)
            assert_same(cache, before, "a refused call")
            assert plan.state == "open"
        elif kind in ("release-in", "rollback-in"):
            slot = self.rng.choice(slots)
            keep = 0 if kind == "release-in" else self.rng.randrange(len(self.hidden[slot]) + 1)
            if kind == "release-in":
                cache.release(slot)
            elif keep == len(self.hidden[slot]):
                return x  # nothing to roll back
            else:
                cache.lengths[slot] = keep
            self.dropped(slot, keep)
            before = state(cache)
            if i < 2:
                with pytest.raises(ValueError, match="stale"):
                    self.layers[i](x, run_on)
            with pytest.raises(ValueError, match="stale"):
                cache.commit(plan)
            assert_same(cache, before, "a stale plan")
            cache.discard(plan)
            raise Abandoned
        elif kind in ("release-out", "rollback-out") and outside:
            slot = self.rng.choice(outside)
            keep = 0 if kind == "release-out" else self.rng.randrange(len(self.hidden[slot]) + 1)
            cache.release(slot) if kind == "release-out" else cache.lengths.__setitem__(slot, keep)
            self.dropped(slot, keep)
        elif kind == "duplicate" and i < 2:
            if i == 0:
                self.twin(x, run_on)  # layer_idx 0 in another module: it runs first, layer 1 never runs
            else:
                before = state(cache)
                with pytest.raises(ValueError, match="already ran this step in another module"):
                    self.twin(x, run_on)
                assert_same(cache, before, "a second module with layer_idx 0")
            with pytest.raises(ValueError, match="did not write this step"):
                cache.commit(plan)
            cache.discard(plan)
            raise Abandoned
        elif kind == "early-commit" and i < 2:
            before = state(cache)
            missing = list(range(i, 2))
            with pytest.raises(ValueError, match=re.escape(f"layers {missing} did not write")):
                cache.commit(plan)
            assert_same(cache, before, "an early commit")
        return x


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_random_protocol_driver_against_the_fp64_stack(kind, seed):
    driver = Driver(kind, seed)
    with torch.no_grad():
        driver.run()
    print(f"{kind} seed {seed}: {OPS} operations, {sorted(driver.counts.items())}")
    assert driver.counts.get("step", 0) > OPS // 2

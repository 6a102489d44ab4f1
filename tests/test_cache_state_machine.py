"""A hypothesis state machine over both caches: random slots, ragged rows, modes, releases, rollbacks
of lengths and invalid calls. After every rule the cache holds exactly what a plain Python model says;
layer steps equal ops.reference over the model's context; every refusal changes no buffer."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.common import make_layer, randn, rel_error, tiny_config

from mlakit import LatentCache
from mlakit.cache.paged import PagedLatentCache
from mlakit.ops import reference

CFG = tiny_config()
SLOTS, MAX_LEN = 3, 12
LAYERS = 2

INVALID = [
    lambda c, layer: c.plan(1, [SLOTS]),
    lambda c, layer: c.plan(1, [0, 0]),
    lambda c, layer: c.plan(0, [0]),
    lambda c, layer: c.plan({1}, [0]),
    lambda c, layer: c.plan(1, "0"),
    lambda c, layer: c.plan(1, [2**70]),
    lambda c, layer: c.plan(SLOTS * MAX_LEN + 1, [0]),
    lambda c, layer: c.plan([1, 2], [0]),
    lambda c, layer: c.plan(1, [0], mode="fast"),
    lambda c, layer: c.append([[[0.0] * 20]], [[[0.0] * 4]]),
    lambda c, layer: c.release(SLOTS),
    lambda c, layer: c.commit(object()),
    lambda c, layer: layer(randn(1, 1, 41, seed=0), c),
    lambda c, layer: layer(randn(1, 1, 40, seed=0), c, new_tokens=[2]),
    lambda c, layer: layer(randn(1, 1, 40, seed=0), "cache"),
]


def assert_same(cache, before, what: str = "a refused call") -> None:
    """Every buffer bit-identical (NaN padding in the spare row compares equal to itself)."""
    for got, want in zip(cache.buffers(), before, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{what} changed the cache"


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        kind=st.sampled_from(["contiguous", "paged"]), block=st.integers(1, 4), seed=st.integers(0, 9)
    )
    def setup(self, kind, block, seed):
        if kind == "contiguous":
            self.cache = LatentCache(CFG, SLOTS, MAX_LEN, num_layers=LAYERS)
        else:
            # enough blocks for every slot to be full (out-of-blocks is tested in test_paged)
            self.cache = PagedLatentCache(
                CFG, SLOTS * -(-MAX_LEN // block), block, max_batch=SLOTS, num_layers=LAYERS
            )
            self.cache.blocks.shuffle(seed)
        self.layer = make_layer(CFG, seed=seed)
        self.layer.layer_idx = 1
        self.model = [[] for _ in range(SLOTS)]  # per slot: (latent [L], rope key [dr]) of layer 1
        self.seed = seed

    def _room(self, slot):
        return MAX_LEN - len(self.model[slot])

    def _new_seed(self):
        self.seed += 1
        return self.seed

    @rule(data=st.data())
    def write_ragged(self, data):
        free = [s for s in range(SLOTS) if self._room(s) > 0]
        if not free:
            return
        slots = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=len(free), unique=True))
        counts = [data.draw(st.integers(1, min(4, self._room(s)))) for s in slots]
        width = max(counts)
        c = randn(len(slots), width, CFG.kv_lora_rank, seed=self._new_seed())
        k = randn(len(slots), width, CFG.qk_rope_head_dim, seed=self._new_seed())
        for b, n in enumerate(counts):
            c[b, n:], k[b, n:] = float("nan"), float("nan")  # padding: never stored where it is read
        plan = self.cache.plan(counts, slots, seq_len=width)
        for layer in range(LAYERS):
            self.cache.write(plan, layer, c, k)
        self.cache.commit(plan)
        for b, (s, n) in enumerate(zip(slots, counts, strict=True)):
            self.model[s] += [(c[b, i], k[b, i]) for i in range(n)]

    @rule(data=st.data(), mode=st.sampled_from(["auto", "absorb", "materialize"]))
    def layer_step(self, data, mode):
        free = [s for s in range(SLOTS) if self._room(s) > 0]
        if not free:
            return
        slots = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=len(free), unique=True))
        counts = [data.draw(st.integers(1, min(3, self._room(s)))) for s in slots]
        h = randn(len(slots), max(counts), CFG.hidden_size, seed=self._new_seed())
        starts = [len(self.model[s]) for s in slots]
        with torch.no_grad():
            # one layer of a two-layer cache: planned, committed for the one layer that wrote
            plan = self.cache.plan(counts, slots, mode=mode, seq_len=h.shape[1])
            out = self.layer(h, plan)
            self.cache.commit(plan, layers=[1])
            positions = torch.tensor(starts)[:, None] + torch.arange(h.shape[1])
            q_nope, q_pe, c, k = self.layer.project(h, positions)
            w_uk, w_uv = self.layer.up_weights()
            stored_c, stored_k = self._stored()
            for b, (s, n) in enumerate(zip(slots, counts, strict=True)):
                # the layer projected the step's packed rows, this check the caller's rectangle: a GEMM's
                # row may round differently with the row count (MKL's fp32 on an AVX2-only EPYC), so
                # what was written is within fp32 rounding of it, and the model keeps what was written
                got_c, got_k = stored_c[s, starts[b] : starts[b] + n], stored_k[s, starts[b] : starts[b] + n]
                torch.testing.assert_close(got_c, c[b, :n], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got_k, k[b, :n], rtol=1e-5, atol=1e-5)
                self.model[s] += [(got_c[i].clone(), got_k[i].clone()) for i in range(n)]
                ctx_c = torch.stack([r[0] for r in self.model[s]])[None]
                ctx_k = torch.stack([r[1] for r in self.model[s]])[None]
                o, _ = reference(
                    q_nope[b : b + 1, :n],
                    q_pe[b : b + 1, :n],
                    ctx_c,
                    ctx_k,
                    torch.tensor([ctx_c.shape[1]]),
                    w_uk,
                    w_uv,
                    self.layer.scale,
                )
                want = self.layer.o_proj(o.reshape(1, n, -1))[0]
                assert rel_error(out[b, :n], want)[2] < 1e-5, f"slot {s}: {rel_error(out[b, :n], want)}"

    @rule(slot=st.integers(0, SLOTS - 1))
    def release(self, slot):
        self.cache.release(slot)
        self.model[slot] = []

    @rule(slot=st.integers(0, SLOTS - 1), drop=st.integers(1, 3))
    def rollback(self, slot, drop):
        keep = max(0, len(self.model[slot]) - drop)
        self.cache.lengths[slot] = keep
        self.cache.check_lengths()  # what the next call does first: the dropped tokens are gone
        self.model[slot] = self.model[slot][:keep]

    @precondition(lambda self: any(self.model))
    @rule(slot=st.integers(0, SLOTS - 1))
    def raise_length_is_refused(self, slot):
        before = [t.clone() for t in self.cache.buffers()]
        self.cache.lengths[slot] = len(self.model[slot]) + 1
        try:
            self.cache.plan(1, [slot])
        except ValueError:
            pass
        else:
            raise AssertionError("raising a length past the tokens written was accepted")
        self.cache.lengths[slot] = len(self.model[slot])
        assert_same(self.cache, before)

    @rule(which=st.integers(0, len(INVALID) - 1))
    def invalid_call(self, which):
        before = [t.clone() for t in self.cache.buffers()]
        try:
            with torch.no_grad():
                INVALID[which](self.cache, self.layer)
        except ValueError:
            pass
        else:
            raise AssertionError(f"invalid call {which} was accepted")
        assert_same(self.cache, before, f"invalid call {which}")

    def _stored(self):
        """(c_kv [slot, position, L], k_pe [slot, position, dr]) of layer 1 as the cache holds them."""
        if isinstance(self.cache, PagedLatentCache):
            return self.cache.view(torch.arange(SLOTS), MAX_LEN, layer=1)
        return self.cache.layer_view(1)

    @invariant()
    def holds_the_model(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.lengths.tolist() == [len(m) for m in self.model]
        if isinstance(self.cache, PagedLatentCache):
            self.cache.blocks.check()
        c_kv, k_pe = self._stored()
        for s, rows in enumerate(self.model):
            for i, (c, k) in enumerate(rows):
                assert torch.equal(c_kv[s, i], c) and torch.equal(k_pe[s, i], k), f"slot {s} token {i}"


CacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=15, deadline=None, suppress_health_check=list(HealthCheck)
)
test_cache_state_machine = CacheMachine.TestCase

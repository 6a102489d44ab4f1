"""The step protocol's remaining holes, on both caches: a subset commit shows no
reused row's old latents, `write_index` checks what `write` checks, `copy_from` alone credits no layer
(a replay is marked with `mark_replayed`), and a `plan()` that fails after its checks (a profile whose
`decide` raises, memory) leaves the open plan open and committable."""

from __future__ import annotations

import pytest
import torch
from support.cache import CFG, DSA, KINDS, assert_same, make_cache, make_layers, run, state, step, visible
from support.common import randn

from mlakit import LatentCache
from mlakit.cache.paged import PagedLatentCache

H = CFG.hidden_size


@pytest.mark.parametrize("kind", KINDS)
def test_a_subset_commit_zeroes_the_rows_of_the_layers_that_did_not_write(kind):
    """The reviewer's repro: a released request's page reused by a new request whose step commits
    layer 0 only must not show the old latents in layer 1 (zeros, as the contiguous cache gives)."""
    cache = make_cache(kind)
    if kind == "paged":  # one page per request, handed out again last in, first out
        cache = PagedLatentCache(CFG, 24, 4, max_batch=3, num_layers=2)
    layers = make_layers()
    with torch.no_grad():
        step(layers, cache, randn(1, 4, H, seed=1), slots=[0])
        old = cache.view(torch.tensor([0]), 4, layer=1)[0].clone()
        assert old.abs().sum() > 0
        cache.release(0)
        plan = cache.plan(4, [1])
        layers[0](randn(1, 4, H, seed=2), plan)
        cache.commit(plan, layers=[0])
    c_kv, k_pe = visible(cache, 1, 1)
    assert not torch.equal(c_kv, old)
    assert not c_kv.any() and not k_pe.any(), "layer 1 shows rows it never wrote"
    assert visible(cache, 1, 0)[0].abs().sum() > 0  # layer 0 kept what it wrote


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_commit_and_a_subset_naming_every_writer_keep_what_was_written(kind):
    cache = make_cache(kind)
    layers = make_layers()
    with torch.no_grad():
        plan = cache.plan(2, [2])
        run(layers, randn(1, 2, H, seed=3), plan)
        cache.commit(plan, layers=[1])  # layer 0 wrote too: its rows stay
    assert all(visible(cache, 2, i)[0].abs().sum() > 0 for i in range(2))


def dsa_cache(kind):
    if kind == "contiguous":
        return LatentCache(DSA, 2, 16, num_layers=2)
    return PagedLatentCache(DSA, 8, 4, max_batch=2, num_layers=2)


@pytest.mark.parametrize("kind", KINDS)
def test_write_index_names_its_bad_argument_and_changes_nothing(kind):
    cache = dsa_cache(kind)
    plan = cache.plan(2, [0, 1])
    k = torch.ones(2, 2, 8)
    before = state_of(cache)
    for args, match in [
        ((plan, 2, k), "layer 2 out of range"),
        ((plan, True, k), "layer True"),
        ((plan, 0, k[:, :1]), r"k_idx has shape \(2, 1, 8\)"),
        ((plan, 0, k[..., :4]), r"k_idx has shape \(2, 2, 4\)"),
        ((plan, 0, "k"), "k_idx has shape str"),
        ((plan, 0, k.double()), "k_idx is torch.float64"),
        (("plan", 0, k), "plan must be a StepPlan"),
        ((dsa_cache(kind).plan(2, [0, 1]), 0, k), "another cache"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.write_index(*args)
    assert_bits(cache, before)
    cache.write_index(plan, 1, k)  # a good one is taken
    cache.discard(plan)
    dense = make_cache(kind)
    with pytest.raises(ValueError, match="k_idx: this cache holds no indexer keys"):
        dense.write_index(dense.plan(1, [0]), 0, torch.ones(1, 1, 8))


@pytest.mark.parametrize("kind", KINDS)
def test_write_index_into_a_committed_plan_is_refused(kind):
    cache = dsa_cache(kind)
    plan = cache.plan(2, [0])
    for i in range(2):
        cache.write(plan, i, torch.ones(1, 2, 16), torch.ones(1, 2, 4))
        cache.write_index(plan, i, torch.ones(1, 2, 8))
    cache.commit(plan)
    before = state_of(cache)
    with pytest.raises(ValueError, match="plan is committed"):
        cache.write_index(plan, 0, torch.full((1, 2, 8), 7.0))
    assert_bits(cache, before)


def state_of(cache):
    return [t.clone() for t in cache.buffers()]


def assert_bits(cache, before):
    for got, want in zip(cache.buffers(), before, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
            "a refused write_index changed a buffer"
        )


@pytest.mark.parametrize("kind", KINDS)
def test_copy_from_alone_credits_no_layer_a_replay_is_marked(kind):
    layers = make_layers()
    cache = make_cache(kind)
    with torch.no_grad():
        step(layers, cache, randn(2, 3, H, seed=4), slots=[0, 1])
        static = cache.plan(1, [0, 1])
        run(layers, randn(2, 1, H, seed=5), static)  # the capture ran every layer
        cache.commit(static)
        with pytest.raises(ValueError, match="never refilled"):
            cache.plan(1, [2]).mark_replayed()
        plan = cache.plan(1, [0, 1])
        static.copy_from(plan)
        before = state(cache)
        with pytest.raises(ValueError, match=r"layers \[0, 1\] did not write this step"):
            cache.commit(plan)  # a refill, no layer run, no replay: no row of this step written
        assert_same(cache, before, "a commit of a refilled plan never replayed")
        # what a replay writes (the captured graph runs the layers on static's tensors), then marked
        h = randn(2, 1, H, seed=6)
        for i, layer in enumerate(layers):
            layer._compute(h, static, i)
        plan.ran.clear()  # a real replay records nothing: only mark_replayed does
        static.mark_replayed()
        assert plan.ran == {0, 1}
        cache.commit(plan)
        with pytest.raises(ValueError, match="plan is committed"):
            static.mark_replayed()
    assert cache.lengths.tolist() == [5, 5, 0]


class Raising:
    """A profile whose `decide` raises something other than a ValueError."""

    def decide(self, *args, **kwargs):
        raise RuntimeError("profile broke")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", ["profile", "memory"])
def test_a_plan_that_fails_after_its_checks_leaves_the_open_plan_open(kind, fault, monkeypatch):
    layers = make_layers()
    a, b = make_cache(kind), make_cache(kind)
    h = randn(2, 3, H, seed=7)
    with torch.no_grad():
        for c in (a, b):
            step(layers, c, randn(3, 2, H, seed=8))
        plans = [c.plan(3, [0, 1]) for c in (a, b)]
        for p in plans:
            layers[0](h, p)
        a.lengths[2] = 1  # a dropped token of another slot: settled (rows given back) by the next plan
        b.lengths[2] = 1
        before = state(a)
        if fault == "memory":
            import mlakit.cache.step as step_mod

            def no_memory(*args, **kwargs):
                raise MemoryError("no room")

            monkeypatch.setattr(step_mod, "make_plan", no_memory)
            with pytest.raises(MemoryError):
                a.plan([4, 2], [0, 2])  # slot 0 again: the open plan's rows would be reused
            monkeypatch.undo()
        else:
            with pytest.raises(RuntimeError, match="profile broke"):
                a.plan(1, [2], profile=Raising())
        assert_same(a, before, f"a failed plan ({fault})")
        assert plans[0].state == "open" and a._open is plans[0]
        for c, p in zip((a, b), plans, strict=True):
            layers[1](layers[0](h, p), p)
            c.commit(p)
        got, want = (step(layers, c, randn(3, 1, H, seed=9)) for c in (a, b))
    assert torch.equal(got, want)
    assert a.lengths.tolist() == b.lengths.tolist() == [6, 6, 2]
    for s in range(3):
        for i in range(2):
            assert all(torch.equal(x, y) for x, y in zip(visible(a, s, i), visible(b, s, i), strict=True))
    if kind == "paged":
        a.blocks.check()
        assert a.blocks.free == b.blocks.free

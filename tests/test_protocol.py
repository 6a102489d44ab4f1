"""The step protocol (plan -> every layer -> commit) under misuse, on both caches:
each is refused with a ValueError that says why, the cache is bit-identical afterwards, and the next
good step is exact (equal, bit for bit, to a twin cache that never saw the misuse). And its edges: a
subset commit shows no reused row's old latents, `write_index` checks what `write` checks, `copy_from`
alone credits no layer (a replay is marked with `mark_replayed`), and a `plan()` that fails after its
checks (a profile whose `decide` raises, memory) leaves the open plan open and committable."""

from __future__ import annotations

import re

import pytest
import torch
from support.cache import CFG, DSA, KINDS, assert_same, make_cache, make_layers, run, state, step, visible
from support.common import assert_close, make_layer, randn

from mlakit import LatentCache
from mlakit.cache.paged import PagedLatentCache

H = CFG.hidden_size


def twins(kind, layers, prefill: int = 5):
    """Two caches given the same prefill of every slot."""
    caches = [make_cache(kind), make_cache(kind)]
    with torch.no_grad():
        for c in caches:
            step(layers, c, randn(3, prefill, H, seed=1))
    return caches


def next_step_exact(layers, a, b, slots=(0, 1, 2), seed: int = 9) -> None:
    """One more good step on both: the same outputs and the same visible latents, bit for bit."""
    h = randn(len(slots), 2, H, seed=seed)
    with torch.no_grad():
        got, want = step(layers, a, h, slots=list(slots)), step(layers, b, h, slots=list(slots))
    assert torch.equal(got, want), "the step after a refusal differs"
    assert torch.equal(a.lengths, b.lengths)
    for s in range(3):
        for i in range(2):
            assert all(torch.equal(x, y) for x, y in zip(visible(a, s, i), visible(b, s, i), strict=True))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", ["slot", "overflow", "profile", "bucket", "seq_len", "batch"])
def test_a_refused_plan_changes_nothing_not_even_the_open_plan(kind, bad):
    layers = make_layers()
    a, b = twins(kind, layers)
    h = randn(1, 3, H, seed=2)
    calls = {
        "slot": lambda: a.plan(1, [3]),
        "overflow": lambda: a.plan(1000, [1]),
        "profile": lambda: a.plan(1, [1], profile="x"),
        "bucket": lambda: a.plan(1, [1], bucket="no"),
        "seq_len": lambda: a.plan(1, [1], seq_len=10**9),
        "batch": lambda: a.plan(1, batch=10**9),
    }
    with torch.no_grad():
        plans = [c.plan(3, [0]) for c in (a, b)]
        layers[0](h, plans[0])
        before = state(a)
        with pytest.raises(ValueError, match={"overflow": "overflows|out of blocks"}.get(bad, bad)):
            calls[bad]()
        assert_same(a, before, f"a refused plan ({bad})")
        assert plans[0].state == "open"
        layers[1](layers[0](h, plans[1]), plans[1])
        layers[1](layers[0](h, plans[0]), plans[0])  # layer 0 again: the same rows, rewritten
        for c, p in zip((a, b), plans, strict=True):
            c.commit(p)
    next_step_exact(layers, a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_release_of_a_slot_in_an_open_plan_makes_it_stale(kind):
    """A request cancelled mid-step: its slot is released; the plan can be neither used nor committed."""
    layers = make_layers()
    a, b = twins(kind, layers)
    h = randn(2, 3, H, seed=3)
    with torch.no_grad():
        plan = a.plan(3, [0, 1])
        layers[0](h, plan)
        a.release(0)
        b.release(0)
        before = state(a)
        with pytest.raises(ValueError, match="stale.*slot 0 was released"):
            layers[1](h, plan)
        with pytest.raises(ValueError, match="stale.*slot 0 was released"):
            a.commit(plan)
        assert_same(a, before, "a stale plan")
        a.discard(plan)
        assert a.lengths.tolist() == b.lengths.tolist() == [0, 5, 5]
    if kind == "paged":
        a.blocks.check()
        assert a.free_blocks == b.free_blocks
    next_step_exact(layers, a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_lowered_lengths_make_an_open_plan_stale_before_any_layer_reads_them(kind):
    layers = make_layers()
    a, b = twins(kind, layers)
    h = randn(1, 2, H, seed=4)
    with torch.no_grad():
        plan = a.plan(2, [1])
        layers[0](h, plan)
        a.lengths[1] = 3  # a rolled-back draft
        b.lengths[1] = 3
        before = state(a)
        with pytest.raises(ValueError, match=r"stale.*lengths of slots \[1\] changed.*\[5\] -> \[3\]"):
            layers[1](h, plan)
        with pytest.raises(ValueError, match="stale"):
            a.commit(plan)
        with pytest.raises(ValueError, match="stale"):
            a.write(plan, 1, torch.zeros(1, 2, 16), torch.zeros(1, 2, 4))
        assert_same(a, before, "a stale plan")
        a.discard(plan)
    next_step_exact(layers, a, b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["no-layer", "duplicate-idx", "a-layer-raised"])
def test_commit_refuses_a_step_a_layer_never_wrote(kind, how, monkeypatch):
    layers = make_layers()
    a, b = twins(kind, layers)
    h = randn(3, 1, H, seed=5)
    with torch.no_grad():
        plan = a.plan(1)
        if how == "duplicate-idx":
            twin = make_layer(CFG, seed=99)  # a second module built with layer_idx 0
            layers[0](h, plan)
            layers[0](h, plan)  # the same module again (a retry): its rows, rewritten
            with pytest.raises(ValueError, match="layer_idx 0 already ran this step in another module"):
                twin(h, plan)
        elif how == "a-layer-raised":
            monkeypatch.setattr(layers[1].kv_a_proj_with_mqa, "forward", lambda x: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                run(layers, h, plan)
            monkeypatch.undo()
        before = state(a)
        missing = "[0, 1]" if how == "no-layer" else "[1]"
        with pytest.raises(ValueError, match=re.escape(f"layers {missing} did not write this step")):
            a.commit(plan)
        assert_same(a, before, "a refused commit")
        a.commit(plan, layers=[0]) if how != "no-layer" else a.discard(plan)
        if how != "no-layer":  # layer 1's rows were never written: the caller said so, nothing else
            a.lengths -= 1
    next_step_exact(layers, a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_commit_layers_names_the_layers_a_step_writes(kind):
    cache = make_cache(kind)
    layers = make_layers()
    with torch.no_grad():
        plan = cache.plan(2, [1])
        layers[1](randn(1, 2, H, seed=6), plan)
        for bad in ([], [2], [1, 1], "1", [0.5]):
            with pytest.raises(ValueError, match="layers"):
                cache.commit(plan, layers=bad)
        with pytest.raises(ValueError, match=r"layers \[0\] did not write"):
            cache.commit(plan, layers=range(2))
        cache.commit(plan, layers=[1])
    assert cache.lengths.tolist() == [0, 2, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_copy_from_compares_slots_and_every_host_fact(kind):
    layers = make_layers()
    a, b = twins(kind, layers)
    with torch.no_grad():
        static = a.plan(1, [0, 1])
        run(layers, randn(2, 1, H, seed=7), static)
        a.commit(static)
        step(layers, b, randn(2, 1, H, seed=7), slots=[0, 1])
        for other, fact in [((1, [1, 2]), "slots"), ((1, [0, 2]), "slots"), (([1, 2], [0, 1]), "")]:
            plan = a.plan(other[0], other[1], seq_len=2 if fact == "" else None)
            before = state(a)
            with pytest.raises(ValueError, match=f"differ in shape.*{fact}"):
                static.copy_from(plan)
            assert_same(a, before, "a refused copy_from")
            a.discard(plan)
        new = a.plan(1, [0, 1])
        static.copy_from(new)
        h = randn(2, 1, H, seed=8)
        got = run(layers, h, static)  # what a replay runs: the rows and lengths of `new`
        a.commit(new)
        want = step(layers, b, h, slots=[0, 1])
        assert torch.equal(got, want)
        with pytest.raises(ValueError, match="plan is committed"):
            layers[0](h, static)
    next_step_exact(layers, a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_one_layer_call_and_append_refuse_a_cache_of_several_layers(kind):
    layers = make_layers()
    cache = make_cache(kind)
    before = state(cache)
    with pytest.raises(ValueError, match="commits after one layer.*cache.commit"):
        layers[0](randn(2, 3, H, seed=9), cache, slots=[0, 1])
    with pytest.raises(ValueError, match=r"append\(layer=1\).*cache.write\(plan, layer"):
        cache.append(torch.zeros(1, 2, 16), torch.zeros(1, 2, 4), [0], layer=1)
    assert_same(cache, before, "a refused one-layer call")


@pytest.mark.parametrize("kind", KINDS)
def test_write_names_its_bad_argument_and_changes_nothing(kind):
    cache = make_cache(kind)
    plan = cache.plan(2, [0, 1])
    c, k = torch.zeros(2, 2, 16), torch.zeros(2, 2, 4)
    before = state(cache)
    for args, match in [
        ((plan, 5, c, k), "layer 5 out of range"),
        ((plan, True, c, k), "layer True"),
        ((plan, 0, c[:, :1], k), r"c_kv has shape \(2, 1, 16\)"),
        ((plan, 0, c, k[..., :3]), "k_pe has shape"),
        ((plan, 0, c.double(), k), "c_kv is torch.float64"),
        ((plan, 0, "c", k), "c_kv has shape str"),
        (("plan", 0, c, k), "plan must be a StepPlan"),
        ((make_cache(kind).plan(2, [0, 1]), 0, c, k), "another cache"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.write(*args)
    assert_same(cache, before, "a refused write")
    assert plan.ran == set()


@pytest.mark.parametrize("kind", KINDS)
def test_a_scalar_new_tokens_means_one_count_for_every_row_in_both_calls(kind):
    layer = make_layer(CFG, seed=3)
    caches = [make_cache(kind, layers=1) for _ in range(3)]
    x = randn(2, 4, H, seed=10)
    with torch.no_grad():
        one = layer(x, caches[0], new_tokens=3)
        per_row = layer(x, caches[1], new_tokens=[3, 3])
        plan = caches[2].plan(3, seq_len=4, batch=2)
        planned = layer(x, plan)
        caches[2].commit(plan)
    assert torch.equal(one, per_row)
    assert_close("one-layer call vs planned (a key bucket)", one, planned, rtol=1e-6)
    assert caches[0].lengths.tolist() == [3, 3, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_discard_gives_back_the_rows_and_refuses_a_committed_plan(kind):
    layers = make_layers()
    cache = make_cache(kind)
    before = state(cache)
    with torch.no_grad():
        plan = cache.plan(5, [0, 2])
        run(layers, randn(2, 5, H, seed=11), plan)
        cache.discard(plan)
        assert cache.lengths.tolist() == [0, 0, 0]
        if kind == "paged":
            assert cache.blocks.tokens == [0, 0, 0] and cache.free_blocks == 24
        else:
            assert cache.written == [0, 0, 0]
        with pytest.raises(ValueError, match="plan is discarded"):
            cache.discard(plan)
        plan = cache.plan(1, [1])
        run(layers, randn(1, 1, H, seed=12), plan)
        cache.commit(plan)
        with pytest.raises(ValueError, match="plan is committed"):
            cache.discard(plan)
    assert before[0].shape == state(cache)[0].shape


@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_made_under_inference_mode_still_sees_lowered_lengths(kind):
    """Inference tensors keep no version counter: the plan then reads the lengths in full."""
    layers = make_layers()
    with torch.inference_mode():
        cache = make_cache(kind)
        step(layers, cache, randn(3, 4, H, seed=13))
        plan = cache.plan(1, [0, 1])
        layers[0](randn(2, 1, H, seed=14), plan)
        cache.lengths[1] = 2
        with pytest.raises(ValueError, match=r"stale.*lengths of slots \[1\]"):
            layers[1](randn(2, 1, H, seed=14), plan)
        cache.discard(plan)
        step(layers, cache, randn(1, 1, H, seed=15), slots=[1])
    assert cache.lengths.tolist() == [4, 3, 4]


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

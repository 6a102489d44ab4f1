"""V4Cache's step protocol (plan -> every layer -> commit), the MLA caches' bookkeeping
(mlakit.cache.protocol): commit refuses a step a layer did not write, stale and superseded plans are
refused on use, every refusal leaves every buffer and the host bookkeeping bit-identical, and a plan
given up uncommitted puts back the ring rows its layers overwrote. After each misuse the next good step
equals, bit for bit, a twin cache that never saw it."""

from __future__ import annotations

import re

import pytest
import torch
from support.v4 import assert_v4_same, hf_config, pair, v4_state

from mlakit.v4 import V4Attention, V4Cache

# window 8, CSA every 4, HCA every 16: layers 0 (window), 1 (CSA + indexer), 2 (HCA)
CFG = hf_config()
SLOTS, MAX_LEN, PREFILL = 3, 64, 20


@pytest.fixture(scope="module")
def layers():
    return [pair(CFG, i, seed=i)[1] for i in range(3)]


def make(layers, max_rollback=0, prefill=PREFILL) -> V4Cache:
    cache = V4Cache(layers[0].cfg, SLOTS, MAX_LEN, num_layers=3, max_rollback=max_rollback)
    if prefill:
        step(layers, cache, torch.randn(SLOTS, prefill, 32, generator=torch.Generator().manual_seed(1)))
    return cache


def run(layers, h, plan):
    with torch.no_grad():
        return torch.stack([layer(h, plan) for layer in layers])


def step(layers, cache, h, slots=None):
    plan = cache.plan(h.shape[1], slots)
    out = run(layers, h, plan)
    cache.commit(plan)
    return out


def same_caches(a, b) -> None:
    assert_v4_same(a, v4_state(b), "the misuse")


def next_step_exact(layers, a, b, seed=9) -> None:
    """One more good step of 3 tokens on every slot of both: equal outputs and equal caches."""
    h = torch.randn(SLOTS, 3, 32, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(step(layers, a, h), step(layers, b, h)), "the step after the misuse differs"
    same_caches(a, b)


def test_discard_puts_back_every_row_the_layers_overwrote(layers):
    """A 7-token step over 20 cached tokens overwrites window rows (ring of 8) and carried compressor
    rows that length 20 still reads: discarding it restores them (and everything else) bit for bit."""
    a, b = make(layers), make(layers)
    before = v4_state(a)
    plan = a.plan(7)
    run(layers, torch.randn(SLOTS, 7, 32), plan)
    assert not all(torch.equal(x, y) for x, y in zip(v4_state(a)[:-1], before[:-1], strict=True))
    a.discard(plan)
    assert_v4_same(a, before, "a discarded step")
    for use in (
        lambda: a.commit(plan),
        lambda: a.discard(plan),
        lambda: run(layers[:1], torch.randn(3, 7, 32), plan),
    ):
        with pytest.raises(ValueError, match="plan is discarded"):
            use()
    next_step_exact(layers, a, b)


@pytest.mark.parametrize("how", ["no-layer", "one-layer", "a-layer-raised", "duplicate-idx"])
def test_commit_refuses_a_step_a_layer_never_wrote(layers, how, monkeypatch):
    a, b = make(layers), make(layers)
    h = torch.randn(SLOTS, 2, 32)
    plan = a.plan(2)
    if how == "one-layer":
        run(layers[:1], h, plan)
    elif how == "a-layer-raised":
        # the CSA layer raises after its window and compressor writes, before the indexer's
        monkeypatch.setattr(layers[1].compressor.indexer, "update", lambda *a: 1 / 0)
        run(layers[:1], h, plan)
        with pytest.raises(ZeroDivisionError):
            run(layers[1:2], h, plan)
        monkeypatch.undo()
    elif how == "duplicate-idx":
        run(layers[:1], h, plan)
        run(layers[:1], h, plan)  # the same module again (a retry): its rows, rewritten
        twin = V4Attention(layers[0].cfg, layer_idx=0)
        owners = dict(plan.owners)
        with pytest.raises(ValueError, match="layer_idx 0 already ran this step in another module"):
            run([twin], h, plan)
        assert plan.owners == owners
    before = v4_state(a)
    missing = {"no-layer": "[0, 1, 2]"}.get(how, "[1, 2]")
    with pytest.raises(ValueError, match=re.escape(f"layers {missing} did not write this step")):
        a.commit(plan)
    assert_v4_same(a, before, "a refused commit")
    assert plan.state == "open"
    run(layers[1:] if how != "no-layer" else layers, h, plan)  # a retry of the layer that raised
    a.commit(plan)
    run(layers, h, b.plan(2))
    b.commit(b._open)
    next_step_exact(layers, a, b)


def test_a_layer_that_raised_then_discard_puts_everything_back(layers, monkeypatch):
    """The rows are saved before the layer's first write and not again on its retry."""
    a, b = make(layers), make(layers)
    before = v4_state(a)
    h = torch.randn(SLOTS, 6, 32)
    plan = a.plan(6)
    monkeypatch.setattr(layers[1].compressor.indexer, "update", lambda *a: 1 / 0)
    for _ in range(2):
        with pytest.raises(ZeroDivisionError):
            run(layers, h, plan)
    monkeypatch.undo()
    a.discard(plan)
    assert_v4_same(a, before, "a failed step, discarded")
    next_step_exact(layers, a, b)


def test_commit_layers_names_the_layers_a_step_writes(layers):
    cache = make(layers, prefill=0)
    step(layers, cache, torch.randn(2, 10, 32), slots=[1, 2])
    plan = cache.plan(2, [1])
    run(layers[1:2], torch.randn(1, 2, 32), plan)
    before = v4_state(cache)
    for bad in ([], [3], [1, 1], "1", [0.5]):
        with pytest.raises(ValueError, match="layers"):
            cache.commit(plan, layers=bad)
    with pytest.raises(ValueError, match=r"layers \[0, 2\] did not write"):
        cache.commit(plan, layers=range(3))
    assert_v4_same(cache, before, "a refused commit")
    csa = [t.clone() for t in cache.state[1].values()]
    cache.commit(plan, layers=[1])
    assert cache.lengths.tolist() == [0, 12, 10]
    # slot 1's positions 10 and 11 in the layers that did not write read as zeros: the window ring
    # (8 rows a slot) and the HCA compressor's carried kv and gates (16 rows a slot); layer 1 keeps its
    window, hca = cache.state[0]["window"], cache.state[2]
    assert window[[8 + 2, 8 + 3]].abs().sum() == 0 and window[8:10].abs().sum() > 0
    for name in ("ring_kv", "ring_gate"):
        assert hca[name][[16 + 10, 16 + 11]].abs().sum() == 0 and hca[name][16:26].abs().sum() > 0
    assert all(torch.equal(x, y) for x, y in zip(cache.state[1].values(), csa, strict=True))


def test_commit_layers_of_a_cache_of_some_layers():
    layer = pair(CFG, 1)[1]
    cache = V4Cache(layer.cfg, 1, 16, num_layers=3, layers=[1])
    plan = cache.plan(2)
    with torch.no_grad():
        layer(torch.randn(1, 2, 32), plan)
    with pytest.raises(
        ValueError, match=r"layers \[0\] must be distinct layer indices of the layers this cache holds \[1\]"
    ):
        cache.commit(plan, layers=[0])
    cache.commit(plan, layers=[1])
    assert cache.lengths.tolist() == [2]


def test_release_of_a_slot_in_an_open_plan_makes_it_stale(layers):
    """A request cancelled mid-step: the plan can be neither used nor committed; the rows its first
    layer overwrote in the other slot are back at once."""
    a, b = make(layers), make(layers)
    h = torch.randn(2, 3, 32)
    plan = a.plan(3, [0, 1])
    run(layers[:1], h, plan)
    a.release(0)
    b.release(0)
    before = v4_state(a)
    same_caches(a, b)
    with pytest.raises(ValueError, match="stale.*slot 0 was released"):
        run(layers[1:2], h, plan)
    with pytest.raises(ValueError, match="stale.*slot 0 was released"):
        a.commit(plan)
    assert_v4_same(a, before, "a stale plan")
    a.discard(plan)
    assert a.lengths.tolist() == b.lengths.tolist() == [0, PREFILL, PREFILL]
    next_step_exact(layers, a, b)


@pytest.mark.parametrize("how", ["in-place", "rollback"])
def test_lowered_lengths_make_an_open_plan_stale(layers, how):
    a, b = make(layers), make(layers)
    h = torch.randn(1, 3, 32)
    plan = a.plan(3, [1])
    run(layers[:2], h, plan)
    if how == "in-place":
        a.lengths[1] = PREFILL - 1  # one token can always be rolled back exactly
    else:
        a.rollback(1, PREFILL - 1)
    b.rollback(1, PREFILL - 1)
    before = v4_state(a)
    with pytest.raises(ValueError, match=r"stale.*lengths of slots \[1\] changed"):
        run(layers[2:], h, plan)
    with pytest.raises(ValueError, match="stale"):
        a.commit(plan)
    assert_v4_same(a, before, "a stale plan")
    a.discard(plan)
    same_caches(a, b)
    next_step_exact(layers, a, b)


def test_a_newer_plan_supersedes_the_open_one(layers):
    a, b = make(layers), make(layers)
    h = torch.randn(1, 5, 32)
    old = a.plan(5, [0])
    run(layers[:2], h, old)
    new = a.plan(5, [0])  # its rows are put back before the new plan is made
    for use in (lambda: run(layers[2:], h, old), lambda: a.commit(old), lambda: a.discard(old)):
        with pytest.raises(ValueError, match="plan is superseded"):
            use()
    run(layers, h, new)
    a.commit(new)
    step(layers, b, h, slots=[0])
    same_caches(a, b)
    next_step_exact(layers, a, b)


@pytest.mark.parametrize("bad", ["slot", "overflow", "counts", "raised", "inexact", "seq_len"])
def test_a_refused_plan_changes_nothing_not_even_the_open_plan(layers, bad):
    a, b = make(layers), make(layers)
    h = torch.randn(1, 3, 32)
    calls = {
        "slot": (lambda: a.plan(1, [3]), "slots"),
        "overflow": (lambda: a.plan(MAX_LEN, [1]), "overflow"),
        "counts": (lambda: a.plan([1, 0], [1, 2]), "new_tokens"),
        "raised": (lambda: a.lengths.__setitem__(2, PREFILL + 1) or a.plan(1, [1]), "can only be lowered"),
        "inexact": (
            lambda: a.lengths.__setitem__(2, PREFILL - 5) or a.plan(1, [1]),
            "nearest allowed length",
        ),
        "seq_len": (lambda: a.plan(2, [1], seq_len=1), "seq_len|outside"),
    }
    plans = [c.plan(3, [0]) for c in (a, b)]
    run(layers[:1], h, plans[0])
    call, match = calls[bad]
    before = v4_state(a)
    with pytest.raises(ValueError, match=match):
        call()
    a.lengths[2] = PREFILL
    assert_v4_same(a, before, f"a refused plan ({bad})")
    assert plans[0].state == "open"
    run(layers, h, plans[1])
    run(layers, h, plans[0])  # layer 0 again: the same rows, rewritten
    for c, p in zip((a, b), plans, strict=True):
        c.commit(p)
    next_step_exact(layers, a, b)


def test_lengths_never_go_back_up_past_a_newer_step(layers):
    """After a rollback and a new step, the rings past it hold the old branch: raising lengths over
    them is refused (it used to pass: only the high-water mark was checked)."""
    cache = make(layers, max_rollback=2)
    cache.rollback(0, PREFILL - 2)
    step(layers, cache, torch.randn(1, 1, 32), slots=[0])
    before = v4_state(cache)
    cache.lengths[0] = PREFILL
    with pytest.raises(ValueError, match="lengths can only be lowered"):
        cache.plan(1, [0])
    cache.lengths[0] = PREFILL - 1
    assert_v4_same(cache, before, "a refused plan")


def test_a_plan_of_another_cache_or_kind_is_refused(layers):
    a, b = make(layers, prefill=0), make(layers, prefill=0)
    plan = b.plan(1)
    before = v4_state(a)
    for call in (a.commit, a.discard):
        with pytest.raises(ValueError, match="another cache"):
            call(plan)
        with pytest.raises(ValueError, match="V4Plan"):
            call(object())
    assert_v4_same(a, before, "a refused plan")


def test_one_layer_call_on_a_cache_of_several_layers_is_refused(layers):
    cache = make(layers)
    before = v4_state(cache)
    with pytest.raises(ValueError, match="cache of 3 layers"), torch.no_grad():
        layers[0](torch.randn(SLOTS, 1, 32), cache)
    assert_v4_same(cache, before, "a refused one-layer call")
    assert cache._open is None


def test_grow_and_reorder_refuse_an_uncommitted_plan(layers):
    cache = make(layers)
    plan = cache.plan(1)
    run(layers[:1], torch.randn(SLOTS, 1, 32), plan)
    before = v4_state(cache)
    with pytest.raises(ValueError, match="plan is open; commit or discard it before growing"):
        cache.grow(128)
    with pytest.raises(ValueError, match="plan is open; commit or discard it before reordering"):
        cache.reorder([0, 1, 2])
    assert_v4_same(cache, before, "a refused call")

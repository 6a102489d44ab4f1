"""V4Cache: ragged prefill, then 300+ single-token steps crossing the window, ratio-4 and ratio-128
boundaries, against transformers' DeepseekV4Attention with its own cache (eager, fp32); CSA selections
equal; chunked prefill; rollback where exact; every refusal before any change."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_close
from support.v4 import HFRunner, hf_config, pair

from mlakit.v4 import V4Cache

# window 8, CSA every 4, HCA every 16: 300 steps cross each boundary many times
CFG = hf_config()


def _selected(out, row):
    """The entries a query selected, as a set, from either indexer's output."""
    if isinstance(out, tuple):
        idx, valid = out
        if idx is None:
            return set(torch.nonzero(valid[row, -1]).flatten().tolist())
        return set(idx[row, -1][valid[row, -1]].tolist())
    return {i for i in out[0, -1].tolist() if i >= 0}


def test_decode_300_steps_ragged_matches_transformers():
    torch.manual_seed(0)
    pairs = [pair(CFG, layer, seed=layer) for layer in range(3)]
    prompts = [torch.randn(1, 21, 32), torch.randn(1, 6, 32)]
    runners = [[HFRunner(CFG, ref) for _ in prompts] for ref, _ in pairs]
    ours_sel = []
    pairs[1][1].compressor.indexer.register_forward_hook(lambda m, a, out: ours_sel.append(out))
    cache = V4Cache(pairs[0][1].cfg, 2, 400, num_layers=3)
    h = torch.zeros(2, 21, 32)
    h[0], h[1, :6] = prompts[0][0], prompts[1][0]
    worst, selections = 0.0, 0
    plan = cache.plan([21, 6])
    for layer, (_, ours) in enumerate(pairs):
        with torch.no_grad():
            got = ours(h, plan)
        for r, p in enumerate(prompts):
            want = runners[layer][r].step(p)
            worst = max(worst, assert_close(f"prefill L{layer} r{r}", got[r, : p.shape[1]], want[0], 2e-6))
    cache.commit(plan)
    for step in range(300):
        x = torch.randn(2, 1, 32)
        plan = cache.plan(1)
        for layer, (_, ours) in enumerate(pairs):
            with torch.no_grad():
                got = ours(x, plan)
            for r in range(2):
                want = runners[layer][r].step(x[r : r + 1])
                err = (got[r] - want[0]).abs().max() / want.abs().max()
                assert err < 5e-6, f"step {step} layer {layer} row {r}: relative error {err:.3e}"
                worst = max(worst, float(err))
                if layer == 1:  # the hook of the shared transformers module saw this row last
                    theirs = runners[1][r].selections[-1]
                    assert _selected(ours_sel[-1], r) == _selected(theirs, 0), f"step {step} row {r}"
                    selections += 1
        cache.commit(plan)
    assert cache.lengths.tolist() == [321, 306]
    print(f"worst relative error {worst:.2e} over 300 steps, {selections} CSA selections equal")


@pytest.mark.parametrize(
    "chunks", [[13, 11], [4, 1, 16, 3], [17, 16, 1]], ids=lambda c: "-".join(map(str, c))
)
def test_chunked_prefill_matches_transformers(chunks):
    torch.manual_seed(1)
    pairs = [pair(CFG, layer) for layer in range(3)]
    cache = V4Cache(pairs[0][1].cfg, 1, 64, num_layers=3)
    runners = [HFRunner(CFG, ref) for ref, _ in pairs]
    for n in chunks:
        x = torch.randn(1, n, 32)
        plan = cache.plan(n)
        for layer, (_, ours) in enumerate(pairs):
            with torch.no_grad():
                got = ours(x, plan)
            assert_close(f"chunk {n} layer {layer}", got, runners[layer].step(x), 2e-6)
        cache.commit(plan)


def _run(cache, layers, xs):
    outs = []
    for x in xs:
        plan = cache.plan(x.shape[1])
        with torch.no_grad():
            outs.append(torch.stack([layer(x, plan) for layer in layers]))
        cache.commit(plan)
    return outs


def _snapshot(cache):
    return cache.lengths.clone(), {k: {n: t.clone() for n, t in st.items()} for k, st in cache.state.items()}


def _same(cache, snap):
    lengths, state = snap
    assert torch.equal(cache.lengths, lengths)
    for k, st in cache.state.items():
        for n, t in st.items():
            assert torch.equal(t, state[k][n]), f"layer {k} {n} changed"


def test_rollback_where_exact_replays_exactly():
    torch.manual_seed(2)
    layers = [pair(CFG, layer)[1] for layer in range(3)]
    cache = V4Cache(layers[0].cfg, 1, 128, num_layers=3, max_rollback=6)
    _run(cache, layers, [torch.randn(1, 30, 32)])
    tail = [torch.randn(1, 1, 32) for _ in range(5)]
    first = _run(cache, layers, tail)
    cache.rollback(0, 30)  # 5 drafts rejected
    again = _run(cache, layers, tail)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    cache.lengths[0] = 31  # lowering in place is checked at the next plan, as for the latent caches
    assert len(_run(cache, layers, tail[1:2])) == 1


def test_rollback_refused_names_the_nearest_length():
    torch.manual_seed(3)
    layers = [pair(CFG, layer)[1] for layer in range(3)]
    cache = V4Cache(layers[0].cfg, 1, 128, num_layers=3)
    _run(cache, layers, [torch.randn(1, 40, 32)])
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match=r"nearest allowed length is 39"):
        cache.rollback(0, 38)  # the window ring (8 rows) no longer holds position 31
    _same(cache, snap)
    cache.rollback(0, 0)  # always exact: nothing is read at length 0
    assert cache.lengths.tolist() == [0]


def test_refusals_change_nothing():
    torch.manual_seed(4)
    layers = [pair(CFG, layer)[1] for layer in range(3)]
    cache = V4Cache(layers[0].cfg, 2, 32, num_layers=3)
    _run(cache, layers, [torch.randn(2, 20, 32)])
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="overflow"):
        cache.plan(13)
    with pytest.raises(ValueError, match="slots"):
        cache.plan(1, slots=[2])
    with pytest.raises(ValueError, match="new_tokens"):
        cache.plan([1, 0])
    plan = cache.plan([2, 1])
    with pytest.raises(ValueError, match="dtype|float64"):
        layers[1](torch.randn(2, 2, 32, dtype=torch.float64), plan)
    with pytest.raises(ValueError, match="rows x tokens"):
        layers[1](torch.randn(2, 3, 32), plan)
    with pytest.raises(ValueError, match="length must be"):
        cache.rollback(0, 21)
    cache.discard(plan)
    with pytest.raises(ValueError, match="discarded"):
        layers[0](torch.randn(2, 2, 32), plan)
    cache.lengths[1] = 25
    with pytest.raises(ValueError, match="lengths can only be lowered"):
        cache.plan(1)
    cache.lengths[1] = 20
    _same(cache, snap)


def test_release_then_reuse_equals_a_fresh_slot():
    torch.manual_seed(5)
    layers = [pair(CFG, layer)[1] for layer in range(3)]
    cache = V4Cache(layers[0].cfg, 2, 64, num_layers=3)
    _run(cache, layers, [torch.randn(2, 37, 32)])
    cache.release(1)
    x = torch.randn(1, 21, 32)
    plan = cache.plan(21, slots=[1])
    with torch.no_grad():
        got = torch.stack([layer(x, plan) for layer in layers])
    cache.commit(plan)
    with torch.no_grad():
        want = torch.stack([layer(x) for layer in layers])
    assert torch.equal(got, want)
    assert cache.lengths.tolist() == [37, 21]


def test_no_host_reads_inside_a_planned_layer_call(monkeypatch):
    """The plan decided everything: a layer call reads no tensor value back to the host."""
    torch.manual_seed(6)
    layers = [pair(CFG, layer)[1] for layer in range(3)]
    cache = V4Cache(layers[0].cfg, 2, 64, num_layers=3)
    _run(cache, layers, [torch.randn(2, 30, 32)])
    plan = cache.plan([1, 3])
    x = torch.randn(2, 3, 32)

    def refuse(*args, **kwargs):
        raise AssertionError("a host read inside a planned layer call")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    with torch.no_grad():
        for layer in layers:
            layer(x, plan)
    monkeypatch.undo()
    cache.commit(plan)


def test_grow_keeps_every_entry():
    torch.manual_seed(7)
    layers = [pair(CFG, layer)[1] for layer in range(3)]
    small, big = (V4Cache(layers[0].cfg, 2, n, num_layers=3) for n in (40, 120))
    first = torch.randn(2, 37, 32)
    _run(small, layers, [first])
    _run(big, layers, [first])
    small.grow(120)
    tail = [torch.randn(2, 1, 32) for _ in range(40)]
    for a, b in zip(_run(small, layers, tail), _run(big, layers, tail), strict=True):
        assert torch.equal(a, b)


def test_one_layer_call_with_a_cache():
    """layer(hidden, cache, slots=, new_tokens=) is plan, layer, commit; a refusal changes nothing."""
    torch.manual_seed(8)
    layer = pair(CFG, 1)[1]
    cache = V4Cache(layer.cfg, 3, 64, num_layers=2, layers=[1])
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        got = layer(x, cache, slots=[2, 0], new_tokens=[9, 4])
        assert cache.lengths.tolist() == [4, 0, 9]
        assert_close("slot 2", got[0], layer(x[:1])[0], 1e-6)
        assert_close("slot 0", got[1, :4], layer(x[1:, :4])[0], 1e-6)
        snap = _snapshot(cache)
        with pytest.raises(ValueError, match="width 31"):
            layer(torch.randn(2, 9, 31), cache)
        with pytest.raises(ValueError, match="overflow"):
            layer(torch.randn(1, 61, 32), cache, slots=[2])
    _same(cache, snap)

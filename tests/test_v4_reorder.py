"""V4Cache.reorder and the patched DeepSeek-V4 following transformers' batch edits: a reordered cache
continues as one built in the new order; patched beam search (num_beams=3) returns what unpatched does;
a bad index is refused before anything changes."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_close
from support.v4 import hf_config

import mlakit.hf as mhf
from mlakit.v4 import V4Attention, V4Cache, V4Config

transformers = pytest.importorskip("transformers")
CFG = hf_config()


def _layers(cfg):
    torch.manual_seed(0)
    layers = [V4Attention(cfg, layer_idx=i) for i in range(cfg.num_layers)]
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                p.copy_(0.2 * torch.randn_like(p))
    return layers


def _step(layers, cache, h):
    plan = cache.plan(h.shape[1])
    for layer in layers:
        h = h + layer(h, plan)
    cache.commit(plan)
    return h


def test_reorder_continues_as_the_cache_built_in_that_order():
    """40 prompt tokens (window, CSA and HCA entries all filled), reorder [2, 0, 0, 1], 20 steps: equal
    to feeding the rows in that order from the start."""
    cfg = V4Config.from_hf(CFG)
    layers = _layers(cfg)
    torch.manual_seed(1)
    prompt, steps = torch.randn(3, 40, 32), torch.randn(4, 20, 32)
    index = [2, 0, 0, 1]
    got_cache, want_cache = V4Cache(cfg, 3, 128), V4Cache(cfg, 4, 128)
    with torch.no_grad():
        _step(layers, got_cache, prompt)
        _step(layers, want_cache, prompt[index])
        got_cache.reorder(torch.tensor(index))
        assert got_cache.batch_size == 4 and got_cache.lengths.tolist() == [40] * 4
        assert got_cache.high == want_cache.high
        for t in range(20):
            got = _step(layers, got_cache, steps[:, t : t + 1])
            want = _step(layers, want_cache, steps[:, t : t + 1])
            assert_close(f"step {t}", got, want, 1e-6)


@pytest.mark.parametrize("index", [[0, 3], [-1], [], [[0, 1]], [0.0, 1.0], [True, False, True], "01"])
def test_reorder_refuses_a_bad_index_before_any_change(index):
    cfg = V4Config.from_hf(CFG)
    cache = V4Cache(cfg, 3, 64)
    with torch.no_grad():
        _step(_layers(cfg), cache, torch.randn(3, 10, 32))
    before = {(k, n): t.clone() for k, st in cache.state.items() for n, t in st.items()}
    with pytest.raises(ValueError, match="index"):
        cache.reorder(index)
    assert cache.batch_size == 3 and cache.lengths.tolist() == [10] * 3
    assert all(torch.equal(cache.state[k][n], t) for (k, n), t in before.items())


def _model():
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf_config(initializer_range=0.2)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("position_bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
    return model


def test_patched_beam_search_matches_unpatched():
    model = _model()
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (1, 70))
    kw = dict(max_new_tokens=24, num_beams=3, do_sample=False, output_scores=True)
    kw.update(return_dict_in_generate=True)
    want = model.generate(ids, **kw)
    mhf.patch(model)
    got = model.generate(ids, **kw)
    mhf.unpatch(model)
    assert torch.equal(got.sequences, want.sequences)
    assert_close("sequences_scores", got.sequences_scores, want.sequences_scores, 1e-5)


def test_patched_reorder_cache_matches_unpatched():
    """cache.reorder_cache on a batch of 2 (equal lengths), then one step: logits as unpatched. Then
    batch_select_indices (transformers' own V4 cache layers do not select their compressor state, so
    the reference is the kept row run whole, unpatched)."""
    model = _model()
    torch.manual_seed(2)
    ids, nxt = torch.randint(0, 64, (2, 40)), torch.randint(0, 64, (2, 1))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        cache.reorder_cache(torch.tensor([1, 0]))
        want = model(nxt, cache=cache, use_cache=True).logits
        whole = torch.cat([ids[:1], nxt[1:], nxt[1:]], dim=1)  # slot 1 holds row 0 after [1, 0]
        want_kept = model(whole, use_cache=False).logits[:, -1:]
        mhf.patch(model)
        cache = model(ids, use_cache=True).past_key_values
        cache.reorder_cache(torch.tensor([1, 0]))
        got = model(nxt, cache=cache, use_cache=True).logits
        with pytest.raises(ValueError, match="index"):  # refused before any layer changes
            cache.reorder_cache(torch.tensor([0, 5]))
        cache.batch_select_indices(torch.tensor([1]))
        got_kept = model(nxt[1:], cache=cache, use_cache=True).logits
    mhf.unpatch(model)
    assert_close("reordered", got, want, 1e-5)
    assert_close("selected", got_kept, want_kept, 1e-5)


def test_patched_batch_repeat_interleave_matches_whole_runs():
    """One prompt cached, repeated into 2 rows, each row its own next token: each as its whole run."""
    model = _model()
    torch.manual_seed(3)
    ids, nxt = torch.randint(0, 64, (1, 37)), torch.randint(0, 64, (2, 1))
    with torch.no_grad():
        want = [model(torch.cat([ids, nxt[i : i + 1]], 1), use_cache=False).logits[:, -1:] for i in (0, 1)]
        mhf.patch(model)
        cache = model(ids, use_cache=True).past_key_values
        cache.batch_repeat_interleave(2)
        got = model(nxt, cache=cache, use_cache=True).logits
    mhf.unpatch(model)
    assert_close("repeated", got, torch.cat(want), 1e-5)


def test_reorder_refuses_while_a_plan_is_open():
    cache = V4Cache(V4Config.from_hf(CFG), 2, 64)
    cache.plan(3)
    with pytest.raises(ValueError, match="plan is open"):
        cache.reorder([1, 0])

"""What a patched model used to refuse and now serves, for every patched family (DSA included), against
the unpatched model: `output_attentions=True` (transformers' eager weights, prefill and a cached
decode step) and custom 4-D masks (bidirectional, a speculation tree, packed sequences)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_families import SUPPORTED_IDS, assert_close, one_thread, prompts, tiny_model  # noqa: E402, F401

import mlakit.hf as mhf  # noqa: E402

WIDTH = 12  # past index_topk 8 of the DSA families: their selection is live


def pair(name: str, attn: str):
    return tiny_model(name, attn=attn), mhf.patch(tiny_model(name, attn=attn))


def step(model, ids, mask, **kw):
    """Prefill with a cache, then one decode step: both outputs."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(ids, attention_mask=mask, cache=cache, use_cache=True, **kw)
        token = first.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        second = model(token, attention_mask=mask, cache=cache, use_cache=True, **kw)
    return first, second


@pytest.mark.parametrize("name", SUPPORTED_IDS)
def test_output_attentions_are_transformers_eager_weights(name):
    want_model, got_model = pair(name, "eager")
    ids, mask = prompts(seed=3, lengths=(WIDTH, 7, WIDTH - 1))
    want = step(want_model, ids, mask, output_attentions=True)
    got = step(got_model, ids, mask, output_attentions=True)
    for phase, w, g in zip(("prefill", "decode"), want, got, strict=True):
        assert len(g.attentions) == len(w.attentions) > 0, f"{phase}: layers recorded"
        for i, (a, b) in enumerate(zip(g.attentions, w.attentions, strict=True)):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{phase} layer {i}: {a.shape} vs {b.shape}"
            assert_close(f"{name} {phase} weights {i}", a, b)
        assert_close(f"{name} {phase} logits", g.logits, w.logits)


def test_output_attentions_under_sdpa_are_none_as_in_transformers():
    want_model, got_model = pair("deepseek-v3", "sdpa")
    ids, mask = prompts(seed=3)
    with torch.no_grad():
        want = want_model(ids, attention_mask=mask, output_attentions=True)
        got = got_model(ids, attention_mask=mask, output_attentions=True)
    assert got.attentions == want.attentions == ()
    assert_close("logits", got.logits, want.logits)


def custom_masks(n: int) -> dict[str, dict]:
    """Keyword arguments of a forward over n tokens in one row: 4-D masks and packed positions."""
    tree = torch.ones(n, n, dtype=torch.bool).tril()
    tree[n - 1, n - 2] = tree[n - 2, n - 3] = False  # speculated siblings do not see each other
    additive = torch.zeros(n, n).masked_fill(~tree, torch.finfo(torch.float32).min)
    half = n // 2
    return {
        "bidirectional-bool": dict(attention_mask=torch.ones(1, 1, n, n, dtype=torch.bool)),
        "tree-bool": dict(attention_mask=tree[None, None]),
        "tree-additive": dict(attention_mask=additive[None, None]),
        "packed": dict(position_ids=torch.tensor([list(range(half)) + list(range(n - half))])),
    }


@pytest.mark.parametrize("case", list(custom_masks(4)))
@pytest.mark.parametrize("name", SUPPORTED_IDS)
def test_custom_4d_masks_and_packed_sequences(name, case):
    want_model, got_model = pair(name, "sdpa")
    ids = torch.randint(4, 90, (1, WIDTH), generator=torch.Generator().manual_seed(5))
    kw = custom_masks(WIDTH)[case]
    with torch.no_grad():
        try:
            want = want_model(ids, use_cache=False, **kw).logits
        except Exception as err:  # noqa: BLE001 - a hybrid's linear attention may refuse it itself
            pytest.skip(f"the unpatched {name} refuses {case}: {type(err).__name__}")
        got = got_model(ids, use_cache=False, **kw).logits
    assert_close(f"{name} {case}", got, want)


def test_eager_additive_tree_mask():
    """Under eager transformers adds the mask to the scores: an additive mask is served the same."""
    want_model, got_model = pair("deepseek-v32", "eager")
    ids = torch.randint(4, 90, (1, WIDTH), generator=torch.Generator().manual_seed(6))
    kw = custom_masks(WIDTH)["tree-additive"]
    with torch.no_grad():
        assert_close("tree", got_model(ids, use_cache=False, **kw).logits, want_model(ids, **kw).logits)

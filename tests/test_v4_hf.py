"""mlakit.hf.patch serves DeepseekV4Attention: a patched tiny DeepseekV4ForCausalLM (random weights)
generates the same greedy tokens as unpatched, with transformers' own cache objects."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_close
from support.v4 import hf_config

import mlakit.hf as mhf
from mlakit.hf.v4 import PatchedV4Attention

transformers = pytest.importorskip("transformers")


def _model(seed=0):
    cfg = hf_config(initializer_range=0.2)
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("position_bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
    return model


def _generate(model, ids):
    return model.generate(
        ids, max_new_tokens=64, do_sample=False, output_logits=True, return_dict_in_generate=True
    )


def test_patched_greedy_tokens_identical():
    """3 prompts of 300+ tokens (compressed entries exist in every compressed layer), one at a time
    (transformers' compressors pool left padding into the first entries), 64 new tokens each."""
    model = _model()
    torch.manual_seed(1)
    prompts = [torch.randint(0, 64, (1, n)) for n in (300, 331, 357)]
    want = [_generate(model, p) for p in prompts]
    mhf.patch(model)
    assert mhf.is_patched(model)
    assert all(isinstance(layer.self_attn, PatchedV4Attention) for layer in model.model.layers)
    for p, w in zip(prompts, want, strict=True):
        got = _generate(model, p)
        assert torch.equal(got.sequences, w.sequences)
        assert_close("logits", torch.stack(got.logits), torch.stack(w.logits), 1e-5)
        assert isinstance(got.past_key_values, transformers.DynamicCache)
    mhf.unpatch(model)
    assert not mhf.is_patched(model)
    assert torch.equal(_generate(model, prompts[0]).sequences, want[0].sequences)


def test_patch_shares_weights_and_forward_without_cache():
    model = _model(seed=2)
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        mhf.patch(model)
        got = model(ids, use_cache=False).logits
    assert_close("no-cache logits", got, want, 1e-5)
    attn = model.model.layers[1].self_attn
    assert attn.v4.q_a_proj.weight is attn.original.q_a_proj.weight
    assert "DeepseekV4Attention" in mhf.SUPPORTED and "DeepseekV4ForCausalLM" in mhf.SUPPORTED_MODELS


def test_equal_rows_batch_and_padding_refused():
    model = _model(seed=3)
    torch.manual_seed(4)
    ids = torch.randint(0, 64, (2, 40))
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    mhf.patch(model)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), want)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    with pytest.raises(ValueError, match="padded rows"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)

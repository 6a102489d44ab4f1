"""mlakit.hf.patch/unpatch against unpatched transformers models (the oracle), tiny and random, fp32."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.common import HF_MOE, HF_TINY  # noqa: E402

import mlakit.hf as mhf  # noqa: E402
from mlakit.hf.attention import PatchedMLAAttention, key_padding  # noqa: E402

PAD = 3
NEW_TOKENS = 24
TINY = HF_TINY
MOE = HF_MOE
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# name → (config class, model class, config overrides); every MoE family gets at least one MoE layer
MODELS = {
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(MOE, n_group=1, topk_group=1, first_k_dense_replace=1),
    ),
    "deepseek-v3-yarn-halfsplit": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            MOE, n_group=1, topk_group=1, first_k_dense_replace=1, rope_interleave=False, rope_parameters=YARN
        ),
    ),
    "deepseek-v2-lite": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(MOE, q_lora_rank=None, first_k_dense_replace=1),
    ),
    "glm4-moe-lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(MOE, n_group=1, topk_group=1)),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(scale_emb=1.0)),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine: extra threads only spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(name: str, seed: int = 0, attn: str = "sdpa", base: bool = False):
    """A random fp32 model whose greedy choices are far from ties (sharpened head, random pad row)."""
    config_cls, model_cls, extra = MODELS[name]
    kwargs = dict(TINY, **extra)
    if "MiniCPM3" in config_cls:
        kwargs.pop("eos_token_id")
    config = getattr(transformers, config_cls)(**kwargs)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    cls = getattr(transformers, model_cls.replace("ForCausalLM", "Model") if base else model_cls)
    model = cls(config).eval()
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[PAD].normal_()  # a pad row of zeros would hide a missing padding mask
        if not base:
            model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight) * 4)
    if not base:
        model.generation_config.pad_token_id = PAD
        model.generation_config.eos_token_id = None
    return model


def prompts(seed: int = 1, lengths=(5, 9, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch of random prompts: ids [B, T] and attention_mask [B, T]."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(4, TINY["vocab_size"], (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


def assert_close(name, got, want, rel=1e-5):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    print(f"{name}: max error {err:.3g}, scale {scale:.3g}")
    assert err <= rel * max(scale, 1.0), f"{name}: max error {err:.3g} > {rel:g} x scale {scale:.3g}"


def greedy(model, ids, mask, **kw):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kw,
    )
    return out.sequences, torch.stack(out.logits)  # [B, T+N], [N, B, V]


def assert_no_ties(logits, margin=1e-3):
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).min().item()
    assert gap > margin, f"greedy choices near a tie (gap {gap:.3g}): the test model is not sharp enough"


def attention_layers(model):
    return [m for m in model.modules() if isinstance(m, PatchedMLAAttention)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_left_padded_same_tokens(name, attn):
    model = tiny_model(name, attn=attn)
    ids, mask = prompts()
    want_seq, want_logits = greedy(model, ids, mask)
    assert_no_ties(want_logits)
    mhf.patch(model)
    got_seq, got_logits = greedy(model, ids, mask)
    assert torch.equal(got_seq, want_seq)
    assert_close(f"{name}/{attn} decode logits", got_logits, want_logits)
    assert [m.last_mode for m in attention_layers(model)] == ["absorb", "absorb"]


@pytest.mark.parametrize("mode", ["auto", "absorb", "materialize"])
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_logits_match(name, mode):
    model = tiny_model(name)
    ids, mask = prompts(seed=2, lengths=(7, 3, 11))
    real = mask.bool()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        mhf.patch(model, mode=mode)
        got = model(ids, attention_mask=mask).logits
    assert_close(f"{name}/{mode} prefill logits", got[real], want[real])


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_base_model_class(name):
    model = tiny_model(name, base=True)
    ids, mask = prompts(seed=3)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
        mhf.patch(model)
        got = model(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert_close(f"{name} base hidden", got[real], want[real])


@pytest.mark.parametrize("name", ["deepseek-v3", "minicpm3"])
def test_sampling_fixed_seed(name):
    model = tiny_model(name)
    ids, mask = prompts(seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(123)
    want = model.generate(ids, **kw)
    mhf.patch(model)
    torch.manual_seed(123)
    got = model.generate(ids, **kw)
    assert torch.equal(got, want)


def two_calls(model, ids, mask, cache_from=None):
    """Generate 8 tokens, append 3 prompt tokens, generate 16 more reusing the first call's cache."""
    first = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True
    )
    cache = first.cache if cache_from is None else cache_from(ids, mask)
    extra = torch.arange(10, 13).repeat(ids.shape[0], 1)
    ids2 = torch.cat([first.sequences, extra], dim=1)
    mask2 = torch.cat([mask, torch.ones(ids.shape[0], 8 + 3, dtype=mask.dtype)], dim=1)
    return model.generate(ids2, attention_mask=mask2, cache=cache, max_new_tokens=16, do_sample=False)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "glm4-moe-lite", "minicpm3"])
def test_cache_reuse_across_calls(name):
    model = tiny_model(name)
    ids, mask = prompts(seed=5)
    want = two_calls(model, ids, mask)
    mhf.patch(model)
    got = two_calls(model, ids, mask)
    assert torch.equal(got, want)


def test_cache_interchangeable_between_patched_and_unpatched():
    """The cache holds transformers' own latent: one written unpatched serves the patched model."""
    model = tiny_model("deepseek-v3")
    ids, mask = prompts(seed=6)
    want = two_calls(model, ids, mask)
    first = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True
    )
    mhf.patch(model)
    got = two_calls(model, ids, mask, cache_from=lambda *_: first.cache)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_use_cache_false(name):
    model = tiny_model(name)
    ids, mask = prompts(seed=7)
    want_seq, want_logits = greedy(model, ids, mask, use_cache=False)
    mhf.patch(model)
    got_seq, got_logits = greedy(model, ids, mask, use_cache=False)
    assert torch.equal(got_seq, want_seq)
    assert_close(f"{name} no-cache logits", got_logits, want_logits)


def test_static_cache():
    model = tiny_model("deepseek-v3")
    ids, mask = prompts(seed=8)
    want_seq, want_logits = greedy(model, ids, mask, cache_implementation="static")
    mhf.patch(model)
    got_seq, got_logits = greedy(model, ids, mask, cache_implementation="static")
    assert torch.equal(got_seq, want_seq)
    assert_close("static cache logits", got_logits, want_logits)


def test_beam_search():
    """Beams reorder transformers' cache between steps; the latent it holds is what mlakit reads."""
    model = tiny_model("deepseek-v3")
    ids, mask = prompts(seed=11)
    kw = dict(attention_mask=mask, max_new_tokens=8, num_beams=2, do_sample=False)
    want = model.generate(ids, **kw)
    mhf.patch(model)
    assert torch.equal(model.generate(ids, **kw), want)


def test_gradients_match():
    model = tiny_model("deepseek-v3")
    ids, mask = prompts(seed=12)

    def attention_grads():
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits
        logits[mask.bool()].square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "self_attn" in n}

    want = attention_grads()
    mhf.patch(model)
    got = attention_grads()
    for name, grad in want.items():
        assert_close(f"grad {name}", got[name], grad)


def test_weights_shared_and_unpatch_restores():
    model = tiny_model("deepseek-v3")
    ids, mask = prompts(seed=9)
    originals = [layer.self_attn for layer in model.model.layers]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    mhf.patch(model)
    assert mhf.is_patched(model)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs  # same keys, no copy
    assert [id(p) for p in model.parameters()] == params
    for layer, original in zip(model.model.layers, originals, strict=True):
        assert layer.self_attn.kv_b_proj is original.kv_b_proj
    greedy(model, ids, mask)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"
    mhf.unpatch(model)
    assert not mhf.is_patched(model)
    assert [layer.self_attn for layer in model.model.layers] == originals
    with torch.no_grad():
        again = model(ids, attention_mask=mask).logits
    assert torch.equal(again, want)


def test_patch_twice_updates_mode_only():
    model = tiny_model("deepseek-v3")
    mhf.patch(model)
    layers = attention_layers(model)
    mhf.patch(model, mode="materialize")
    assert attention_layers(model) == layers
    assert {m.mode for m in layers} == {"materialize"}


def test_model_without_mla_layer_raises():
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MLA attention.*DeepseekV3ForCausalLM"):
        mhf.patch(model)
    with pytest.raises(ValueError, match="mode must be one of"):
        mhf.patch(tiny_model("deepseek-v3"), mode="fast")


def test_unsupported_features_raise_before_writing():
    model = mhf.patch(tiny_model("deepseek-v3"))
    ids, mask = prompts(seed=10)
    with torch.no_grad():

        class OtherCache(transformers.DynamicCache):
            pass

        with pytest.raises(ValueError, match="OtherCache.*not supported"):
            model(ids, attention_mask=mask, cache=OtherCache(), use_cache=True)
        cache = transformers.DynamicCache(config=model.config)
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
        batch, width = ids.shape
        wrong = torch.ones(batch, 1, 3, width + 2, dtype=torch.bool)  # one key short
        with pytest.raises(ValueError, match="attention_mask has shape"):
            model(torch.full((batch, 3), 5), attention_mask=wrong, cache=cache, use_cache=True)
        assert [layer.get_seq_length() for layer in cache.layers] == [width, width]  # nothing written
    model.config._attn_implementation = "flash_attention_2"  # set directly: no flash-attn on CPU
    with pytest.raises(ValueError, match="attention implementation 'flash_attention_2'"):
        model(ids, attention_mask=mask)


def causal(b, s, t, pad=0):
    """Bool [b,1,s,t]: queries at t-s.., keys hidden when j > position or j < pad."""
    pos = torch.arange(t - s, t)[:, None]
    keys = torch.arange(t)[None, :]
    m = (keys <= pos) & (keys >= pad)
    return m.expand(b, 1, s, t).clone()


@pytest.mark.parametrize(
    "case, mask, want",
    [
        ("none", None, None),
        ("causal-prefill", causal(2, 5, 5), None),
        ("causal-decode", causal(2, 1, 7), None),
        ("left-pad-2", causal(2, 4, 6, pad=2), torch.arange(6)[None].expand(2, 6) >= 2),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_key_padding_accepts(case, mask, want):
    b, s, t = (2, 5, 5) if mask is None else (mask.shape[0], mask.shape[2], mask.shape[3])
    got = key_padding(mask, b, s, t, t)
    assert (got is None) == (want is None)
    if want is not None:
        assert torch.equal(got, want)
    if mask is not None:  # eager's additive form gives the same answer
        additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
        again = key_padding(additive, b, s, t, t)
        assert (again is None) == (want is None)


def test_key_padding_refuses():
    sliding = causal(1, 6, 6)
    sliding[0, 0, 5, 0] = False  # a window, not padding
    with pytest.raises(ValueError, match="not a causal mask"):
        key_padding(sliding, 1, 6, 6, 6)
    with pytest.raises(ValueError, match="not a causal mask"):  # a bias other than 0 and the minimum
        key_padding(torch.full((1, 1, 2, 2), -1.0), 1, 2, 2, 2)
    with pytest.raises(ValueError, match=r"expected \(1, 1, 2, 3\)"):
        key_padding(causal(1, 2, 2), 1, 2, 3, 3)

"""mlakit.hf.patch on transformers' DSA models (DeepseekV32, GlmMoeDsa): greedy generation token-identical
to unpatched with prompts longer than index_topk, left padding, GLM's shared-indexer layers, the
indexer cache kept as transformers keeps it, and a static cache."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.common import HF_MOE, HF_TINY  # noqa: E402

import mlakit.hf as mhf  # noqa: E402
from mlakit.hf.dsa import PatchedDSAAttention  # noqa: E402

PAD = 3
TINY = dict(
    HF_TINY,
    **HF_MOE,
    num_hidden_layers=3,
    index_n_heads=8,
    index_head_dim=16,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
)
MODELS = {
    "v32-k8": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(index_topk=8)),
    "v32-k16": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(index_topk=16)),
    "glm5-k8": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(index_topk=8)),
    "glm5-k12-shared": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(index_topk=12, index_topk_pattern="FSF"),
    ),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(name: str, seed: int = 0):
    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[PAD].normal_()
        model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight) * 4)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def prompts(lengths, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(4, TINY["vocab_size"], (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


def greedy(model, ids, mask, new_tokens=12, **kw):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kw,
    )
    return out.sequences, torch.stack(out.logits), out.cache


def patched_layers(model):
    return [m for m in model.modules() if isinstance(m, PatchedDSAAttention)]


@pytest.mark.parametrize("lengths", [(21,), (23, 17)], ids=["B1-T21", "B2-left-padded"])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_same_tokens_past_index_topk(name, lengths):
    model = tiny_model(name)
    ids, mask = prompts(lengths)
    want, want_logits, want_cache = greedy(model, ids, mask)
    mhf.patch(model)
    layers = patched_layers(model)
    assert len(layers) == TINY["num_hidden_layers"]
    got, got_logits, got_cache = greedy(model, ids, mask)
    assert torch.equal(got, want), f"tokens differ:\n{got}\n{want}"
    err = (got_logits - want_logits).abs().max().item()
    assert err <= 1e-4 * want_logits.abs().max().item(), f"logits differ by {err:.3g}"
    assert {m.last_mode for m in layers} == {"sparse-absorb"}  # decode past k
    real = torch.cat([mask, torch.ones(mask.shape[0], got.shape[1] - mask.shape[1] - 1)], 1).bool()
    for i, (a, b) in enumerate(zip(got_cache.layers, want_cache.layers, strict=True)):
        if b.indexer_keys is not None:
            # their cache, written by our layer (padding rows hold whatever a padding query computed)
            assert a.indexer_keys.shape == b.indexer_keys.shape, f"indexer cache {i}"
            err = (a.indexer_keys - b.indexer_keys)[real].abs().max().item()
            assert err <= 1e-4 * b.indexer_keys.abs().max().item(), f"indexer cache {i} differs by {err:.3g}"


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("mode", ["auto", "absorb", "materialize"])
@pytest.mark.parametrize("name", ["v32-k8", "glm5-k12-shared"])
def test_prefill_longer_than_k_on_every_path(name, mode, use_cache):
    from mlakit.cost import choose_sparse

    model = tiny_model(name)
    ids, mask = prompts((30,))
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=use_cache).logits
        mhf.patch(model, mode=mode)
        got = model(ids, attention_mask=mask, use_cache=use_cache).logits
    layers = patched_layers(model)
    expected = choose_sparse(layers[0].cfg, 30, 0) if mode == "auto" else f"sparse-{mode}"
    assert {m.last_mode for m in layers} == {expected}
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), f"{mode}: logits differ by {err:.3g}"


def test_short_prompt_is_dense_and_unpatch_restores():
    model = tiny_model("glm5-k8")
    ids, mask = prompts((5,))
    want, _, _ = greedy(model, ids, mask, new_tokens=2)
    mhf.patch(model)
    got, _, _ = greedy(model, ids, mask, new_tokens=2)
    assert torch.equal(got, want)
    assert {m.last_mode for m in patched_layers(model)} == {"absorb"}  # 6 <= k: dense
    mhf.unpatch(model)
    assert not mhf.is_patched(model)


def test_static_cache():
    model = tiny_model("v32-k8")
    ids, mask = prompts((19,))
    want, _, _ = greedy(model, ids, mask, new_tokens=6, cache_implementation="static")
    mhf.patch(model)
    got, _, _ = greedy(model, ids, mask, new_tokens=6, cache_implementation="static")
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["v32-k8", "glm5-k8"])
def test_load_attention_reads_the_indexer(tmp_path, name):
    from mlakit.hf import load_attention

    model = tiny_model(name)
    model.save_pretrained(tmp_path / "ckpt")
    layer = load_attention(tmp_path / "ckpt", 1)
    want = model.model.layers[1].self_attn.state_dict()
    got = layer.state_dict()
    assert sorted(got) == sorted(want) and any(k.startswith("indexer.") for k in got)
    for key, value in want.items():
        assert torch.equal(got[key].to(value.dtype), value), key
    assert layer.indexer.weights_proj.weight.dtype == torch.float32
    assert layer.cfg.index_topk == model.config.index_topk


def test_load_attention_refuses_a_misshapen_indexer_weight(tmp_path):
    from safetensors.torch import load_file, save_file

    from mlakit.hf import load_attention

    model = tiny_model("v32-k8")
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder, max_shard_size="1GB")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.indexer.wk.weight"
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="indexer.wk.weight"):
        load_attention(folder, 1)

"""Every MLA family of transformers: patched against unpatched (the oracle), or refused by name.

Tiny random fp32 models built from each family's own config class (MoE and hybrid parts shrunk);
`FAMILIES` in mlakit/hf/families.py is the table under test, `TINY` says how to build each one.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import re
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from support.common import HF_MOE, HF_TINY  # noqa: E402

import mlakit.hf as mhf  # noqa: E402
from mlakit.attention import MLAAttention  # noqa: E402
from mlakit.config import MLAConfig  # noqa: E402
from mlakit.hf.attention import PatchedMLAAttention  # noqa: E402
from mlakit.hf.families import DSA_REASON, FAMILIES  # noqa: E402

PAD, VOCAB, NEW_TOKENS = 3, 97, 24
BASE = dict(HF_TINY, vocab_size=VOCAB)
MOE = HF_MOE
HYBRID = dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])
MISTRAL4_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,  # positions past 16 get the Llama-4 query scale
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
    "partial_rotary_factor": 0.5,
}

LONGCAT = dict(
    num_layers=1,  # one decoder layer holds two MLA sublayers
    ffn_hidden_size=48,
    expert_ffn_hidden_size=16,
    n_routed_experts=4,
    zero_expert_num=2,
    moe_topk=2,
    head_dim=8,
)
KIMI = dict(MOE, **HYBRID, q_lora_rank=None, num_local_experts=4, linear_head_dim=8, linear_num_heads=4)
BAILING = dict(MOE, **HYBRID, n_group=1, topk_group=1, first_k_dense_replace=1, num_local_experts=4)
BAILING.update(head_dim=8, layer_group_size=2, num_mtp_layers=0)
MISTRAL4 = dict(MOE, first_k_dense_replace=1, max_position_embeddings=64, rope_parameters=MISTRAL4_YARN)
V3_MOE = dict(MOE, n_group=1, topk_group=1, first_k_dense_replace=1)
DSA = dict(
    V3_MOE, index_topk=8, index_head_dim=16, index_n_heads=8
)  # top-8 of up to 33 keys; 8 heads: few exact ties

# id → (attention class, config class, causal-LM class, overrides of BASE, MLA layers in the model)
TINY = {
    "deepseek-v2-lite": ("DeepseekV2Attention", "DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(MOE, q_lora_rank=None, first_k_dense_replace=1), 2),
    "deepseek-v3": ("DeepseekV3Attention", "DeepseekV3Config", "DeepseekV3ForCausalLM", V3_MOE, 2),
    "glm4-moe-lite": ("Glm4MoeLiteAttention", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
                      dict(MOE, n_group=1, topk_group=1), 2),
    "minicpm3": ("MiniCPM3Attention", "MiniCPM3Config", "MiniCPM3ForCausalLM", dict(scale_emb=1.0), 2),
    "youtu": ("YoutuAttention", "YoutuConfig", "YoutuForCausalLM", {}, 2),
    "axk1": ("AXK1Attention", "AXK1Config", "AXK1ForCausalLM",
             dict(MOE, n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"]), 2),
    "mistral4": ("Mistral4Attention", "Mistral4Config", "Mistral4ForCausalLM", MISTRAL4, 2),
    "longcat-flash": ("LongcatFlashMLA", "LongcatFlashConfig", "LongcatFlashForCausalLM", LONGCAT, 2),
    "kimi-linear": ("KimiLinearAttention", "KimiLinearConfig", "KimiLinearForCausalLM", KIMI, 1),
    "bailing-hybrid": ("BailingHybridAttention", "BailingHybridConfig", "BailingHybridForCausalLM",
                       BAILING, 1),
    # DSA: refused until mlakit/hf/dsa.py flips their FAMILIES entry; then the whole table runs on them
    "deepseek-v32": ("DeepseekV32Attention", "DeepseekV32Config", "DeepseekV32ForCausalLM", DSA, 2),
    "glm-moe-dsa": ("GlmMoeDsaAttention", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                    dict(DSA, indexer_types=["full", "shared"]), 2),
}  # fmt: skip
SUPPORTED_IDS = [k for k, v in TINY.items() if FAMILIES[v[0]].refused is None]
REFUSED_TINY_IDS = [k for k, v in TINY.items() if FAMILIES[v[0]].refused is not None]
# the families whose table entry carries an extra: the patched model must be wrong without it
EXTRAS = {
    "mistral4": dict(query_position_scale=False),
    "longcat-flash": dict(q_scale=None, kv_scale=None),
    "bailing-hybrid": dict(head_gate=None),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine: extra threads only spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(name: str, attn: str = "sdpa"):
    _, config_cls, _, extra, _ = TINY[name]
    config = getattr(transformers, config_cls)(**dict(BASE, **extra))
    config._attn_implementation = attn
    return config


def tiny_model(name: str, seed: int = 0, attn: str = "sdpa"):
    """A random fp32 model whose greedy choices are far from ties (sharpened head, random pad row)."""
    config = tiny_config(name, attn)
    torch.manual_seed(seed)
    model = getattr(transformers, TINY[name][2])(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[PAD].normal_()  # a zero pad row would hide a missing mask
        model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight) * 4)
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
        ids[row, width - n :] = torch.randint(4, VOCAB, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


def assert_close(name, got, want, rel=1e-5):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    print(f"{name}: max error {err:.3g}, scale {scale:.3g}")
    assert err <= rel * max(scale, 1.0), f"{name}: max error {err:.3g} > {rel:g} x scale {scale:.3g}"


def greedy(model, ids, mask, new=NEW_TOKENS, **kw):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kw,
    )
    return out.sequences, torch.stack(out.logits)  # [B, T+N], [N, B, V]


def patched_layers(model):
    return [m for m in model.modules() if isinstance(m, PatchedMLAAttention)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", SUPPORTED_IDS)
def test_greedy_left_padded_same_tokens(name, attn):
    model = tiny_model(name, attn=attn)
    cls = TINY[name][0]
    others = [m for m in model.modules() if "Attention" in type(m).__name__ and type(m).__name__ != cls]
    ids, mask = prompts()
    want_seq, want_logits = greedy(model, ids, mask)
    top2 = want_logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, (
        "greedy choices near a tie: the test model is not sharp"
    )
    mhf.patch(model)
    got_seq, got_logits = greedy(model, ids, mask)
    assert torch.equal(got_seq, want_seq)
    assert_close(f"{name}/{attn} decode logits", got_logits, want_logits)
    layers = patched_layers(model)
    assert len(layers) == TINY[name][4]
    assert {type(m.original).__name__ for m in layers} == {TINY[name][0]}
    # a DSA family's decode steps see more than index_topk keys: sparse absorb
    assert {m.last_mode for m in layers} <= {"absorb", "sparse-absorb"}
    assert not [m for m in model.modules() if type(m).__name__ == cls]
    # a hybrid's other attention layers (linear, delta) are left alone
    kept = [
        m
        for m in model.modules()
        if "Attention" in type(m).__name__ and not isinstance(m, PatchedMLAAttention)
    ]
    assert kept == others


@pytest.mark.parametrize("name", list(EXTRAS))
def test_family_extras_are_needed(name):
    """Patching without the family's extra (its scale, gate or NoPE) gives other logits: the table
    entry is what makes the test above pass."""
    model = tiny_model(name)
    ids, mask = prompts(seed=2, lengths=(7, 3, 21))  # past Mistral 4's original 16 positions
    real = mask.bool()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        mhf.patch(model)
        assert_close(f"{name} with its extra", model(ids, attention_mask=mask).logits[real], want[real])
        for layer in patched_layers(model):
            layer.family = dataclasses.replace(layer.family, **EXTRAS[name])
        got = model(ids, attention_mask=mask).logits
    err = (got[real] - want[real]).abs().max().item()
    assert err > 1e-3 * want.abs().max().item(), f"{name}: logits unchanged without {EXTRAS[name]}"


@pytest.mark.parametrize("name", SUPPORTED_IDS)
def test_state_dict_loads_into_mla_attention(name):
    config = tiny_config(name)
    cfg = MLAConfig.from_hf(config)
    model = tiny_model(name)
    attn = next(m for m in model.modules() if type(m).__name__ == TINY[name][0])
    gate = FAMILIES[TINY[name][0]].head_gate
    state = {k: v for k, v in attn.state_dict().items() if gate is None or not k.startswith(gate + ".")}
    assert len(state) == len(attn.state_dict()) - (gate is not None)
    layer = MLAAttention(cfg)
    layer.load_state_dict(state, strict=True)
    assert (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim) == (4, 16, 8, 12)
    assert cfg.q_lora_rank == config.q_lora_rank
    assert cfg.num_layers == TINY[name][4]  # the MLA layers: what the latent cache holds


def _refused_module(class_name: str) -> nn.Module:
    """A refused attention built on the meta device from its config class's defaults (never run)."""
    entry = FAMILIES[class_name]
    config_module = importlib.import_module(entry.modeling_module.replace("modeling_", "configuration_"))
    config = getattr(config_module, entry.config)()
    with torch.device("meta"):
        return getattr(importlib.import_module(entry.modeling_module), class_name)(config, layer_idx=0)


REFUSED_IDS = sorted(mhf.REFUSED)


@pytest.mark.parametrize("class_name", REFUSED_IDS)
def test_refused_family_raises_naming_class_and_reason(class_name):
    holder = nn.ModuleDict({"self_attn": _refused_module(class_name)})
    reason = mhf.REFUSED[class_name]
    with pytest.raises(ValueError, match=re.escape(f"{class_name}: {reason}")):
        mhf.patch(holder)
    with pytest.raises(ValueError, match=re.escape(class_name)):  # nothing left to patch
        mhf.patch(holder, strict=False)
    assert not mhf.is_patched(holder)


def test_every_supported_family_has_a_tiny_model():
    # DeepSeek-V4 is served too but is not MLA: tests/test_v4_hf.py
    assert {TINY[k][0] for k in SUPPORTED_IDS} == set(mhf.SUPPORTED) - {"DeepseekV4Attention"}


@pytest.mark.parametrize("name", REFUSED_TINY_IDS)
def test_refused_tiny_model_raises_and_stays_unpatched(name):
    model = tiny_model(name)
    ids, mask = prompts()
    want, _ = greedy(model, ids, mask, new=4)
    with pytest.raises(ValueError, match=re.escape(f"{TINY[name][0]}: {FAMILIES[TINY[name][0]].refused}")):
        mhf.patch(model)
    assert not mhf.is_patched(model)
    assert torch.equal(greedy(model, ids, mask, new=4)[0], want)


def test_dsa_families_refused_in_one_place():
    dsa = {name for name, f in FAMILIES.items() if f.refused and f.refused.startswith(DSA_REASON)}
    assert {"HYV4Attention", "Glm5NextTextAttention", "AXK2Attention"} <= dsa
    # the two DSA-only families mlakit.hf.dsa serves
    assert {"DeepseekV32Attention", "GlmMoeDsaAttention"} <= set(mhf.SUPPORTED)


def test_strict_false_patches_the_rest_with_a_warning():
    model = tiny_model("deepseek-v3")
    model.model.extra = _refused_module("HYV4Attention")  # a refused layer beside two supported ones
    with pytest.raises(ValueError, match="HYV4Attention: DSA indexer.*strict=False"):
        mhf.patch(model)
    assert not mhf.is_patched(model)  # a refusal changes nothing
    with pytest.warns(UserWarning, match=r"HYV4Attention: DSA.*\(1 layers: model\.extra\)"):
        mhf.patch(model, strict=False)
    assert len(patched_layers(model)) == 2
    assert type(model.model.extra).__name__ == "HYV4Attention"


def test_unknown_mla_class_is_refused_by_name():
    class NewLatentAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.kv_a_proj_with_mqa = nn.Linear(8, 12)

    with pytest.raises(
        ValueError, match="NewLatentAttention: an MLA attention .* not in mlakit's family table"
    ):
        mhf.patch(nn.Sequential(NewLatentAttention()))


def _mla_classes_in_transformers() -> dict[str, str]:
    """Class name → module of every class in transformers.models whose source builds a
    `kv_a_proj_with_mqa` submodule or reads `kv_lora_rank` (only files that mention either are imported)."""
    import inspect

    root = os.path.dirname(transformers.models.__file__)
    found = {}
    for info in pkgutil.iter_modules([root]):
        folder = os.path.join(root, info.name)
        for file in sorted(os.listdir(folder)) if info.ispkg else []:
            if not (file.startswith("modeling_") and file.endswith(".py")):
                continue
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                text = f.read()
            if "kv_a_proj_with_mqa" not in text and "kv_lora_rank" not in text:
                continue
            module = importlib.import_module(f"transformers.models.{info.name}.{file[:-3]}")
            for name, cls in vars(module).items():
                if not (
                    isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == module.__name__
                ):
                    continue
                source = inspect.getsource(cls.__init__) if "__init__" in vars(cls) else ""
                if "self.kv_a_proj_with_mqa" in source or ("kv_lora_rank" in source and "Attention" in name):
                    found[name] = module.__name__
    return found


def test_discovery_every_mla_attention_is_supported_or_refused():
    found = _mla_classes_in_transformers()
    assert "DeepseekV3Attention" in found and "LongcatFlashMLA" in found  # the walk sees them
    unknown = sorted(set(found) - set(mhf.SUPPORTED) - set(mhf.REFUSED))
    assert not unknown, f"MLA attention classes neither supported nor refused by mlakit.hf: {unknown}"
    for name, module in found.items():
        assert FAMILIES[name].modeling_module == module, name
    assert set(mhf.SUPPORTED).isdisjoint(mhf.REFUSED)


def test_config_classes_with_kv_lora_rank_are_read():
    """Every config class of the table (and the aliases that load as DeepSeek-V3) reads with from_hf,
    or raises a ValueError that names what it cannot represent."""
    for name, entry in FAMILIES.items():
        module = importlib.import_module(entry.modeling_module.replace("modeling_", "configuration_"))
        config = getattr(module, entry.config)()
        try:
            cfg = MLAConfig.from_hf(config)
        except ValueError as e:
            assert name in (
                "Dots3NoteTextAttention",
                "Glm5NextTextAttention",
                "MistralLarge4TextAttention",
            ), f"{name}: {e}"
            continue
        assert cfg.kv_lora_rank == config.kv_lora_rank, name
    assert MLAConfig.from_hf(transformers.SarvamMLAConfig()).rope_interleave is True


PRESET_SOURCES = {
    "youtu-llm-2b": ("youtu", "YoutuConfig"),
    "ax-k1": ("axk1", "AXK1Config"),
    "mistral-small-4": ("mistral4", "Mistral4Config"),
    "longcat-flash": ("longcat_flash", "LongcatFlashConfig"),
    "kimi-linear-48b": ("kimi_linear", "KimiLinearConfig"),
    "ling-3-flash": ("bailing_hybrid", "BailingHybridConfig"),
    "hy4-preview": ("hy_v4", "HYV4Config"),
    "ax-k2": ("axk2", "AXK2Config"),
    "mistral-large-4": ("mistral_large4", "MistralLarge4TextConfig"),
}


@pytest.mark.parametrize("preset", list(PRESET_SOURCES))
def test_family_presets_are_the_config_class_defaults(preset):
    folder, config_cls = PRESET_SOURCES[preset]
    module = importlib.import_module(f"transformers.models.{folder}.configuration_{folder}")
    if preset == "mistral-large-4":
        # its indexer has no q_lora latent to read from: from_hf refuses it, the preset holds dense widths
        with pytest.raises(ValueError, match="q_lora_rank"):
            MLAConfig.from_hf(getattr(module, config_cls)())
        return
    want = MLAConfig.from_hf(getattr(module, config_cls)())
    got = MLAConfig.preset(preset)
    fields = [f for f in got.to_dict() if f not in ("name", "max_position_embeddings")]
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}


# what transformers' own generation tests exercise, per supported family, patched against unpatched
def same_generate(name, build_kwargs, seed=4, lengths=(5, 9, 2)):
    model = tiny_model(name)
    ids, mask = prompts(seed=seed, lengths=lengths)
    kw = build_kwargs(model)
    try:
        torch.manual_seed(123)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=12, **kw)
    except (ValueError, NotImplementedError, TypeError, AttributeError) as e:
        pytest.skip(f"unpatched {name} does not support it: {type(e).__name__}: {str(e)[:80]}")
    mhf.patch(model)
    torch.manual_seed(123)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=12, **kw)
    assert torch.equal(got, want)


def _assistant(name):
    return lambda model: dict(assistant_model=tiny_model(name, seed=5), do_sample=False)


MODES = {
    "sample": (lambda m: dict(do_sample=True, top_k=0, temperature=1.0), (5, 9, 2)),
    "beam": (lambda m: dict(num_beams=2, do_sample=False), (5, 9, 2)),
    "static": (lambda m: dict(do_sample=False, cache_implementation="static"), (5, 9, 2)),
    "prompt-lookup": (lambda m: dict(do_sample=False, prompt_lookup_num_tokens=3), (9,)),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", SUPPORTED_IDS)
def test_generation_modes_same_tokens(name, mode):
    build, lengths = MODES[mode]
    same_generate(name, build, lengths=lengths)


@pytest.mark.parametrize("name", ["deepseek-v3", "longcat-flash", "bailing-hybrid"])
def test_assisted_decoding_same_tokens(name):
    same_generate(name, _assistant(name), lengths=(9,))


@pytest.mark.parametrize("name", SUPPORTED_IDS)
def test_cache_handed_between_patched_and_unpatched(name):
    """A cache written unpatched serves the patched model and back: both hold transformers' latent."""
    model = tiny_model(name)
    ids, mask = prompts(seed=6)
    first = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True
    )
    mask2 = torch.cat([mask, torch.ones(ids.shape[0], 6, dtype=mask.dtype)], dim=1)
    kw = dict(attention_mask=mask2, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    want = model.generate(first.sequences, cache=_copy(first.cache), **kw)
    mhf.patch(model)
    got = model.generate(first.sequences, cache=_copy(first.cache), **kw)  # unpatched cache → patched
    assert torch.equal(got.sequences, want.sequences)
    # and a cache the patched model wrote serves the unpatched one
    mask3 = torch.cat([mask2, torch.ones(ids.shape[0], 10, dtype=mask.dtype)], dim=1)
    kw = dict(attention_mask=mask3, max_new_tokens=4, do_sample=False)
    want = model.generate(got.sequences, cache=_copy(got.cache), **kw)
    mhf.unpatch(model)
    assert torch.equal(model.generate(got.sequences, cache=_copy(got.cache), **kw), want)


def _copy(cache):
    import copy

    return copy.deepcopy(cache)


@pytest.mark.parametrize("name", SUPPORTED_IDS)
def test_save_and_from_pretrained_round_trip(name, tmp_path):
    model = tiny_model(name)
    ids, mask = prompts(seed=7)
    want, _ = greedy(model, ids, mask, new=8)
    keys = set(model.state_dict())
    mhf.patch(model)
    assert set(model.state_dict()) == keys  # the checkpoint a patched model writes is transformers' own
    model.save_pretrained(tmp_path)
    loaded = getattr(transformers, TINY[name][2]).from_pretrained(tmp_path).eval()
    loaded.generation_config.pad_token_id = PAD
    assert not mhf.is_patched(loaded)
    mhf.patch(loaded)
    got, _ = greedy(loaded, ids, mask, new=8)
    assert torch.equal(got, want)


class Wrapper(nn.Module):
    """What a quantization or LoRA library puts in place of a Linear."""

    def __init__(self, inner: nn.Linear):
        super().__init__()
        self.inner = inner

    @property
    def weight(self):
        return self.inner.weight

    def forward(self, x):
        return self.inner(x)


def test_unpatch_keeps_a_submodule_replaced_while_patched():
    model = tiny_model("deepseek-v3")
    ids, mask = prompts(seed=9)
    mhf.patch(model)
    layer = model.model.layers[0].self_attn
    original = layer.original
    layer.kv_b_proj = Wrapper(layer.kv_b_proj)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    mhf.unpatch(model)
    assert model.model.layers[0].self_attn is original
    assert isinstance(original.kv_b_proj, Wrapper)
    assert set(model.state_dict()) >= {"model.layers.0.self_attn.kv_b_proj.inner.weight"}
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert_close("unpatched with the wrapper", got[real], want[real])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mhf.patch(model)  # and patches again with the wrapper in place
    assert patched_layers(model)[0].kv_b_proj is original.kv_b_proj


def test_models_command_lists_the_families(capsys):
    from mlakit.cli import main

    assert main(["models", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["families"]
    assert {r["attention"] for r in rows if r["patched"]} == set(mhf.SUPPORTED)
    assert {r["attention"]: r["reason"] for r in rows if not r["patched"]} == mhf.REFUSED
    assert main(["models"]) == 0
    assert "LongcatFlashMLA" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["deepseek-v3", "longcat-flash"])
def test_bf16_within_transformers_own_eager_vs_sdpa_noise(name):
    """bf16: the patched model is as far from the fp32 answer as transformers' sdpa and eager are."""
    ids, mask = prompts(seed=2, lengths=(7, 3, 11))
    real = mask.bool()
    with torch.no_grad():
        want = tiny_model(name)(ids, attention_mask=mask).logits[real]
        errors = {}
        for attn in ("sdpa", "eager"):
            model = tiny_model(name, attn=attn).to(torch.bfloat16)
            errors[attn] = (model(ids, attention_mask=mask).logits[real].float() - want).abs().max().item()
        mhf.patch(model)
        patched = (model(ids, attention_mask=mask).logits[real].float() - want).abs().max().item()
    print(f"{name} bf16 error vs fp32: {errors}, patched {patched:.3g}")
    assert patched <= 2 * max(errors.values())


@pytest.mark.parametrize("name", ["deepseek-v3", "longcat-flash", "kimi-linear"])
def test_load_attention_reads_each_mla_layer(name, tmp_path):
    """load_attention's layer index is the model's MLA layer: LongCat's two per decoder layer, a
    hybrid's decoder layer (its linear-attention layers refused by name)."""
    model = tiny_model(name)
    model.save_pretrained(tmp_path)
    attns = [m for m in model.modules() if type(m).__name__ == TINY[name][0]]
    indices = [m.layer_idx for m in attns]
    for index, attn in zip(indices, attns, strict=True):
        layer = mhf.load_attention(tmp_path, index)
        for key, want in attn.state_dict().items():
            assert torch.equal(layer.state_dict()[key], want), f"{name} layer {index}: {key}"
    if name == "kimi-linear":
        with pytest.raises(ValueError, match="layer 0 is a linear-attention layer"):
            mhf.load_attention(tmp_path, 0)

"""MLAAttention against transformers' own attention modules with the same weights.

Their module runs eagerly with its own DynamicCache, its own rotary embedding module and an explicit
causal mask; ours loads their state_dict strictly and runs the same prefill, chunk and 8 decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from support.common import assert_close, randn, randomize_, yarn_scaling

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.rope import attention_factor, inv_freq

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402
from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as hf_glm  # noqa: E402
from transformers.models.minicpm3 import modeling_minicpm3 as hf_cpm  # noqa: E402

FAMILIES = {
    "v3": (transformers.DeepseekV3Config, hf_v3.DeepseekV3Attention, hf_v3.DeepseekV3RotaryEmbedding),
    "v2": (transformers.DeepseekV2Config, hf_v2.DeepseekV2Attention, hf_v2.DeepseekV2RotaryEmbedding),
    "glm": (transformers.Glm4MoeLiteConfig, hf_glm.Glm4MoeLiteAttention, hf_glm.Glm4MoeLiteRotaryEmbedding),
    "minicpm3": (transformers.MiniCPM3Config, hf_cpm.MiniCPM3Attention, hf_cpm.MiniCPM3RotaryEmbedding),
}

HIDDEN, HEADS, LATENT, NOPE, ROPE, V = 64, 4, 20, 12, 8, 10
YARN = yarn_scaling(4.0, 16, 1.0, 0.5)  # partial ramp at rope width 8, attention factor != 1
YARN_V2 = yarn_scaling(4.0, 16, 0.707, 0.707)


@dataclass(frozen=True)
class Case:
    family: str
    rope: dict | None
    q_lora_rank: int | None = 24
    interleave: bool | None = None  # None: the family's own default (V2 and MiniCPM3 have no switch)
    v_head_dim: int | None = V
    bias: bool = False


CASES = {
    "v3-yarn-interleaved": Case("v3", YARN, interleave=True),
    "v3-default-half-split-no-q-lora": Case("v3", None, q_lora_rank=None, interleave=False),
    "v3-yarn-half-split-bias": Case("v3", YARN, interleave=False, bias=True),
    "v3-default-interleaved-no-q-lora": Case("v3", None, q_lora_rank=None, interleave=True),
    "v2-yarn-complex": Case("v2", YARN_V2),
    "v2-default-complex-no-q-lora": Case("v2", None, q_lora_rank=None),
    "glm-default-interleaved": Case("glm", None, interleave=True),
    "glm-yarn-half-split-no-q-lora": Case("glm", YARN, q_lora_rank=None, interleave=False),
    "minicpm3-default-v-none": Case("minicpm3", None, v_head_dim=None),
    "minicpm3-yarn-no-q-lora-bias": Case("minicpm3", YARN, q_lora_rank=None, bias=True),
}


def hf_config(case: Case):
    config_cls = FAMILIES[case.family][0]
    params = {"rope_type": "default", "rope_theta": 10000.0}
    if case.rope is not None:
        params = {**case.rope, "rope_theta": 10000.0}
    kwargs = dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=case.q_lora_rank,
        kv_lora_rank=LATENT,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=case.v_head_dim,
        num_hidden_layers=1,
        max_position_embeddings=64,  # = factor · original, so transformers' YaRN check stays quiet
        attention_bias=case.bias,
        rope_parameters=params,
    )
    if case.interleave is not None:
        kwargs["rope_interleave"] = case.interleave
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    return config


def hf_modules(case: Case, seed: int = 0):
    config = hf_config(case)
    _, attn_cls, rotary_cls = FAMILIES[case.family]
    attn = randomize_(attn_cls(config, layer_idx=0), seed).eval()
    return config, attn, rotary_cls(config)


def causal_mask(batch: int, new: int, past: int) -> torch.Tensor | None:
    """Additive [B, 1, new, past+new] mask: query i (position past+i) sees keys 0..past+i."""
    if new == 1:
        return None
    keys = torch.arange(past + new)
    hidden = keys[None, :] > (past + torch.arange(new))[:, None]
    mask = torch.zeros(new, past + new).masked_fill(hidden, torch.finfo(torch.float32).min)
    return mask[None, None].expand(batch, 1, new, past + new)


def run_hf(attn, rotary, chunks: list[torch.Tensor]):
    cache = transformers.DynamicCache()
    outs, past = [], 0
    with torch.no_grad():
        for x in chunks:
            batch, new, _ = x.shape
            positions = (past + torch.arange(new))[None].expand(batch, new)
            out, _ = attn(
                hidden_states=x,
                position_embeddings=rotary(x, positions),
                attention_mask=causal_mask(batch, new, past),
                cache=cache,
            )
            outs.append(out)
            past += new
    return torch.cat(outs, dim=1), cache


def run_mlakit(layer, cfg, chunks: list[torch.Tensor], mode: str):
    total = sum(x.shape[1] for x in chunks)
    cache = LatentCache(cfg, chunks[0].shape[0], total)
    with torch.no_grad():
        outs = [layer(x, cache, mode=mode) for x in chunks]
    return torch.cat(outs, dim=1), cache


def schedule(seed: int) -> list[torch.Tensor]:
    """A 6-token prefill, a 3-token chunk over the cached prefix, then 8 decode steps; batch 2."""
    x = randn(2, 17, HIDDEN, seed=seed)
    return [x[:, :6], x[:, 6:9]] + [x[:, t : t + 1] for t in range(9, 17)]


@pytest.mark.parametrize("mode", ["absorb", "materialize", "auto"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_prefill_chunk_and_decode_match_transformers(case, mode):
    config, attn, rotary = hf_modules(case)
    cfg = MLAConfig.from_hf(config)
    layer = MLAAttention(cfg).eval()
    layer.load_state_dict(attn.state_dict(), strict=True)
    chunks = schedule(seed=1)
    want, hf_cache = run_hf(attn, rotary, chunks)
    got, cache = run_mlakit(layer, cfg, chunks, mode)
    assert_close(f"{mode} prefill", got[:, :6], want[:, :6])
    assert_close(f"{mode} chunk", got[:, 6:9], want[:, 6:9])
    assert_close(f"{mode} decode", got[:, 9:], want[:, 9:])
    # the cache holds their latent and their rotated key (V2 keeps pairs interleaved, mlakit [evens|odds])
    their_c, their_k = hf_cache.layers[0].keys[:, 0], hf_cache.layers[0].values[:, 0]
    if case.family == "v2":
        their_k = torch.cat([their_k[..., 0::2], their_k[..., 1::2]], dim=-1)
    assert_close("cached latent", cache.c_kv, their_c, rtol=1e-6)
    assert_close("cached rope key", cache.k_pe, their_k, rtol=1e-6)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_from_hf_reads_their_config(case):
    config, attn, rotary = hf_modules(case)
    cfg = MLAConfig.from_hf(config)
    v_head_dim = case.v_head_dim or HIDDEN // HEADS
    assert (cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (
        HIDDEN,
        HEADS,
        case.q_lora_rank,
        LATENT,
    )
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (NOPE, ROPE, v_head_dim)
    assert cfg.v_head_dim != cfg.qk_nope_head_dim
    layout = {"v2": True, "minicpm3": False}.get(case.family, case.interleave)
    assert cfg.rope_interleave is layout
    assert cfg.attention_bias is case.bias
    assert cfg.is_yarn is (case.rope is not None)
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert_close("inv_freq", inv_freq(cfg), rotary.inv_freq, rtol=1e-6)
    assert attention_factor(cfg) == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_their_prefill_is_causal(family):
    # guards the oracle: with this mask, changing the last token changes only the last output
    case = next(c for c in CASES.values() if c.family == family)
    _, attn, rotary = hf_modules(case)
    x = randn(1, 5, HIDDEN, seed=2)
    y = x.clone()
    y[:, -1] = randn(HIDDEN, seed=3)
    out_x, _ = run_hf(attn, rotary, [x])
    out_y, _ = run_hf(attn, rotary, [y])
    assert torch.equal(out_x[:, :-1], out_y[:, :-1])
    assert not torch.allclose(out_x[:, -1], out_y[:, -1])
    # and without a mask their eager attention would not be causal: the test above can fail
    with torch.no_grad():
        positions = torch.arange(5)[None]
        unmasked = attn(hidden_states=y, position_embeddings=rotary(y, positions), attention_mask=None)[0]
    assert not torch.allclose(unmasked[:, 0], out_y[:, 0])


def test_yarn_cases_run_past_the_original_context():
    # positions 0..16 against original_max_position_embeddings 16: the run reaches the scaled range
    assert YARN["original_max_position_embeddings"] < 17
    cfg = MLAConfig.from_hf(hf_config(CASES["v3-yarn-interleaved"]))
    assert not torch.allclose(inv_freq(cfg), inv_freq(cfg.replace(rope_scaling=None)))

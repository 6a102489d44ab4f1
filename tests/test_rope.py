"""Rotary tables and layouts against transformers' own rope code, plus the relative-position property."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_close, randn, tiny_config, yarn_scaling

from mlakit.config import MLAConfig
from mlakit.rope import RotaryTable, apply_rope, attention_factor, inv_freq

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

# (id, rope width, theta, scaling): default rope and YaRN with the settings real checkpoints use
ROPES = [
    ("default-dr4", 4, 10000.0, None),
    ("default-dr64-theta1e6", 64, 1e6, None),
    ("yarn-v3", 64, 10000.0, yarn_scaling(40, 4096, 1.0, 1.0)),
    ("yarn-v2", 64, 10000.0, yarn_scaling(40, 4096, 0.707, 0.707)),
    ("yarn-kimi", 64, 50000.0, {**yarn_scaling(32, 4096, 1.0, 1.0), "beta_fast": 1}),
    ("yarn-partial-ramp-dr16", 16, 10000.0, yarn_scaling(4, 256, 1.0, 0.5)),
    ("yarn-mscale-only", 16, 10000.0, {**yarn_scaling(8, 64), "mscale_all_dim": None}),
    ("yarn-attention-factor", 8, 10000.0, {**yarn_scaling(4, 32), "attention_factor": 0.8}),
    ("yarn-no-truncate", 16, 10000.0, {**yarn_scaling(4, 256), "truncate": False}),
]


def configs(dim, theta, scaling):
    cfg = tiny_config(qk_rope_head_dim=dim, rope_theta=theta, rope_scaling=scaling)
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params = {**{k: v for k, v in scaling.items() if v is not None}, "rope_theta": theta}
    hf = transformers.DeepseekV3Config(
        hidden_size=40,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_nope_head_dim=4,
        qk_rope_head_dim=dim,
        v_head_dim=4,
        num_hidden_layers=1,
        max_position_embeddings=int(scaling["factor"] * scaling["original_max_position_embeddings"])
        if scaling
        else 8192,
        rope_parameters=params,
    )
    return cfg, hf


@pytest.mark.parametrize("dim,theta,scaling", [r[1:] for r in ROPES], ids=[r[0] for r in ROPES])
def test_frequencies_and_factor_match_transformers(dim, theta, scaling):
    cfg, hf = configs(dim, theta, scaling)
    rotary = hf_v3.DeepseekV3RotaryEmbedding(hf)
    assert_close("inv_freq", inv_freq(cfg), rotary.inv_freq, rtol=1e-6)
    assert attention_factor(cfg) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    positions = torch.tensor([[0, 1, 7, 300, 5000]])
    cos, sin = RotaryTable(cfg).cos_sin(positions)
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    assert_close("cos", cos, want_cos[..., : dim // 2], rtol=1e-6)
    assert_close("sin", sin, want_sin[..., : dim // 2], rtol=1e-6)


def test_yarn_really_changes_the_frequencies():
    # guards the YaRN cases above against a ramp that keeps (or scales) every frequency
    plain = inv_freq(tiny_config(qk_rope_head_dim=16))
    yarn = inv_freq(tiny_config(qk_rope_head_dim=16, rope_scaling=yarn_scaling(4, 256)))
    same = torch.isclose(plain, yarn)
    scaled = torch.isclose(plain / 4, yarn)
    assert same.any() and scaled.any() and not (same | scaled).all()


def rotation_inputs(cfg: MLAConfig, seed: int = 0):
    dr = cfg.qk_rope_head_dim
    q, k = randn(2, 3, 5, dr, seed=seed), randn(2, 1, 5, dr, seed=seed + 1)  # [B, heads, S, dr]
    positions = torch.tensor([[0, 1, 2, 9, 40], [3, 4, 5, 6, 100]])
    return q, k, positions


@pytest.mark.parametrize("scaling", [None, yarn_scaling(4, 16)], ids=["default", "yarn"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
def test_apply_matches_transformers_v3_rotation(interleave, scaling):
    cfg, hf = configs(8, 10000.0, scaling)
    cfg = cfg.replace(rope_interleave=interleave)
    q, k, positions = rotation_inputs(cfg)
    cos, sin = hf_v3.DeepseekV3RotaryEmbedding(hf)(q, positions)
    hf_apply = hf_v3.apply_rotary_pos_emb_interleave if interleave else hf_v3.apply_rotary_pos_emb
    want_q, want_k = hf_apply(q, k, cos, sin)
    table = RotaryTable(cfg)
    c, s = table.cos_sin(positions)  # [B, S, dr/2]
    assert_close("q", table.apply(q, c[:, None], s[:, None]), want_q, rtol=1e-6)
    assert_close("k", table.apply(k, c[:, None], s[:, None]), want_k, rtol=1e-6)


@pytest.mark.parametrize("scaling", [None, yarn_scaling(4, 16)], ids=["default", "yarn"])
def test_apply_matches_transformers_v2_complex_rope(scaling):
    # V2 multiplies interleaved pairs by e^{iθ} and keeps them interleaved; mlakit emits [evens | odds]
    cfg, _ = configs(8, 10000.0, scaling)
    params = {"rope_type": "default", "rope_theta": 10000.0} if scaling is None else dict(scaling)
    params["rope_theta"] = 10000.0
    hf = transformers.DeepseekV2Config(
        hidden_size=40,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_nope_head_dim=4,
        qk_rope_head_dim=8,
        v_head_dim=4,
        num_hidden_layers=1,
        rope_parameters=params,
    )
    q, k, positions = rotation_inputs(cfg)
    freqs_cis = hf_v2.DeepseekV2RotaryEmbedding(hf)(q, positions)
    want_q, want_k = hf_v2.apply_rotary_emb(q, k, freqs_cis)
    order = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    table = RotaryTable(cfg)
    c, s = table.cos_sin(positions)
    assert_close("q", table.apply(q, c[:, None], s[:, None]), want_q[..., order], rtol=1e-6)
    assert_close("k", table.apply(k, c[:, None], s[:, None]), want_k[..., order], rtol=1e-6)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
def test_scores_depend_only_on_relative_position(interleave):
    cfg = tiny_config(qk_rope_head_dim=8, rope_interleave=interleave)
    table = RotaryTable(cfg)
    q, k = randn(8, seed=3), randn(8, seed=4)

    def score(m: int, n: int) -> float:
        cm, sm = table.cos_sin(torch.tensor(m))
        cn, sn = table.cos_sin(torch.tensor(n))
        return float(table.apply(q, cm, sm) @ table.apply(k, cn, sn))

    assert score(5, 2) == pytest.approx(score(105, 102), rel=1e-4)
    assert score(0, 0) == pytest.approx(float(q @ k), rel=1e-5)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3


def test_rotation_keeps_pair_norms_and_dtype():
    x = randn(3, 8, seed=5, dtype=torch.bfloat16)
    angle = torch.tensor([0.3, 1.0, 2.0, 4.0])
    out = apply_rope(x, angle.cos(), angle.sin(), interleave=True)
    assert out.dtype == torch.bfloat16
    pairs_in = x.float()[..., 0::2] ** 2 + x.float()[..., 1::2] ** 2
    pairs_out = out.float()[..., :4] ** 2 + out.float()[..., 4:] ** 2
    assert torch.allclose(pairs_in, pairs_out, rtol=2e-2)
    # one quarter turn of the pair (1, 0) gives (0, 1)
    quarter = apply_rope(torch.tensor([1.0, 0.0]), torch.tensor([0.0]), torch.tensor([1.0]), interleave=True)
    assert quarter.tolist() == [0.0, 1.0]


def test_float64_rotation_keeps_float64_precision():
    x = randn(5, 8, seed=6, dtype=torch.float64)
    angle = torch.linspace(0.1, 3.0, 4, dtype=torch.float64)
    out = apply_rope(x, angle.cos(), angle.sin(), interleave=False)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angle), angle)
    assert out.dtype == torch.float64
    assert (out - torch.cat([z.real, z.imag], dim=-1)).abs().max() < 1e-14


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"]
)
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
def test_plan_tables_rotate_bit_for_bit_like_apply_rope(interleave, dtype):
    # what a planned layer runs (full-width tables built once per step) equals apply_rope exactly
    from mlakit.rope import apply_tables, rope_tables

    x = randn(2, 3, 4, 8, seed=7, dtype=dtype)  # [B, S, H, dr]
    angle = randn(2, 3, 4, seed=8)
    cos, sin = angle.cos(), angle.sin()
    tables = rope_tables(cos, sin, interleave)
    heads = apply_tables(x, tables.unsqueeze_heads())
    keys = apply_tables(x[:, :, 0], tables)
    assert heads.dtype == dtype
    assert torch.equal(heads, apply_rope(x, cos[:, :, None], sin[:, :, None], interleave))
    assert torch.equal(keys, apply_rope(x[:, :, 0], cos, sin, interleave))


@pytest.mark.parametrize("dr", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
def test_one_pass_cpu_rope_bit_for_bit(interleave, dtype, dr):
    """The one-pass rope (csrc/rows.cpp) on packed tokens: queries sliced out of a wider projection
    (strided heads) and keys, equal to apply_rope exactly; forms it does not take fall back."""
    from mlakit.ops import cpu_core
    from mlakit.rope import _fused_form, apply_tables, rope_tables

    if not cpu_core.available(torch.bfloat16):
        pytest.skip(f"the bf16 CPU core does not run here: {cpu_core.unavailable_reason()}")
    n, h = 37, 5  # 185 rows: several parallel chunks and a short one
    q = randn(n, h, 96 + dr, seed=3, dtype=dtype)[..., 96:]  # [N, H, dr], stride 96 + dr per head
    k = randn(n, dr, seed=4, dtype=dtype)
    angle = randn(n, dr // 2, seed=5) * 50
    cos, sin = angle.cos(), angle.sin()
    tables = rope_tables(cos, sin, interleave)
    assert _fused_form(q, tables.unsqueeze_heads()) is not None and _fused_form(k, tables) is not None
    got_q, got_k = apply_tables(q, tables.unsqueeze_heads()), apply_tables(k, tables)
    assert got_q.dtype == dtype and got_q.is_contiguous() and got_q.shape == q.shape
    assert torch.equal(got_q, apply_rope(q, cos[:, None], sin[:, None], interleave))
    assert torch.equal(got_k, apply_rope(k, cos, sin, interleave))
    # not taken: fp64, a width not a multiple of 32, autograd, tables broadcast another way
    assert _fused_form(q.double(), tables.unsqueeze_heads()) is None
    assert _fused_form(q[..., :16], rope_tables(cos[:, :8], sin[:, :8], interleave).unsqueeze_heads()) is None
    assert _fused_form(k.float().requires_grad_(), tables) is None
    assert _fused_form(q, tables) is None

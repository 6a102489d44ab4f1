"""Test helpers: assert_close that prints error and scale, tiny configs, seeded layers and inputs,
and an independent float64 MLA written from the layer's weights (explicit per-head keys and values)."""

from __future__ import annotations

import torch

from mlakit import LatentCache, MLAAttention, MLAConfig


def rel_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """(max abs error, scale = max |want|, error / scale), computed in float64."""
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    err = (got64 - want64).abs().max().item() if want64.numel() else 0.0
    scale = want64.abs().max().item() if want64.numel() else 0.0
    return err, scale, err / max(scale, 1e-30)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> float:
    """Max |got - want| <= rtol · max |want|; prints both so a failure (or -s) shows the margin."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert not torch.isnan(want).any(), f"{name}: the expected tensor has NaN"
    assert not torch.isnan(got).any(), f"{name}: got NaN where the expected tensor has none"
    err, scale, rel = rel_error(got, want)
    print(f"{name}: max err {err:.3e}, scale {scale:.3e}, relative {rel:.3e} (rtol {rtol:.1e})")
    assert rel <= rtol, (
        f"{name}: relative error {rel:.3e} > {rtol:.1e} (max err {err:.3e}, scale {scale:.3e})"
    )
    return rel


def assert_lse_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 2e-5) -> None:
    """Same -inf pattern (queries that see no key), finite values within atol·max(1, |want|)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{name}: -inf pattern differs"
    finite = torch.isfinite(want)
    if finite.any():
        err = ((got[finite] - want[finite]).abs() / want[finite].abs().clamp_min(1)).max().item()
        print(f"{name}: lse max relative err {err:.3e}")
        assert err <= atol, f"{name}: lse error {err:.3e} > {atol:.1e}"


def tiny_config(**changes) -> MLAConfig:
    """Odd, unequal widths so that a swapped axis cannot go unnoticed (nope 6 != v 5, L 20 != D 40)."""
    base = dict(
        hidden_size=40,
        num_heads=3,
        q_lora_rank=24,
        kv_lora_rank=20,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        rope_interleave=True,
    )
    base.update(changes)
    return MLAConfig(**base)


def yarn_scaling(factor: float = 4.0, original: int = 16, mscale: float = 1.0, mscale_all_dim: float = 0.5):
    """A YaRN dict whose ramp is partial at small rope widths and whose mscales differ (factor != 1)."""
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Overwrite every parameter with seeded values: weights ~ N(0, 1/fan_in), norm gains ~ 1 ± 0.3."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("layernorm.weight"):
                values = 1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            elif p.dim() == 2:
                values = torch.randn(p.shape, generator=g, dtype=torch.float64) / p.shape[1] ** 0.5
            else:
                values = 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(values.to(p.dtype))
    return module


def make_layer(cfg: MLAConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> MLAAttention:
    return randomize_(MLAAttention(cfg, dtype=dtype), seed).eval()


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def snapshot(cache: LatentCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cache.c_kv.clone(), cache.k_pe.clone(), cache.lengths.clone()


def assert_unchanged(cache: LatentCache, before: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    c_kv, k_pe, lengths = before
    assert torch.equal(cache.lengths, lengths), (
        f"lengths changed: {lengths.tolist()} -> {cache.lengths.tolist()}"
    )
    if cache.c_kv.device.type != "meta":
        assert torch.equal(cache.c_kv, c_kv), "c_kv changed"
        assert torch.equal(cache.k_pe, k_pe), "k_pe changed"


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x: torch.Tensor, angles: torch.Tensor, factor: float, interleave: bool) -> torch.Tensor:
    """Rotate pairs of x [..., dr] by angles [..., dr/2] as complex numbers; output in x's own layout."""
    half = x.shape[-1] // 2
    re, im = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    z = torch.complex(re, im) * torch.polar(torch.full_like(angles, factor), angles)
    if interleave:
        return torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    return torch.cat([z.real, z.imag], dim=-1)


def naive_mla(layer: MLAAttention, hidden: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of hidden [B,N,D] at positions 0..N-1, float64, keys and values per head.

    Independent of mlakit's ops and rope code: only the layer's weights, its inverse frequencies and
    YaRN factor (tested against transformers in test_rope) are read. Returns [B,N,D] in float64.
    """
    cfg = layer.cfg
    p = {k: v.detach().double() for k, v in layer.named_parameters()}
    x = hidden.detach().double()
    b, n, _ = x.shape
    h, dn, dr, dv, lat = (
        cfg.num_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )

    def lin(name, t):
        out = t @ p[f"{name}.weight"].T
        return out + p[f"{name}.bias"] if f"{name}.bias" in p else out

    if cfg.q_lora_rank is None:
        q = lin("q_proj", x)
    else:
        q = lin("q_b_proj", _rms(lin("q_a_proj", x), p["q_a_layernorm.weight"], cfg.rms_norm_eps))
    q = q.view(b, n, h, dn + dr)
    latent = lin("kv_a_proj_with_mqa", x)
    c = _rms(latent[..., :lat], p["kv_a_layernorm.weight"], cfg.rms_norm_eps)  # [B, N, L]
    angles = torch.arange(n, dtype=torch.float64)[:, None] * layer.rope.inv_freq.double()  # [N, dr/2]
    q_pe = _rotate(q[..., dn:], angles[:, None], layer.rope.factor, cfg.rope_interleave)
    k_pe = _rotate(latent[..., lat:], angles, layer.rope.factor, cfg.rope_interleave)  # [B, N, dr]
    kv = (c @ p["kv_b_proj.weight"].T).view(b, n, h, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe[:, :, None].expand(b, n, h, dr)], dim=-1)  # [B, N, H, dn+dr]
    v = kv[..., dn:]
    qq = torch.cat([q[..., :dn], q_pe], dim=-1)
    scores = torch.einsum("bihd,bjhd->bhij", qq, k) * cfg.softmax_scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(b, n, h * dv)
    return lin("o_proj", o)


# a tiny transformers MLA config (DeepSeek-V3's field names), shared by the transformers tests
HF_PAD = 3
HF_TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    pad_token_id=HF_PAD,
    bos_token_id=1,
    eos_token_id=None,
    initializer_range=0.2,
    max_position_embeddings=256,
)
HF_MOE = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)

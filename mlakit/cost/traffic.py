"""Bytes moved per term, for a cache dtype: the memory side of the roofline.

Each operand is counted once per call (perfect on-chip reuse: the least traffic a kernel can have).
Attention is flash-style: scores and probabilities never leave the chip. The latent cache is stored
in `dtype` (its exact layout, scales included); activations, weights and expanded K/V are in the
compute dtype (fp32 for an fp32 cache, bf16 otherwise: quantized latents are dequantized on the fly).
"""

from __future__ import annotations

from mlakit.config import MLAConfig
from mlakit.cost.cache_size import VALUE_BYTES, cache_layouts, check_cache_dtype
from mlakit.cost.terms import _check, check_count, expanded_tokens, widths


def compute_dtype(dtype: str) -> str:
    """The dtype the matmuls run in for a cache stored in `dtype`."""
    check_cache_dtype(dtype)
    return "fp32" if dtype == "fp32" else "bf16"


def materialize_bytes(
    cfg: MLAConfig, new, cached, model: str = "independent", dtype: str = "bf16", fused: bool = False
) -> dict:
    """fused=True: expanded K/V stay on chip (expand and attend in one kernel); else written and read."""
    _check(new, cached)
    h, lat, dn, dr, dv = widths(cfg)
    e = VALUE_BYTES[compute_dtype(dtype)]
    latent, rope = _cache_row_bytes(cfg, dtype)
    t = expanded_tokens(new, cached, model)
    nh = new * h
    kv_round_trip = 0 if fused else 1
    return {
        # the latents are read once for both expansions (one kv_b_proj matmul)
        "expand_k": t * latent + h * dn * lat * e + kv_round_trip * t * h * dn * e,  # c_kv, W_UK, K out
        "expand_v": h * dv * lat * e + kv_round_trip * t * h * dv * e,  # W_UV, V out
        "scores": nh * (dn + dr) * e + t * rope + kv_round_trip * t * h * dn * e,  # q, k_pe, K
        "weighted_sum": kv_round_trip * t * h * dv * e + nh * dv * e,  # V in, output out
    }


def absorb_bytes(
    cfg: MLAConfig, new, cached, model: str = "independent", dtype: str = "bf16", fused: bool = False
) -> dict:
    """The cache is read once by one kernel for scores and latent mixing (FlashMLA's shape).

    `fused` is accepted for symmetry with materialize: absorb never builds per-head K/V.
    """
    _check(new, cached)
    h, lat, dn, dr, dv = widths(cfg)
    e = VALUE_BYTES[compute_dtype(dtype)]
    latent, rope = _cache_row_bytes(cfg, dtype)
    t = expanded_tokens(new, cached, model)
    nh = new * h
    return {
        "fold_q": nh * dn * e + h * dn * lat * e + nh * lat * e,  # q_nope in, W_UK, q_lat out
        "scores": nh * (lat + dr) * e + t * (latent + rope),  # q_lat and q_pe in, [c_kv | k_pe]
        "mix_latents": nh * lat * e,  # o_lat out (the latents were loaded for the scores)
        "unfold_v": nh * lat * e + h * lat * dv * e + nh * dv * e,  # o_lat in, W_UV, output out
    }


def shared_bytes(cfg: MLAConfig, new, dtype: str = "bf16") -> dict:
    """Each projection reads its input and weight and writes its output once."""
    check_count("new", new)
    e = VALUE_BYTES[compute_dtype(dtype)]
    d, h = cfg.hidden_size, cfg.num_heads
    q_width = h * cfg.qk_head_dim
    shapes = {}
    if cfg.q_lora_rank is None:
        shapes["q_proj"] = (d, q_width)
    else:
        shapes["q_a_proj"] = (d, cfg.q_lora_rank)
        shapes["q_b_proj"] = (cfg.q_lora_rank, q_width)
    shapes["kv_a_proj_with_mqa"] = (d, cfg.latent_dim)
    shapes["o_proj"] = (h * cfg.v_head_dim, d)
    return {name: (new * i + i * o + new * o) * e for name, (i, o) in shapes.items()}


def path_bytes(
    cfg: MLAConfig, mode: str, new, cached, model: str = "independent", dtype: str = "bf16", fused=False
) -> dict:
    if mode == "absorb":
        return absorb_bytes(cfg, new, cached, model, dtype, fused)
    if mode == "materialize":
        return materialize_bytes(cfg, new, cached, model, dtype, fused)
    raise ValueError(f"mode must be 'absorb' or 'materialize', got {mode!r}")


def _cache_row_bytes(cfg: MLAConfig, dtype: str) -> tuple[int, int]:
    """(latent bytes, rope bytes) of one cached token in one layer, scales included."""
    mla = cache_layouts(cfg, ())["mla"]
    return mla.content_bytes(dtype), mla.rope_bytes(dtype)

"""Memory a command will need, estimated from the widths before anything is allocated (torch-free).

Estimates are deliberately generous (activations counted in fp32, a fixed slack for the score
chunks and the expansion workspace): a refusal names what the run would need and what is free.
"""

from __future__ import annotations

from mlakit.config import MLAConfig

FP32 = 4
SLACK = 768 << 20  # score chunks (2^26 fp32 values), the K/V expansion workspace, the allocator


def layer_params(cfg: MLAConfig) -> int:
    """Weights of one MLAAttention layer."""
    d, h, L, dr = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk, dv = cfg.qk_nope_head_dim + dr, cfg.v_head_dim
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk if cfg.q_lora_rank else d * h * qk
    return q + d * (L + dr) + L * h * (cfg.qk_nope_head_dim + dv) + h * dv * d


def activation_bytes_per_token(cfg: MLAConfig) -> int:
    """fp32 bytes live per new token during one layer call: hidden in/out, queries, latents, output."""
    h = cfg.num_heads
    per = 4 * cfg.hidden_size + h * (cfg.qk_head_dim + 2 * cfg.kv_lora_rank + 2 * cfg.v_head_dim)
    return per * FP32


def cache_bytes_per_token(cfg: MLAConfig, value_bytes: int = FP32) -> int:
    """One layer's latent cache row: [c_kv | k_pe]."""
    return cfg.latent_dim * value_bytes


def check_run_bytes(cfg: MLAConfig, batch: int, prefill: int, steps: int, value_bytes: int) -> int:
    """`mlakit check`: the layer, two caches (one per path), the prompt and its outputs."""
    tokens = batch * (prefill + steps)
    return (
        layer_params(cfg) * value_bytes
        + 2 * tokens * cache_bytes_per_token(cfg, value_bytes)
        + 3 * tokens * cfg.hidden_size * value_bytes  # inputs and both paths' outputs, kept to compare
        + batch * prefill * activation_bytes_per_token(cfg)
        + SLACK
    )


def cp_check_bytes(cfg: MLAConfig, world_size: int, context: int, steps: int, chunk: int) -> int:
    """`mlakit cp-check`: every rank holds the fp32 layer, the prompt and its share of the cache;
    rank 0 also runs the single-process reference (a whole cache and a whole-prompt forward)."""
    tokens = context + steps
    per_rank = (
        layer_params(cfg) * FP32
        + 2 * tokens * cfg.hidden_size * FP32  # the prompt, and the outputs kept to compare
        + min(chunk, context) * activation_bytes_per_token(cfg)
        + SLACK // 4
    )
    reference = tokens * cache_bytes_per_token(cfg) + context * activation_bytes_per_token(cfg) + SLACK
    return world_size * per_rank + reference

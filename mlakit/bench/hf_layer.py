"""transformers' DeepseekV3Attention with mlakit's weights, its rotary table and a DynamicCache.

It caches the latent like mlakit, but re-expands every cached latent into per-head keys and values
at every step (`expand_kv`): the baseline absorbed decode is measured against.
"""

from __future__ import annotations

import inspect

import torch

from mlakit.config import MLAConfig


def available() -> bool:
    try:
        import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401
    except ImportError:
        return False
    return True


def hf_config(cfg: MLAConfig):
    """A DeepseekV3Config with the attention widths of `cfg` (the MoE fields are never used)."""
    from transformers import DeepseekV3Config

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    config = DeepseekV3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        num_hidden_layers=1,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope,
        rope_interleave=cfg.rope_interleave,
        attention_bias=cfg.attention_bias,
    )
    config._attn_implementation = "sdpa"
    return config


class HFLayer:
    """DeepseekV3Attention sharing the tensors of an mlakit layer (no copy of the weights)."""

    def __init__(self, layer):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention,
            DeepseekV3RotaryEmbedding,
        )

        self.config = hf_config(layer.cfg)
        with torch.device("meta"):
            attn = DeepseekV3Attention(self.config, layer_idx=0)
        weights = {k: v for k, v in layer.state_dict().items() if not k.startswith("rope.")}
        missing, unexpected = attn.load_state_dict(weights, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"transformers layer does not match: missing {missing}, unexpected {unexpected}")
        self.attn = attn.eval()
        self.rotary = DeepseekV3RotaryEmbedding(self.config).to(layer.device)
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(attn.forward).parameters else "past_key_values"
        )

    def new_cache(self, c_kv: torch.Tensor, k_pe: torch.Tensor):
        """A DynamicCache holding `c_kv` [B,T,L] and `k_pe` [B,T,dr] as transformers stores them."""
        from transformers import DynamicCache

        cache = DynamicCache()
        if c_kv.shape[1]:
            cache.update(c_kv[:, None].clone(), k_pe[:, None].clone(), 0)
        return cache

    def inputs(self, hidden: torch.Tensor, cached: int):
        """(cos, sin) and the attention mask for new tokens at positions cached.. (outside the timing)."""
        batch, new, _ = hidden.shape
        positions = cached + torch.arange(new, device=hidden.device)
        cos_sin = self.rotary(hidden, positions[None].expand(batch, new))
        mask = None
        if new > 1:
            keys = torch.arange(cached + new, device=hidden.device)
            mask = (keys[None, :] <= positions[:, None])[None, None].expand(batch, 1, new, cached + new)
        return cos_sin, mask

    def step(self, hidden, cache, cos_sin, mask) -> torch.Tensor:
        out, _ = self.attn(hidden, cos_sin, mask, **{self._cache_kw: cache})
        return out

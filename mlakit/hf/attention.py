"""PatchedMLAAttention: a transformers MLA attention layer that runs mlakit's ops over its latent cache.

It holds the very submodules of the layer it replaces (same parameters, same state_dict keys), rotates
with the model's own rope function and `position_embeddings` (so rotated queries and keys are
bit-identical to transformers'), writes the latent to transformers' cache exactly as the original
does, then attends with absorb or materialize instead of re-expanding every cached token.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from mlakit.attention import MLAAttention, project_unrotated
from mlakit.config import MLAConfig
from mlakit.dispatch import check_mode, choose
from mlakit.ops import absorb, materialize

# attention class name → (its modeling module, rope convention)
SUPPORTED_ATTENTION = {
    "DeepseekV2Attention": ("transformers.models.deepseek_v2.modeling_deepseek_v2", "complex"),
    "DeepseekV3Attention": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "cos_sin"),
    "Glm4MoeLiteAttention": ("transformers.models.glm4_moe_lite.modeling_glm4_moe_lite", "cos_sin"),
    "MiniCPM3Attention": ("transformers.models.minicpm3.modeling_minicpm3", "half"),
}
SUBMODULES = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def is_supported_attention(module: nn.Module) -> bool:
    entry = SUPPORTED_ATTENTION.get(type(module).__name__)
    return entry is not None and type(module).__module__ == entry[0]


class PatchedMLAAttention(nn.Module):
    """Drop-in for a supported transformers attention; `original` is kept (outside the module tree)
    so that `mlakit.hf.unpatch` can put it back."""

    def __init__(self, original: nn.Module, mode: str = "auto"):
        super().__init__()
        check_mode(mode)
        module_path, self.rope_kind = self.family_of(original)
        self.rope_module = sys.modules[module_path]
        for name in SUBMODULES:
            sub = getattr(original, name, None)
            if sub is not None:
                setattr(self, name, sub)
        self.config = original.config
        self.layer_idx = original.layer_idx
        self.scaling = original.scaling
        self.is_causal = True
        self.cfg = MLAConfig(
            hidden_size=original.hidden_size,
            num_heads=original.num_heads,
            q_lora_rank=original.q_lora_rank,
            kv_lora_rank=original.kv_lora_rank,
            qk_nope_head_dim=original.qk_nope_head_dim,
            qk_rope_head_dim=original.qk_rope_head_dim,
            v_head_dim=original.v_head_dim,
            name=type(original).__name__,
        )
        self.mode = mode
        self.last_mode: str | None = None
        self.train(original.training)
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self._derived_key: tuple | None = None
        # a plain attribute, not a submodule: state_dict and parameters() must not see it twice
        self.__dict__["original"] = original

    @classmethod
    def family_of(cls, original: nn.Module) -> tuple[str, str]:
        """(modeling module, rope convention) of the attention this class replaces."""
        return SUPPORTED_ATTENTION[type(original).__name__]

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings=None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        self._check_call(position_embeddings, kwargs)
        batch, new, _ = hidden_states.shape
        past, total = cached_tokens(cache, self.layer_idx, new)
        key_mask = key_padding(attention_mask, batch, new, past + new, total)
        q_nope, q_rot, c_kv, k_rot = self._project(hidden_states, position_embeddings)
        if cache is not None:
            c_kv, k_rot = cache.update(c_kv, k_rot, self.layer_idx, kwargs=kwargs)
        run = choose(self.cfg, new, past) if self.mode == "auto" else self.mode
        kv_lens = torch.full((batch,), past + new, dtype=torch.long)
        out = self._attend(run, q_nope, q_rot, c_kv[:, 0], k_rot[:, 0], kv_lens, key_mask)
        self.last_mode = run
        return self.o_proj(out.reshape(batch, new, -1)), None

    def _project(self, hidden_states, position_embeddings):
        """q_nope [B,S,H,dn], q_rot [B,S,H,dr] (rotated), c_kv [B,1,S,L], k_rot [B,1,S,dr] (rotated)."""
        cfg = self.cfg
        batch, new, _ = hidden_states.shape
        q_nope, q_rot, c_kv, k_rot = project_unrotated(self, cfg, hidden_states)
        # the cache layout transformers uses: single-head 4D latents
        c_kv = c_kv.view(batch, 1, new, cfg.kv_lora_rank)
        k_rot = k_rot.view(batch, 1, new, cfg.qk_rope_head_dim)
        q_rot, k_rot = self._rotate(q_rot.transpose(1, 2), k_rot, position_embeddings)
        return q_nope, q_rot.transpose(1, 2), c_kv, k_rot

    def _rotate(self, q_rot, k_rot, position_embeddings):
        """The model's own rope on q [B,H,S,dr] and k [B,1,S,dr]."""
        m = self.rope_module
        if self.rope_kind == "complex":
            return m.apply_rotary_emb(q_rot, k_rot, position_embeddings.to(q_rot.device))
        cos, sin = position_embeddings
        if self.rope_kind == "cos_sin" and self.config.rope_interleave:
            return m.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        return m.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)

    def _attend(self, run, q_nope, q_rot, c_kv, k_rot, kv_lens, key_mask) -> torch.Tensor:
        w_uk, w_uv = self.up_weights()
        if run == "absorb":
            out, _ = absorb(q_nope, q_rot, c_kv, k_rot, kv_lens, w_uk, w_uv, self.scaling, key_mask=key_mask)
        else:
            out, _ = materialize(
                q_nope,
                q_rot,
                c_kv,
                k_rot,
                kv_lens,
                w_uk,
                w_uv,
                self.scaling,
                key_mask=key_mask,
                need_lse=False,
            )
        return out  # [B, S, H, dv]

    # the same derived, compute-dtype copies of W_UK and W_UV as mlakit's own layer keeps
    up_weights = MLAAttention.up_weights

    def _check_call(self, position_embeddings, kwargs) -> None:
        impl = self.config._attn_implementation
        if impl not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attention implementation {impl!r} is not supported by mlakit.hf; expected one of "
                f"{ATTN_IMPLEMENTATIONS} (model.set_attn_implementation('sdpa'))"
            )
        if kwargs.get("output_attentions") or getattr(self.config, "output_attentions", False):
            raise ValueError(
                "output_attentions=True is not supported by a patched model (mlakit never forms the "
                "per-head weights); call mlakit.hf.unpatch(model) first"
            )
        if self.training and self.config.attention_dropout:
            raise ValueError(
                f"attention_dropout={self.config.attention_dropout} in training mode is not supported "
                "by mlakit.hf; call model.eval() or unpatch"
            )
        if position_embeddings is None:
            raise ValueError("position_embeddings is None; the decoder layer must pass the model's rope")

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, mode={self.mode!r}, original={type(self.original).__name__}"


def cached_tokens(cache, layer_idx: int, new: int) -> tuple[int, int]:
    """(tokens already cached for this layer, keys the returned cache view will hold); raises for a
    cache mlakit cannot serve, before anything is written."""
    if cache is None:
        return 0, new
    from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache, StaticLayer

    if type(cache) not in (DynamicCache, StaticCache) or getattr(cache, "offloading", False):
        raise ValueError(
            f"cache of type {type(cache).__name__} (offloading={getattr(cache, 'offloading', False)}) is not "
            "supported by mlakit.hf; expected a DynamicCache or StaticCache without offloading"
        )
    layers = cache.layers
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    kind = type(layer) if layer is not None else cache.layer_class_to_replicate
    if kind is DynamicLayer:
        past = layer.get_seq_length() if layer is not None else 0
        return past, past + new
    if kind is StaticLayer and layer is not None:
        past = int(layer.get_seq_length())
        if past + new > layer.max_cache_len:
            raise ValueError(
                f"static cache layer {layer_idx} holds {past} of {layer.max_cache_len} tokens; "
                f"{new} more do not fit"
            )
        return past, layer.max_cache_len
    raise ValueError(
        f"cache layer {layer_idx} of type {getattr(kind, '__name__', kind)} is not supported by mlakit.hf; "
        "expected DynamicLayer or StaticLayer (no sliding window, quantization or linear attention)"
    )


def key_padding(mask, batch: int, new: int, context: int, total: int) -> torch.Tensor | None:
    """key_mask [B, total] (False: a padding key) from the mask transformers hands the attention.

    The mask must be causal-with-padding: query i (position context-new+i) sees key j iff j <= its
    position and j is not padding. Anything else (packed sequences, custom masks) raises rather than
    being served wrongly. Returns None when no key is hidden beyond causality.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(
            f"attention_mask reached the attention as {type(mask).__name__} "
            f"{tuple(getattr(mask, 'shape', ()))}; mlakit.hf expects None or a 4D [B,1,S,T] tensor"
        )
    b, heads, q, t = mask.shape
    if b not in (1, batch) or heads != 1 or q != new or t != total:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}, expected ({batch}, 1, {new}, {total})"
        )
    allowed = mask[:, 0] if mask.dtype == torch.bool else _allowed_from_additive(mask[:, 0])  # [b, S, T]
    keys = allowed.any(dim=1)  # [b, T]
    query_pos = context - new + torch.arange(new, device=mask.device)
    causal = torch.arange(total, device=mask.device)[None, :] <= query_pos[:, None]  # [S, T]
    if not torch.equal(allowed, causal[None] & keys[:, None]):
        raise ValueError(
            "attention_mask is not a causal mask with key padding (packed sequences, bidirectional or "
            "custom masks are not supported by mlakit.hf)"
        )
    keys = keys.expand(batch, total)
    if bool(keys[:, :context].all()):
        return None
    return keys


def _allowed_from_additive(mask: torch.Tensor) -> torch.Tensor:
    """An eager mask holds 0 (attend) or the dtype's minimum (hide); any other bias is refused."""
    allowed = mask == 0
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    if not bool((allowed | hidden).all()):
        raise ValueError(
            "attention_mask holds additive biases other than 0 and -inf; not supported by mlakit.hf"
        )
    return allowed

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
from mlakit.hf.families import FAMILIES, supported
from mlakit.hf.masks import check_mask_shape, key_padding, split_mask  # noqa: F401 (key_padding: API)
from mlakit.hf.traced import (
    absorb_masked,
    causal_mask,
    is_traced,
    materialize_masked,
    traced_mode,
)
from mlakit.ops import absorb, materialize

# attention class name → (its modeling module, rope convention), for the families mlakit patches
SUPPORTED_ATTENTION = {name: (FAMILIES[name].modeling_module, FAMILIES[name].rope) for name in supported()}
SUBMODULES = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
    "g_proj",
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
        self.family = FAMILIES[type(original).__name__]
        self.rope_module = sys.modules[module_path]
        for name in SUBMODULES:
            sub = getattr(original, name, None)
            if sub is not None:
                setattr(self, name, sub)
        self.config = original.config
        self.layer_idx = original.layer_idx
        self.scaling = original.scaling
        self._derived = None  # the buffer up_weights converts bf16 weights into (CPU without native bf16)
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
        # a plain attribute, not a submodule: state_dict and parameters() must not see it twice
        self.__dict__["original"] = original
        record_weights(self)

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        self._check_call(position_embeddings, kwargs)
        batch, new, _ = hidden_states.shape
        past, total, context, key_mask = self._keys(cache, attention_mask, batch, new, kwargs)
        q_nope, q_rot, c_kv, k_rot = self._project(hidden_states, position_embeddings, kwargs)
        if cache is not None:
            c_kv, k_rot = cache.update(c_kv, k_rot, self.layer_idx, kwargs=kwargs)
        c_kv, k_rot = c_kv[:, 0], k_rot[:, 0]
        weights = None
        if past is None:
            mask = self._full_mask(attention_mask, cache, batch, new, total, q_nope.device)
            run, out, weights = self._attend_masked(q_nope, q_rot, c_kv, k_rot, mask, context, kwargs)
        else:
            run = choose(self.cfg, new, past) if self.mode == "auto" else self.mode
            kv_lens = torch.full((batch,), past + new, dtype=torch.long)
            out = self._attend(run, q_nope, q_rot, c_kv, k_rot, kv_lens, key_mask)
        self.last_mode = run
        return self.o_proj(self._gate(hidden_states, out).reshape(batch, new, -1)), weights

    def _keys(self, cache, mask, batch: int, new: int, kwargs, cached=None):
        """(past or None, keys T of the cache view, context for the path, key_mask) before anything is
        written. past None: the masked route (`mlakit.hf.traced`) — under torch.compile/export, for
        a mask that is not causal + key padding (packed, tree, custom), or when the weights are asked
        for; else the eager route over row lengths. `cached`: `cached_tokens` / `key_length` twins."""
        lengths, static_length = cached or (cached_tokens, key_length)
        if is_traced():
            total, context = static_length(cache, self.layer_idx, new)
            check_mask_shape(mask, batch, new, total)
            return None, total, context, None
        past, total = lengths(cache, self.layer_idx, new)
        plain, key_mask = split_mask(mask, batch, new, past + new, total)
        if plain and not self.wants_weights(kwargs):
            return past, total, past, key_mask
        return None, total, past, None

    def wants_weights(self, kwargs) -> bool:
        """output_attentions asked (call or config) under the eager implementation: transformers' sdpa
        returns no weights, so neither does a patched sdpa model."""
        asked = kwargs.get("output_attentions") or getattr(self.config, "output_attentions", False)
        return bool(asked) and self.config._attn_implementation == "eager"

    def _full_mask(self, mask, cache, batch: int, new: int, total: int, device) -> torch.Tensor:
        """transformers' 4D mask, or the causal one it stands for when None (read after the write: a
        StaticCache's count is then a 0-dim tensor, a DynamicCache's the key length)."""
        if mask is not None:
            return mask
        written = cache.layers[self.layer_idx].get_seq_length() if cache is not None else total
        return causal_mask(batch, new, total, written, device)

    def _attend_masked(self, q_nope, q_rot, c_kv, k_rot, mask, context, kwargs):
        """(path, out [B,S,H,dv], weights [B,H,S,T] or None) over every key of the cache view,
        the mask applied as is; the path from the new-token count and `context` (see `key_length`)."""
        new = q_nope.shape[1]
        run = traced_mode(self.cfg, new, context) if self.mode == "auto" else self.mode
        attend = absorb_masked if run == "absorb" else materialize_masked
        w_uk, w_uv = self.up_weights()
        need = self.wants_weights(kwargs)
        got = attend(q_nope, q_rot, c_kv, k_rot, w_uk, w_uv, self.scaling, mask, need_weights=need)
        return (run, *got) if need else (run, got, None)

    def _project(self, hidden_states, position_embeddings, kwargs):
        """q_nope [B,S,H,dn], q_rot [B,S,H,dr] (rotated), c_kv [B,1,S,L], k_rot [B,1,S,dr] (rotated)."""
        cfg = self.cfg
        batch, new, _ = hidden_states.shape
        q_nope, q_rot, c_kv, k_rot = project_unrotated(self, cfg, hidden_states)
        q_nope, q_rot, c_kv = self._family_scales(q_nope, q_rot, c_kv)
        # the cache layout transformers uses: single-head 4D latents
        c_kv = c_kv.view(batch, 1, new, cfg.kv_lora_rank)
        k_rot = k_rot.view(batch, 1, new, cfg.qk_rope_head_dim)
        q_rot, k_rot = self._rotate(q_rot.transpose(1, 2), k_rot, position_embeddings)
        q_rot = q_rot.transpose(1, 2)
        if self.family.query_position_scale:
            q_nope, q_rot = self._position_scale(q_nope, q_rot, kwargs.get("position_ids"))
        return q_nope, q_rot, c_kv, k_rot

    def _family_scales(self, q_nope, q_rot, c_kv):
        """LongCat-Flash's LoRA scales: q × s_q before rope, the normalized latent × s_kv (as cached)."""
        f, original = self.family, self.original
        if f.q_scale is not None:
            s = getattr(original, f.q_scale)
            q_nope, q_rot = q_nope * s, q_rot * s
        if f.kv_scale is not None:
            c_kv = c_kv * getattr(original, f.kv_scale)
        return q_nope, q_rot, c_kv

    def _position_scale(self, q_nope, q_rot, position_ids):
        """Mistral 4's Llama-4 query scale per position, with the model's own function."""
        if position_ids is None:
            name = type(self.original).__name__
            raise ValueError(f"{name} needs position_ids for its query scale; got position_ids=None")
        params = self.config.rope_parameters
        scale = self.rope_module.get_llama_4_attn_scale(
            position_ids, params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
        )  # [B, 1, S, 1]
        scale = scale.transpose(1, 2).to(q_nope.dtype)  # [B, S, 1, 1]
        return q_nope * scale, q_rot * scale

    def _gate(self, hidden_states, out):
        """Bailing's per-head output gate: out [B,S,H,dv] × sigmoid(g_proj(hidden)) [B,S,H,1]."""
        if self.family.head_gate is None:
            return out
        gate = getattr(self, self.family.head_gate)(hidden_states)
        return out * torch.sigmoid(gate.float()).to(hidden_states.dtype).unsqueeze(-1)

    def _rotate(self, q_rot, k_rot, position_embeddings):
        """The model's own rope on q [B,H,S,dr] and k [B,1,S,dr]."""
        m = self.rope_module
        if self.rope_kind == "none":
            return q_rot, k_rot
        if self.rope_kind == "complex":
            return m.apply_rotary_emb(q_rot, k_rot, position_embeddings.to(q_rot.device))
        cos, sin = position_embeddings
        if self.rope_kind == "interleave" or (self.rope_kind == "config" and self.config.rope_interleave):
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

    # W_UK and W_UV as mlakit's own layer derives them: views (or compute-dtype copies), never stale
    up_weights = MLAAttention.up_weights
    _converted = MLAAttention._converted

    def _check_call(self, position_embeddings, kwargs) -> None:
        impl = self.config._attn_implementation
        if impl not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attention implementation {impl!r} is not supported by mlakit.hf; expected one of "
                f"{ATTN_IMPLEMENTATIONS} (model.set_attn_implementation('sdpa'))"
            )
        if self.training and self.config.attention_dropout:
            raise ValueError(
                f"attention_dropout={self.config.attention_dropout} in training mode is not supported "
                "by mlakit.hf; call model.eval() or unpatch"
            )
        if position_embeddings is None and self.rope_kind != "none":
            raise ValueError("position_embeddings is None; the decoder layer must pass the model's rope")

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, mode={self.mode!r}, original={type(self.original).__name__}"


def record_weights(module: nn.Module) -> None:
    """transformers records `output_attentions` with a forward hook on every module of the attention
    class (`_can_record_outputs["attentions"]`: output 1); a patched layer is not of that class, so it
    carries the same hook itself (inactive unless a forward asks for the weights)."""
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError:  # a transformers without output capturing records nothing this way
        return
    install_output_capuring_hook(module, "attentions", 1)


def cached_tokens(cache, layer_idx: int, new: int) -> tuple[int, int]:
    """(tokens already cached for this layer, keys the returned cache view will hold); raises for a
    cache mlakit cannot serve, before anything is written."""
    layer, kind = cache_layer(cache, layer_idx)
    if kind is None:
        return 0, new
    if kind == "dynamic":
        past = layer.get_seq_length() if layer is not None else 0
        return past, past + new
    past = int(layer.get_seq_length())
    if past + new > layer.max_cache_len:
        raise ValueError(
            f"static cache layer {layer_idx} holds {past} of {layer.max_cache_len} tokens; "
            f"{new} more do not fit"
        )
    return past, layer.max_cache_len


def key_length(cache, layer_idx: int, new: int) -> tuple[int, int | None]:
    """(keys the returned cache view will hold, the context the path is chosen for) from sizes and
    types alone: nothing is read from a tensor (a StaticCache that overflows fails in transformers'
    own write). The context is a StaticCache's fixed length, or None for a DynamicCache, whose length
    changes every step (and is symbolic once dynamo generalizes it): the long-context crossover."""
    layer, kind = cache_layer(cache, layer_idx)
    if kind is None:
        return new, 0
    if kind == "dynamic":
        return (layer.get_seq_length() if layer is not None else 0) + new, None
    return layer.max_cache_len, layer.max_cache_len


def cache_layer(cache, layer_idx: int) -> tuple[object | None, str | None]:
    """(the cache layer or None when not built yet, "dynamic" | "static" | None without a cache); raises
    for a cache mlakit cannot serve. Reads types and Python attributes only."""
    if cache is None:
        return None, None
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
        return layer, "dynamic"
    if kind is StaticLayer and layer is not None:
        return layer, "static"
    raise ValueError(
        f"cache layer {layer_idx} of type {getattr(kind, '__name__', kind)} is not supported by mlakit.hf; "
        "expected DynamicLayer or StaticLayer (no sliding window, quantization or linear attention)"
    )

"""The engine's eager forward without transformers' model code, for the families whose model forward is
embeddings -> per layer h + attn(norm(h)), then h + mlp(norm(h)) -> final norm (DeepSeek-V2, DeepSeek-V3
and Kimi K2, GLM-4.7-Flash): the same modules, called in the same order on the same tensors, so the
same numbers (tests/test_engine_loop.py compares them bit for bit with the model's own forward). What it
leaves out is per-step work the engine never uses: rotary tables (mlakit's layers read the plan's),
the causal-mask and output-capture plumbing, keyword arguments forwarded through every decoder layer,
the attention slot's tuple, and the attention layer's checks of a caller's plan (`MLAAttention.engine_run`:
the engine made the plan). Decode steps' layers go through mlakit/engine/decode.py where they can: two
C++ calls a layer where its weights are packed bf16 (`fused_layer`, `fused_moe`), else the attention's
ops with its per-call choices taken once (`absorb_in_place`; kv_b_proj packed, the fused core). A
32-row decode step of the demo model before the fused calls (bf16, AMD EPYC Zen 4, steps of the three
forms alternating in one process; medians / minima, ms): two threads, the model's forward 63.9 / 56.7,
the loop 62.1 / 56.3, with absorb_in_place 61.7 / 54.3; one thread's CPU time 116.8 / 104.6, 116.3 /
99.8, 114.2 / 97.2 (run to run, this machine's step times moved by 10-15%).

Families whose forward differs (MiniCPM3's scaled residuals, DSA's shared top-k in V3.2 / GLM-5) keep
the model's forward, and so does any step where a bypassed module (the model, a decoder layer, an
attention slot) has hooks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

from mlakit.engine.decode import absorb_in_place, fused_layer, fused_moe, plan_fits, step_args
from mlakit.linear import call

# the inner model's class -> its decoder layer's: forwards checked to be the loop below
LOOP_FAMILIES = {
    "DeepseekV3Model": "DeepseekV3DecoderLayer",
    "DeepseekV2Model": "DeepseekV2DecoderLayer",
    "Glm4MoeLiteModel": "Glm4MoeLiteDecoderLayer",
}


class DecoderLoop:
    """Runs a planned step through a served model's modules: `loop(ids [N], keep [K])` -> the final
    hidden states of the kept rows [K, D] (what `ModelRunner.forward` returns)."""

    def __init__(self, model: nn.Module, mlas: list[nn.Module]):
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.layers = [
            (layer.input_layernorm, mla, layer.post_attention_layernorm, layer.mlp)
            for layer, mla in zip(inner.layers, mlas, strict=True)
        ]
        # modules whose forward the loop replaces: a hook on any of them sends the step back to it
        self.bypassed = [model, inner, *inner.layers, *(layer.self_attn for layer in inner.layers)]

    @classmethod
    def build(cls, model: nn.Module, mlas: list[nn.Module]) -> DecoderLoop | None:
        """The loop for `model` (a causal LM whose attention slots hold `mlas`, one per layer), or None
        where its family's forward is not the loop's."""
        inner = getattr(model, "model", None)
        layer_kind = LOOP_FAMILIES.get(type(inner).__name__)
        if layer_kind is None or not _transformers_class(inner):
            return None
        prefix = type(inner).__name__[: -len("Model")]
        if type(model).__name__ != f"{prefix}ForCausalLM" or not _transformers_class(model):
            return None
        layers = list(inner.layers)
        if len(layers) != len(mlas) or len(layers) != inner.config.num_hidden_layers:
            return None
        for layer in layers:
            if type(layer).__name__ != layer_kind or not _transformers_class(layer):
                return None
            if "forward" in vars(layer):  # an instance-level forward replaces the class's
                return None
        return cls(model, mlas)

    def hooked(self) -> bool:
        """Whether a hook would run in the model's own forward that the loop skips."""
        if (
            _module._global_forward_pre_hooks
            or _module._global_forward_hooks
            or _module._global_backward_hooks
            or _module._global_backward_pre_hooks
        ):
            return True
        return any(m._forward_pre_hooks or m._forward_hooks for m in self.bypassed)

    def __call__(self, plan, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = call(self.embed, ids)  # [N, D]
        decode = plan_fits(plan)
        step = step_args(plan, h.shape[0]) if decode else None
        for norm_in, mla, norm_post, mlp in self.layers:
            fused = None if step is None else fused_layer(mla, norm_in, norm_post, h, plan, step)
            if fused is None:
                x = call(norm_in, h)
                out = absorb_in_place(mla, x, plan) if decode else None
                h = h + (mla.engine_run(x, plan) if out is None else out)
                x = call(norm_post, h)
                h = h + call(mlp, x)
            else:
                h, x = fused
                moe = fused_moe(mlp, h, x)
                h = h + call(mlp, x) if moe is None else moe
        # the norm is per row: the kept rows alone, as the model's norm over all then the head's slice
        return call(self.norm, h.index_select(0, keep))


def _transformers_class(m: nn.Module) -> bool:
    return type(m).__module__.startswith("transformers.models.")

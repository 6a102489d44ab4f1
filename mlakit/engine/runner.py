"""ModelRunner: the only part of the engine that holds tensors.

The model runs its own transformers forward (embeddings, norms, MLP/MoE, lm_head, every family's
scales), its attention modules replaced by `EngineAttention`: mlakit `MLAAttention` layers sharing the
original weights, all reading one `StepPlan` over one `PagedLatentCache`. The decoder layers see the
step's tokens packed ([1, N, D]: no padding in the MLP); each attention scatters them into the plan's
rectangle [B, S, D], runs `layer(h, plan)` and gathers them back.
"""

from __future__ import annotations

import torch
from torch import nn

from mlakit.attention import MLAAttention
from mlakit.config import MLAConfig

# attention classes the engine serves (transformers' names); every other MLA family is refused by name
ENGINE_ATTENTION = (
    "DeepseekV3Attention",
    "DeepseekV32Attention",
    "GlmMoeDsaAttention",
    "Glm4MoeLiteAttention",
    "MiniCPM3Attention",
    "DeepseekV2Attention",
)


class StepContext:
    """What every EngineAttention of one step reads (set by the runner before the forward)."""

    plan = None
    pack: torch.Tensor | None = None  # [N] long: flat index of each packed token in [B * S]


class EngineAttention(nn.Module):
    """A transformers attention slot holding an mlakit layer; returns what the decoder layer unpacks."""

    def __init__(self, mla: MLAAttention, ctx: StepContext, returns_indices: bool):
        super().__init__()
        self.mla = mla
        self.ctx = ctx
        self.returns_indices = returns_indices

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        plan, pack = self.ctx.plan, self.ctx.pack
        if plan is None:
            raise RuntimeError(
                "this model belongs to an mlakit.engine LLM/LLMEngine (its attention reads the engine's "
                "paged cache): generate through the engine, or pass a copy (copy.deepcopy) to keep one "
                "for transformers"
            )
        width = hidden_states.shape[-1]
        flat = hidden_states.reshape(-1, width)  # [N, D]
        if pack is None:
            out = self.mla(flat.view(plan.batch, plan.seq_len, width), plan)
        else:
            padded = flat.new_zeros(plan.batch * plan.seq_len, width).index_copy_(0, pack, flat)
            out = self.mla(padded.view(plan.batch, plan.seq_len, width), plan)
            out = out.reshape(-1, width).index_select(0, pack)
        out = out.reshape(hidden_states.shape)
        return (out, None, None) if self.returns_indices else (out, None)


def check_family(model: nn.Module) -> tuple[MLAConfig, list[nn.Module]]:
    """(MLAConfig, the decoder layers) of a model the engine serves; ValueError naming the family else."""
    from mlakit.hf.families import FAMILIES

    layers = getattr(getattr(model, "model", None), "layers", None)
    name = type(model).__name__
    if layers is None or len(layers) == 0:
        raise ValueError(f"model {name} has no decoder layers (model.model.layers); expected a causal LM")
    kinds = {type(layer.self_attn).__name__ for layer in layers}
    for kind in kinds:
        if kind not in ENGINE_ATTENTION:
            why = FAMILIES[kind].refused if kind in FAMILIES else "not an MLA attention"
            raise ValueError(
                f"model family {name} (attention {kind}) is not served by mlakit.engine: "
                f"{why or 'not supported by the engine yet'}; served: {', '.join(ENGINE_ATTENTION)}"
            )
    for layer in layers:
        if hasattr(layer.self_attn, "indexer") and layer.self_attn.indexer is None:
            raise ValueError(
                f"model family {name}: layers that share the previous layer's top-k (index_topk_pattern) "
                "are not served by mlakit.engine yet"
            )
    return MLAConfig.from_hf(model.config), list(layers)


class ModelRunner:
    """Runs one planned step of `model` and returns the logits of the rows that sample."""

    def __init__(self, model: nn.Module):
        self.model = model.eval()
        self.cfg, layers = check_family(model)
        self.ctx = StepContext()
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.layers = []
        for i, layer in enumerate(layers):
            original = layer.self_attn
            mla = MLAAttention(self.cfg, layer_idx=i, device="meta", dtype=self.dtype)
            mla.load_state_dict(original.state_dict(), strict=True, assign=True)
            mla.eval()
            returns = type(original).__name__ == "GlmMoeDsaAttention"
            layer.self_attn = EngineAttention(mla, self.ctx, returns)
            self.layers.append(mla)
        self.vocab_size = model.config.vocab_size
        self._mask = torch.zeros(1, 1, 1, 1, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, plan, ids: list[int], positions: list[int], pack: list[int] | None, keep: list[int]):
        """Logits [len(keep), V] (fp32) of the packed tokens at `keep` after one step of the plan."""
        dev = self.device
        self.ctx.plan = plan
        self.ctx.pack = None if pack is None else torch.tensor(pack, dtype=torch.long, device=dev)
        try:
            out = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
                position_ids=torch.tensor([positions], dtype=torch.long, device=dev),
                # a 4D mask makes transformers skip building one; the mlakit layers mask by the plan
                attention_mask=self._mask,
                use_cache=False,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
            )
        finally:
            self.ctx.plan = self.ctx.pack = None
        return out.logits[0].float()

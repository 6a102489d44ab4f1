"""ModelRunner: the only part of the engine that holds tensors.

The model runs its own transformers forward (embeddings, norms, MLP/MoE, lm_head, every family's
scales), its attention modules replaced by `EngineAttention`: mlakit `MLAAttention` layers sharing the
original weights, all reading one `StepPlan` over one `PagedLatentCache`. The step's tokens are packed
end to end ([1, N, D] through the decoder layers, [N, D] into each attention, N the real token count,
in the plan's row order: decode -> extend -> prefill); no padding anywhere. The forward hands back the final
hidden states of the rows the engine keeps (the model's lm_head is skipped); the runner applies the
head itself, a slice of rows at a time, so prompt log-probabilities over a whole chunk stay bounded.
"""

from __future__ import annotations

import torch
from torch import nn

from mlakit.attention import MLAAttention
from mlakit.config import MLAConfig
from mlakit.engine.moe import install_moe
from mlakit.engine.packed import pack_model

# rows of logits materialized at a time for prompt log-probabilities: 256 x 129,280 (DeepSeek-V3's
# vocabulary) fp32 is 132 MB, where a 2,048-token chunk at once would be 1.06 GB
LOGPROB_ROWS = 256
# eager bf16 CPU steps run their GEMMs on oneDNN-prepacked weights (mlakit/engine/packed.py); tests
# turn it off to compare
PACK = True

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


class EngineAttention(nn.Module):
    """A transformers attention slot holding an mlakit layer; returns what the decoder layer unpacks."""

    def __init__(self, mla: MLAAttention, ctx: StepContext, returns_indices: bool):
        super().__init__()
        self.mla = mla
        self.ctx = ctx
        self.returns_indices = returns_indices

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        plan = self.ctx.plan
        if plan is None:
            raise RuntimeError(
                "this model belongs to an mlakit.engine LLM/LLMEngine (its attention reads the engine's "
                "paged cache): generate through the engine, or pass a copy (copy.deepcopy) to keep one "
                "for transformers"
            )
        out = self.mla(hidden_states.view(-1, hidden_states.shape[-1]), plan).view(hidden_states.shape)
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
    """Runs one planned step of `model`; hidden states of the kept rows -> logits, log-probabilities."""

    def __init__(self, model: nn.Module):
        self.model = model.eval()
        self.cfg, layers = check_family(model)
        self.head = getattr(model, "lm_head", None)
        if not isinstance(self.head, nn.Module):
            raise ValueError(f"model {type(model).__name__} has no lm_head module; expected a causal LM")
        self._through = nn.Identity()
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
        self.moe_blocks = install_moe(model)
        # linears and experts prepacked where bf16 runs natively on this CPU (0: none, plain GEMMs)
        self.packed_modules = pack_model(model) if PACK else 0
        self.head = model.lm_head
        self.vocab_size = model.config.vocab_size
        self._mask = torch.zeros(1, 1, 1, 1, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, plan, ids: list[int], positions: list[int], keep: list[int]):
        """Hidden states [len(keep), D] (model dtype) of the packed tokens at `keep` after one step of the
        plan (`ids`, `positions`: its tokens in the plan's order): what the lm_head would read (the
        model's final norm and its family's scale applied)."""
        dev = self.device
        self.ctx.plan = plan
        # every served family's last op is `lm_head(hidden[:, keep])`: skipped here, applied by `logits`
        self.model.lm_head = self._through
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
            self.model.lm_head = self.head
            self.ctx.plan = None
        return out.logits[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, D] -> [M, V] fp32."""
        return self.head(hidden).float()

    @torch.inference_mode()
    def token_logprobs(self, hidden: torch.Tensor, targets: list[int], k: int):
        """Log-probabilities of `targets` under each row's distribution, and each row's top-k: lists of
        R floats, R lists of k floats, R lists of k ids, computed LOGPROB_ROWS rows at a time."""
        chosen, values, indices = [], [], []
        target = torch.tensor(targets, dtype=torch.long, device=hidden.device)
        for lo in range(0, hidden.shape[0], LOGPROB_ROWS):
            lp = self.logits(hidden[lo : lo + LOGPROB_ROWS]).log_softmax(-1)  # [r, V]
            chosen += lp.gather(1, target[lo : lo + LOGPROB_ROWS, None])[:, 0].tolist()
            if k:
                top = lp.topk(min(k, lp.shape[-1]), dim=-1)
                values += top.values.tolist()
                indices += top.indices.tolist()
        if not k:
            values = indices = [[] for _ in targets]
        return chosen, values, indices

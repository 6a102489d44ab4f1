"""patch(model) / unpatch(model): swap a transformers model's MLA attentions for mlakit's and back."""

from __future__ import annotations

from torch import nn

from mlakit.dispatch import check_mode
from mlakit.hf.attention import PatchedMLAAttention, is_supported_attention
from mlakit.hf.dsa import DSA_MODELS, PatchedDSAAttention, is_dsa_attention

SUPPORTED_MODELS = (
    "DeepseekV2ForCausalLM",
    "DeepseekV2Model",
    "DeepseekV3ForCausalLM",
    "DeepseekV3Model",
    "Glm4MoeLiteForCausalLM",
    "Glm4MoeLiteModel",
    "MiniCPM3ForCausalLM",
    "MiniCPM3Model",
    *DSA_MODELS,
)

__all__ = ["SUPPORTED_MODELS", "is_patched", "patch", "unpatch"]


def patch(model: nn.Module, *, mode: str = "auto") -> nn.Module:
    """Replace every supported MLA attention of `model` with a `PatchedMLAAttention` sharing its weights.

    `mode` is "auto" (the cost model picks per call: absorb for decode, materialize for long prefill),
    "absorb" or "materialize". Patching a patched model only updates the mode. Returns `model`.
    """
    check_mode(mode)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sites = _attention_sites(model)
    if not sites:
        raise ValueError(
            f"{type(model).__name__} has no MLA attention layer mlakit can patch; supported models: "
            f"{', '.join(SUPPORTED_MODELS)} (Kimi K2 loads as DeepseekV3ForCausalLM)"
        )
    # build every replacement first, so that a failure leaves the model untouched
    replacements = []
    for parent, name, child in sites:
        if isinstance(child, PatchedMLAAttention):
            child.mode = mode
        else:
            cls = PatchedDSAAttention if is_dsa_attention(child) else PatchedMLAAttention
            replacements.append((parent, name, cls(child, mode)))
    for parent, name, patched in replacements:
        setattr(parent, name, patched)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Put back the original attention modules `patch` replaced (a no-op on an unpatched model)."""
    for parent, name, child in _attention_sites(model):
        if isinstance(child, PatchedMLAAttention):
            original = child.original
            original.train(child.training)
            setattr(parent, name, original)
    return model


def is_patched(model: nn.Module) -> bool:
    """True when at least one attention of `model` runs mlakit."""
    return any(isinstance(m, PatchedMLAAttention) for m in model.modules())


def _attention_sites(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every supported or already patched attention."""
    sites = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if (
                isinstance(child, PatchedMLAAttention)
                or is_supported_attention(child)
                or is_dsa_attention(child)
            ):
                sites.append((parent, name, child))
    return sites

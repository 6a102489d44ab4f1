"""patch(model) / unpatch(model): swap a transformers model's MLA attentions for mlakit's and back.

An MLA attention is a module with a `kv_a_proj_with_mqa` projection (or a class `families.FAMILIES`
names). Each is either patched (its class is in `SUPPORTED`) or refused with the reason `REFUSED` gives
(or, for a class mlakit has never seen, "not in mlakit's family table"): `patch` raises a ValueError
naming them, or with `strict=False` patches the rest and warns with the list.
"""

from __future__ import annotations

import warnings

from torch import nn

from mlakit.dispatch import check_mode
from mlakit.hf.attention import PatchedMLAAttention, is_supported_attention
from mlakit.hf.dsa import PatchedDSAAttention, is_dsa_attention
from mlakit.hf.families import FAMILIES, V4_FAMILIES, refused, supported, supported_models
from mlakit.hf.v4 import PatchedV4Attention, is_v4_attention

# what patch() puts in place of an attention: MLA (and DSA, a subclass) or DeepSeek-V4
_PATCHED = (PatchedMLAAttention, PatchedV4Attention)

SUPPORTED = supported() + tuple(V4_FAMILIES)
REFUSED = refused()
SUPPORTED_MODELS = tuple(
    sorted(supported_models() + tuple(m for f in V4_FAMILIES.values() for m in f.models))
)
UNKNOWN_REASON = "an MLA attention (kv_a_proj_with_mqa) not in mlakit's family table"

__all__ = ["REFUSED", "SUPPORTED", "SUPPORTED_MODELS", "is_patched", "patch", "unpatch"]


def patch(model: nn.Module, *, mode: str = "auto", strict: bool = True) -> nn.Module:
    """Replace every supported MLA attention of `model` with a `PatchedMLAAttention` sharing its weights.

    `mode` is "auto" (the cost model picks per call: absorb for decode, materialize for long prefill),
    "absorb" or "materialize". Patching a patched model only updates the mode. Other layers (a hybrid's
    linear attention, a vision tower) are left alone. An MLA attention mlakit does not support raises a
    ValueError naming its class and the reason, before anything changes; `strict=False` skips those
    layers with a warning that lists them. Returns `model`.
    """
    check_mode(mode)
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True or False, got {strict!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sites, skipped = _attention_sites(model)
    if skipped and strict:
        raise ValueError(
            _refusal(model, skipped)
            + ". Nothing was patched; mlakit.hf.patch(model, strict=False) patches the other MLA layers"
        )
    if not sites:
        why = _refusal(model, skipped) + "; " if skipped else ""
        raise ValueError(
            f"{why}{type(model).__name__} has no MLA attention layer mlakit can patch; supported models: "
            f"{', '.join(SUPPORTED_MODELS)} (Kimi K2 loads as DeepseekV3ForCausalLM)"
        )
    # build every replacement first, so that a failure leaves the model untouched
    replacements = []
    for parent, name, child in sites:
        if isinstance(child, _PATCHED):
            child.mode = mode
        elif is_v4_attention(child):
            replacements.append((parent, name, PatchedV4Attention(child, mode)))
        else:
            cls = PatchedDSAAttention if is_dsa_attention(child) else PatchedMLAAttention
            replacements.append((parent, name, cls(child, mode)))
    for parent, name, patched in replacements:
        setattr(parent, name, patched)
    if skipped:
        warnings.warn(_refusal(model, skipped) + "; these layers were left unpatched", stacklevel=2)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Put back the original attention modules `patch` replaced (a no-op on an unpatched model).

    Submodules replaced on the patched layer since (a quantization or LoRA wrapper around `kv_b_proj`)
    go back with it: the original receives the patched layer's current children.
    """
    for parent, name, child in _attention_sites(model)[0]:
        if isinstance(child, PatchedV4Attention):
            setattr(parent, name, child.original)
        elif isinstance(child, PatchedMLAAttention):
            original = child.original
            for sub_name, sub in child.named_children():
                setattr(original, sub_name, sub)
            original.train(child.training)
            setattr(parent, name, original)
    return model


def is_patched(model: nn.Module) -> bool:
    """True when at least one attention of `model` runs mlakit."""
    return any(isinstance(m, _PATCHED) for m in model.modules())


def refusal_reason(module: nn.Module) -> str | None:
    """Why `module` is an MLA attention mlakit will not patch; None when it is not MLA or is supported."""
    if isinstance(module, _PATCHED) or is_supported_attention(module) or is_v4_attention(module):
        return None
    entry = FAMILIES.get(type(module).__name__)
    if entry is not None and type(module).__module__ == entry.modeling_module:
        return entry.refused or "its family is in the table but its module path differs"
    if isinstance(getattr(module, "kv_a_proj_with_mqa", None), nn.Module):
        return UNKNOWN_REASON
    return None


def _attention_sites(model: nn.Module):
    """(parent, attribute, module) of every supported or already patched attention, and
    (qualified name, class name, reason) of every MLA attention refused."""
    sites, skipped = [], []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if (
                isinstance(child, _PATCHED)
                or is_supported_attention(child)
                or is_dsa_attention(child)
                or is_v4_attention(child)
            ):
                sites.append((parent, name, child))
            elif (reason := refusal_reason(child)) is not None:
                skipped.append((f"{parent_name}.{name}".lstrip("."), type(child).__name__, reason))
    return sites, skipped


def _refusal(model: nn.Module, skipped) -> str:
    """'Model: Class: reason (N layers: a, b, c, ...); ...' grouped by class."""
    by_class: dict[str, tuple[str, list[str]]] = {}
    for where, cls, reason in skipped:
        by_class.setdefault(cls, (reason, []))[1].append(where)
    parts = []
    for cls, (reason, where) in by_class.items():
        more = ", ..." if len(where) > 3 else ""
        parts.append(f"{cls}: {reason} ({len(where)} layers: {', '.join(where[:3])}{more})")
    return f"{type(model).__name__}: " + "; ".join(parts)

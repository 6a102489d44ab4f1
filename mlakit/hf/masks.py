"""The mask transformers hands an attention, read by a patched layer: its shape checked, and whether it
is causal-with-key-padding (served from row lengths) or anything else (applied as is)."""

from __future__ import annotations

import torch


def split_mask(mask, batch: int, new: int, context: int, total: int) -> tuple[bool, torch.Tensor | None]:
    """(plain, key_mask [B, total] or None) from the mask transformers hands the attention.

    plain: the mask is causal-with-padding (query i, at position context-new+i, sees key j iff j <= its
    position and j is not padding), served from row lengths and key_mask (None when no key is hidden
    beyond causality). Anything else (packed sequences, tree or custom masks, additive biases other
    than 0 and the minimum) is not plain: the caller applies it as is.
    """
    if mask is None:
        return True, None
    check_mask_shape(mask, batch, new, total)
    allowed = mask[:, 0] if mask.dtype == torch.bool else _allowed_from_additive(mask[:, 0])  # [b, S, T]
    if allowed is None:
        return False, None
    keys = allowed.any(dim=1)  # [b, T]
    query_pos = context - new + torch.arange(new, device=mask.device)
    causal = torch.arange(total, device=mask.device)[None, :] <= query_pos[:, None]  # [S, T]
    if not torch.equal(allowed, causal[None] & keys[:, None]):
        return False, None
    keys = keys.expand(batch, total)
    if bool(keys[:, :context].all()):
        return True, None
    return True, keys


def key_padding(mask, batch: int, new: int, context: int, total: int) -> torch.Tensor | None:
    """`split_mask`'s key_mask, raising for a mask that is not causal-with-padding."""
    plain, keys = split_mask(mask, batch, new, context, total)
    if not plain:
        raise ValueError(
            "attention_mask is not a causal mask with key padding (packed sequences, bidirectional or "
            "custom masks take the masked route; key_padding serves only this form)"
        )
    return keys


def check_mask_shape(mask, batch: int, new: int, total: int) -> None:
    """None or a [B or 1, 1, S, T] tensor; anything else raises (shapes only: nothing is read)."""
    if mask is None:
        return
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


def _allowed_from_additive(mask: torch.Tensor) -> torch.Tensor | None:
    """An eager mask of 0 (attend) and the dtype's minimum (hide) as bool; None for any other bias."""
    allowed = mask == 0
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    if not bool((allowed | hidden).all()):
        return None
    return allowed

"""Log-sum-exp merge of attention computed over disjoint parts of the keys."""

from __future__ import annotations

import torch


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial (out [..., H, d], lse [..., H]) pairs into the attention over all parts.

    A part whose queries saw no key has lse -inf and weight 0.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge needs matching non-empty lists, got {len(outs)} outs and {len(lses)} lses")
    if len(outs) == 1:
        return outs[0], lses[0]
    lse_all = torch.stack(lses)  # [P, ..., H]
    total = torch.logsumexp(lse_all, dim=0)
    safe_total = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    weights = torch.exp(lse_all - safe_total)  # [P, ..., H]
    out = sum(w[..., None] * o.to(w.dtype) for w, o in zip(weights, outs, strict=True))
    return out.to(outs[0].dtype), total

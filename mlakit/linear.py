"""Linear: nn.Linear whose 16-bit GEMMs run in fp32 on CPUs without native 16-bit matmuls."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlakit.ops.common import compute_dtype

# rows from which converting weight blocks to fp32 beats torch's generic bf16 kernel (measured on a
# 2-core AVX2 EPYC: the generic kernel costs ~7 ms per row for a 2048×7168 weight, a converted block
# pass ~25 ms in all); below it the native matrix-vector path is memory-bound and fine
UPCAST_MIN_ROWS = 8
# weight rows converted at once (256 × 7168 fp32 = 7 MB)
WEIGHT_BLOCK = 256


class Linear(nn.Linear):
    """Same parameters and state dict as nn.Linear; only the arithmetic path differs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        cd = compute_dtype(w.dtype, w.device)
        rows = x.numel() // max(1, x.shape[-1])
        if cd == w.dtype or rows < UPCAST_MIN_ROWS or (torch.is_grad_enabled() and w.requires_grad):
            return super().forward(x)
        return upcast_linear(x, w, self.bias, cd)


def upcast_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cd: torch.dtype
) -> torch.Tensor:
    """x · wᵀ (+ bias) with the weight converted block by block to `cd`; output in x's dtype."""
    flat = x.reshape(-1, x.shape[-1]).to(cd)  # [N, in]
    out = torch.empty(flat.shape[0], w.shape[0], dtype=cd, device=x.device)
    for start in range(0, w.shape[0], WEIGHT_BLOCK):
        stop = min(w.shape[0], start + WEIGHT_BLOCK)
        b = None if bias is None else bias[start:stop].to(cd)
        out[:, start:stop] = F.linear(flat, w[start:stop].to(cd), b)
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

"""Linear: nn.Linear whose 16-bit GEMMs run in fp32 on CPUs without native 16-bit matmuls, and whose
bf16 products of a few rows (a decode step) run as one read of the weights on CPUs with AVX512-BF16."""

from __future__ import annotations

import torch
from torch import nn

from mlakit.ops import cpu_core
from mlakit.ops.common import compute_dtype

# rows from which converting weight blocks to fp32 beats torch's generic bf16 kernel (measured on a
# 2-core AVX2 EPYC for a 7168×16384 weight: the generic kernel costs ~40 ms per row, one converted
# pass ~400–800 ms in all, so they cross between 8 and 32 rows); fewer rows stay native
UPCAST_MIN_ROWS = 16
# weight rows converted at once (256 × 7168 fp32 = 7 MB)
WEIGHT_BLOCK = 256
# rows up to which the fused core's few-row product (`cpu_core.small_linear`) beats torch's bf16 GEMM:
# one read of the weights at 1-4 rows; from ~8 rows its dot-product form is compute-bound (measured
# on a 2-core AVX512-BF16 EPYC, DeepSeek-V3 projections: docs/mla.md)
FEW_ROWS = 4


_module = nn.modules.module


def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`m(x)`: the module's forward directly when nothing hooks into it and nothing traces (what
    `nn.Module.__call__` itself does then, two Python frames shorter: a decode step calls ~5 small
    projections per layer, where the frames cost as much as the GEMMs)."""
    if (
        m._forward_pre_hooks
        or m._forward_hooks
        or m._backward_hooks
        or m._backward_pre_hooks
        or _module._global_forward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
        or torch._C._get_tracing_state()
    ):
        return m(x)
    return m.forward(x)


class Linear(nn.Linear):
    """Same parameters and state dict as nn.Linear; only the arithmetic path differs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters
        w = params.get("weight")
        if w is None:  # parametrized: the weight is computed
            w = self.weight
        elif w.dtype is torch.float32 or w.dtype is torch.float64:
            # nothing to convert and no 16-bit few-row product: the plain GEMM, without the checks below
            return torch._C._nn.linear(x, w, params.get("bias"))
        cd = compute_dtype(w.dtype, w.device)
        rows = x.numel() // max(1, x.shape[-1])
        if cpu_core.few_rows_fit(x, w, rows, FEW_ROWS):
            out = cpu_core.small_linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
            return out if self.bias is None else out + self.bias
        if cd == w.dtype or rows < UPCAST_MIN_ROWS or (torch.is_grad_enabled() and w.requires_grad):
            return super().forward(x)
        return upcast_linear(x, w, self.bias, cd)


def upcast_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cd: torch.dtype
) -> torch.Tensor:
    """x · wᵀ (+ bias) with the weight converted block by block to `cd`; output in x's dtype."""
    flat = x.reshape(-1, x.shape[-1]).to(cd)  # [N, in]
    out_t = torch.empty(w.shape[0], flat.shape[0], dtype=cd, device=x.device)  # [out, N]
    # one reused block buffer: a fresh tensor per block costs page faults slower than the copy
    buf = torch.empty(min(WEIGHT_BLOCK, w.shape[0]), w.shape[1], dtype=cd, device=x.device)
    for start in range(0, w.shape[0], WEIGHT_BLOCK):
        stop = min(w.shape[0], start + WEIGHT_BLOCK)
        block = buf[: stop - start]
        block.copy_(w[start:stop])
        torch.mm(block, flat.t(), out=out_t[start:stop])
    out = out_t.t()
    if bias is not None:
        out = out + bias.to(cd)
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

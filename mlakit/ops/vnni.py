"""bf16 linear weights in mlakit's own packed layout, for CPUs with AVX512-BF16 (csrc/vnni_linear.cpp).

A weight [N, K] is kept as [ceil(N/32), ceil(K/2), 64]: blocks of 32 output columns, each a sequential
stream of K/2 rows of 32 pairs of inputs (VNNI, what `vdpbf16ps` multiplies), zeros where N or K is
padded. The product reads each block once for every row of the input, 8 rows x 32 columns of fp32
sums a tile, and rounds them to bf16 once (as F.linear's bf16 result is; not bit-identical to it:
another order of the same fp32 sums).

Measured against oneDNN's prepacked bf16 product (torch.ops.mkldnn._linear_pointwise), one thread,
AMD EPYC Zen 4 (AVX512-BF16, no AMX): the DEMO projections streamed from memory (42 weights, 114 MB)
at 1 / 8 / 32 rows 13.8 / 11.6 / 5.6 -> 21.6 / 17.7 / 6.1 GB/s, the 129,280 x 1,024 lm_head at 8
rows 18.3 -> 11.4 ms, and 215-225 -> 218-232 GF/s at 64-2,048 rows (benchmarks/packed_linear.py).
"""

from __future__ import annotations

import torch

from mlakit.ops import cpu_core

BLOCK = 32  # output columns per block


def vnni_packs() -> bool:
    """Whether bf16 weights are kept in this layout here: the bf16 core is loaded (AVX512-BF16) and the
    CPU has no AMX (where oneDNN's AMX tiles outrun `vdpbf16ps` on prefill GEMMs; not measured here)."""
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)
    caps = probe() if probe is not None else {}
    return not caps.get("amx_bf16") and cpu_core.available(torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[..., N, K] bf16 -> [..., ceil(N/32), ceil(K/2), 64] bf16, zero padded (a leading dim: per head)."""
    *lead, n, k = weight.shape
    np_, kp = -(-n // BLOCK) * BLOCK, -(-k // 2) * 2
    w = weight.detach()
    if (np_, kp) != (n, k):
        w = torch.nn.functional.pad(w, (0, kp - k, 0, np_ - n))
    w = w.reshape(*lead, np_ // BLOCK, BLOCK, kp // 2, 2).transpose(-3, -2)
    return w.contiguous().view(*lead, np_ // BLOCK, kp // 2, 2 * BLOCK)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The plain [n, k] weight back from `pack`'s layout (exactly)."""
    blocks, kp2 = packed.shape[:2]
    w = packed.view(blocks, kp2, BLOCK, 2).permute(0, 2, 1, 3).reshape(blocks * BLOCK, kp2 * 2)
    return w[:n, :k].contiguous()


class VnniWeight:
    """A bf16 [out, in] weight in `pack`'s layout: `mm(x, bias)` is F.linear (within bf16 rounding),
    `to_dense()` the plain weight. What `mlakit.engine.packed.prepack` gives where `vnni_packs()`."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(
                f"VnniWeight: weight must be a 2-d bf16 CPU tensor, got {tuple(weight.shape)} "
                f"{weight.dtype} on {weight.device}"
            )
        self.out_features, self.in_features = weight.shape
        self.packed = pack(weight)

    @classmethod
    def wrap(cls, packed: torch.Tensor, out_features: int, in_features: int) -> VnniWeight:
        """A VnniWeight over an existing packed tensor (a slice of a stack of experts' packs)."""
        w = cls.__new__(cls)
        w.out_features, w.in_features, w.packed = out_features, in_features, packed
        return w

    def to_dense(self) -> torch.Tensor:
        return unpack(self.packed, self.out_features, self.in_features)

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] bf16; bias (any float dtype) added to the fp32 sums."""
        k = self.in_features
        rows = x.reshape(-1, k)
        if k % 2 or rows.stride(-1) != 1 or rows.stride(0) % 2:
            rows = torch.nn.functional.pad(rows, (0, k % 2)).contiguous()
        b = None if bias is None else bias.detach().float().contiguous()
        y = torch.ops.mlakit_cpu.vnni_linear(rows, self.packed, self.out_features, b)
        return y.view(*x.shape[:-1], self.out_features)


class HeadWeights:
    """Per-head bf16 weights W_h [N, K] (given as [H, N, K], any strides) in `pack`'s layout: `mm(x)`
    gives y [M, H, N] = x [M, H, K] · W_hᵀ per head, as the absorbed path's folds (W_h = w_uk[h]ᵀ) and
    unfolds (W_h = w_uv[h]) of a few rows want them."""

    def __init__(self, weights: torch.Tensor):
        if weights.dim() != 3 or weights.dtype != torch.bfloat16 or weights.device.type != "cpu":
            raise ValueError(
                f"HeadWeights: weights must be a 3-d bf16 CPU tensor, got {tuple(weights.shape)} "
                f"{weights.dtype} on {weights.device}"
            )
        self.heads, self.n, self.k = weights.shape
        self.packed = pack(weights)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `mm` takes x: [M, H, K] bf16 on the CPU, no autograd, not traced."""
        return (
            x.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and tuple(x.shape[1:]) == (self.heads, self.k)
            and not (torch.is_grad_enabled() and x.requires_grad)
            and not torch.compiler.is_compiling()
        )

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1 or x.stride(0) % 2 or x.stride(1) % 2 or self.k % 2:
            x = torch.nn.functional.pad(x, (0, self.k % 2)).contiguous()
        return torch.ops.mlakit_cpu.vnni_heads(x, self.packed, self.n)


class UpPacks:
    """kv_b_proj's per-head halves packed for the absorbed path: `fold` (q_nope · w_uk[h]) and `unfold`
    (o_lat · w_uv[h]ᵀ); derived copies (the layer keeps its plain weight), made by the engine, which
    owns the weights (mlakit.attention.MLAAttention.pack_up)."""

    def __init__(self, w_uk: torch.Tensor, w_uv: torch.Tensor):
        self.fold = HeadWeights(w_uk.transpose(1, 2))  # [H, L, dn]
        self.unfold = HeadWeights(w_uv)  # [H, dv, L]

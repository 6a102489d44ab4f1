"""Rotary tables (default and YaRN) and their application in both layouts.

Interleaved layouts (DeepSeek, GLM) rotate pairs (x0, x1), (x2, x3), ... and emit the result in
half-split order [rotated evens | rotated odds]. Queries and keys get the same permutation, so every
dot product equals the one of the in-place interleaved rotation; the cache stores this order, as
transformers' DeepseekV3 cache does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlakit.config import MLAConfig, yarn_mscale


def inv_freq(cfg: MLAConfig) -> torch.Tensor:
    """Inverse frequencies [dr/2] in fp32, YaRN-blended when the config scales rope."""
    dim = cfg.qk_rope_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    base = cfg.rope_theta**exponents
    extrapolated = 1.0 / base
    if not cfg.is_yarn:
        return extrapolated
    s = cfg.rope_scaling
    factor = float(s["factor"])
    interpolated = 1.0 / (factor * base)
    low, high = _yarn_correction_range(cfg, dim)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep


def _yarn_correction_range(cfg: MLAConfig, dim: int) -> tuple[float, float]:
    s = cfg.rope_scaling
    original = s["original_max_position_embeddings"]
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def dim_for(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def attention_factor(cfg: MLAConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 without YaRN)."""
    if not cfg.is_yarn:
        return 1.0
    s = cfg.rope_scaling
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class RotaryTable:
    """cos/sin for any positions, computed in fp32 from the config's frequencies."""

    def __init__(self, cfg: MLAConfig):
        self.inv_freq = inv_freq(cfg)
        self.factor = attention_factor(cfg)
        self.interleave = cfg.rope_interleave
        # what cos/sin depend on: two tables with equal keys give equal cos/sin
        self.key = (tuple(self.inv_freq.tolist()), self.factor)
        self._on_device: dict[torch.device, torch.Tensor] = {self.inv_freq.device: self.inv_freq}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The frequencies on `device`, copied there once."""
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq.to(device)
        return self._on_device[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] → cos, sin [..., dr/2] in fp32."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq_on(positions.device)
        return angles.cos() * self.factor, angles.sin() * self.factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [..., dr] (cos/sin broadcastable to [..., dr/2]); output in half-split order."""
        return apply_rope(x, cos, sin, self.interleave)

    def full_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> RopeTables:
        """cos/sin [..., dr/2] (from `cos_sin`) → the full-width form `apply_tables` reads, built once
        per step: the same rotation as `apply`, bit for bit, in 3–5 ops instead of 10."""
        return rope_tables(cos, sin, self.interleave)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (bf16 rotates in fp32), never below the input's own precision (fp64 stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(eq=False)
class RopeTables:
    """Rotation of x [..., dr] into half-split order as out = x[first]·cos + x[second]·sin (signed).

    cos = [c | c], sin = [-s | s] ([..., dr], fp32); `first` / `second` [dr] long: the source dim of
    each output dim in each product (`first` None: the identity, half-split layouts). Since
    a + x·(-s) == a - x·s exactly, this equals `apply_rope` bit for bit.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    first: torch.Tensor | None
    second: torch.Tensor
    # "interleave" / "half": the gathers above are the fixed permutations `rope_tables` builds, taken
    # as strided copies (a gather along the last dim is ~10x slower on a CPU); "": gather by index
    layout: str = ""

    def unsqueeze_heads(self) -> RopeTables:
        """The same tables broadcast over a head axis: [..., dr] → [..., 1, dr]."""
        return RopeTables(
            self.cos.unsqueeze(-2), self.sin.unsqueeze(-2), self.first, self.second, self.layout
        )


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> RopeTables:
    half = cos.shape[-1]
    evens = torch.arange(0, 2 * half, 2, device=cos.device)
    if interleave:
        first = torch.cat([evens, evens + 1])  # [x0 x2 .. | x1 x3 ..]
        second = torch.cat([evens + 1, evens])  # [x1 x3 .. | x0 x2 ..]
    else:
        first = None
        second = torch.cat([evens // 2 + half, evens // 2])  # [x2 | x1]
    layout = "interleave" if interleave else "half"
    return RopeTables(torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1), first, second, layout)


def rotation_matrices(t: RopeTables, dtype: torch.dtype) -> torch.Tensor:
    """Tables [..., dr] → one matrix per token [..., dr, dr] in `dtype` with x @ R = `apply_tables(x, t)`:
    column j holds cos[j] at row first[j] and sin[j] at row second[j]. A decode step rotates every
    head's query (or a key) in one bmm instead of 4–5 elementwise ops; the two products are summed
    with the matmul's rounding (same error against fp64 as the elementwise form, last bits may differ)."""
    dr = t.cos.shape[-1]
    cols = torch.arange(dr, device=t.cos.device)
    first = cols if t.first is None else t.first
    r = torch.zeros(*t.cos.shape, dr, dtype=dtype, device=t.cos.device)  # [..., dr (source), dr (out)]
    r[..., first, cols] = t.cos.to(dtype)
    r[..., t.second, cols] = t.sin.to(dtype)  # first[j] != second[j] for every j: no overlap
    return r


def apply_tables(x: torch.Tensor, t: RopeTables) -> torch.Tensor:
    """`apply_rope` over tables from `rope_tables`: x [..., dr] → rotated, half-split order, x's dtype."""
    fused = _fused_form(x, t)
    if fused is not None:  # one pass (csrc/rows.cpp), the same roundings
        return torch.ops.mlakit_cpu.rope_rows(*fused, t.layout == "interleave").view(x.shape)
    xf = x.to(_work_dtype(x.dtype))
    if t.layout:
        dr = xf.shape[-1]
        half = dr // 2
        # interleave: [x0 x2 .. | x1 x3 ..]; half-split: x itself
        lead = xf.unflatten(-1, (half, 2)).transpose(-1, -2).flatten(-2) if t.layout == "interleave" else xf
        swapped = torch.cat([lead[..., half:], lead[..., :half]], dim=-1)  # [x1 x3 .. | x0 x2 ..] / [x2 | x1]
        return (lead * t.cos + swapped * t.sin).to(x.dtype)
    lead = xf if t.first is None else xf.index_select(-1, t.first)
    out = lead * t.cos + xf.index_select(-1, t.second) * t.sin
    return out.to(x.dtype)


def one_pass(device: torch.device, dtype: torch.dtype, dr: int, layout: str) -> bool:
    """Whether `apply_tables` rotates x of this device, dtype and width (tables of this layout) in one
    pass (csrc/rows.cpp `rope_rows`): bf16 or fp32 on a CPU where the bf16 core runs, dr a multiple of
    32. Where it does, a plan of decode rows needs no rotation matrices (`rotation_matrices`)."""
    if not (layout and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and dr % 32 == 0):
        return False
    from mlakit.ops import cpu_core

    return cpu_core.available(torch.bfloat16)


def _fused_form(x: torch.Tensor, t: RopeTables):
    """(x [N, H, dr], cos [N, dr], sin [N, dr]) for the one-pass CPU rope where it takes x and t
    (`one_pass` for x's device, dtype and width; tables per token, over a head axis or not; no
    autograd, not traced); else None."""
    dr = x.shape[-1]
    if not (
        x.stride(-1) == 1
        and t.cos.dtype == t.sin.dtype == torch.float32
        and t.cos.shape == t.sin.shape
        and t.cos.is_contiguous()
        and t.sin.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
    ):
        return None
    if x.dim() == 3 and t.cos.shape == (x.shape[0], 1, dr):
        x3, cos, sin = x, t.cos.view(-1, dr), t.sin.view(-1, dr)
    elif x.dim() == 2 and t.cos.shape == x.shape:
        x3, cos, sin = x[:, None], t.cos, t.sin
    else:
        return None
    return (x3, cos, sin) if one_pass(x.device, x.dtype, dr, t.layout) else None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    work = _work_dtype(x.dtype)
    x1f, x2f = x1.to(work), x2.to(work)
    out = torch.cat([x1f * cos - x2f * sin, x2f * cos + x1f * sin], dim=-1)
    return out.to(x.dtype)

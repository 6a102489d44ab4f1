"""V4's rotary embedding: interleaved pairs on the last `qk_rope_head_dim` dims of a head, in place.

Two tables: "main" (rope_theta, no scaling) for sliding-window layers and "compress"
(compress_rope_theta with YaRN's frequencies, never its magnitude correction) for CSA / HCA layers,
their compressors and the CSA indexer. K = V in V4, so the layout of the rotated dims is kept as is
(no half-split permutation, unlike `mlakit.rope`): the values, and so the output, carry it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mlakit.rope import inv_freq
from mlakit.v4.config import SLIDING, V4Config


def v4_inv_freq(cfg: V4Config, layer_type: str) -> torch.Tensor:
    """Inverse frequencies [dr/2] (fp32) of a layer type's table."""
    main = layer_type == SLIDING
    spec = SimpleNamespace(
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        rope_theta=cfg.rope_theta if main else cfg.compress_rope_theta,
        rope_scaling=None if main else cfg.rope_scaling,
        is_yarn=not main and cfg.rope_scaling is not None,
    )
    return inv_freq(spec)


def cos_sin(
    freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] (any integer dtype) → cos, sin [..., dr/2] in `dtype` (fp32, or fp64)."""
    angles = positions.to(dtype)[..., None] * freqs.to(device=positions.device, dtype=dtype)
    return angles.cos(), angles.sin()


def rotate_tail(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last 2·cos.shape[-1] dims of x [..., D] by interleaved pairs; cos/sin broadcast to
    [..., dr/2]. `inverse` rotates by −angle (V4's output de-rotation). Math in fp32 (fp64 for fp64)."""
    dr = 2 * cos.shape[-1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    nope, rope = x[..., :-dr], x[..., -dr:].to(work)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    c, s = cos.to(work), sin.to(work)
    if inverse:
        s = -s
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)

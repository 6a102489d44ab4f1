"""Byte layout of one cached token, and the fp8 / int8 latent formats.

Every format stores one row of bytes per token: the latent `c_kv` (L values), its scales when
quantized, then the rope key `k_pe` (dr values) in the compute dtype, never quantized (16 bits in
serving, so rope scores are exact). For DeepSeek-V3 widths (L 512, dr 64) in bf16:

- None: 512 + 64 values of 2 bytes                                          = 1152 bytes;
- "fp8":  512 e4m3 values, 4 fp32 scales (one per 128 values), 64 bf16 rope = 656 bytes (FlashMLA's);
- "int8": 512 int8 values, 1 fp32 scale per token, 64 bf16 rope             = 644 bytes.

A DSA model (DeepSeek-V3.2, GLM-5) also keeps its indexer key (index_head_dim values) at the end of the
row: in the compute dtype (256 bytes in bf16), or, quantized, as e4m3 / int8 values and one fp32 scale
per 128 values (one per key when index_head_dim is not a multiple of 128): 132 bytes at width 128. fp8
keys are Hadamard-rotated first, with power-of-two scales (DeepSeek's reference indexer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlakit.cache.checks import check_compute_dtype
from mlakit.config import MLAConfig

QUANTS = (None, "fp8", "int8")
FP8_GROUP = 128  # latent values sharing one fp8 scale
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
INT8_MAX = 127  # symmetric: -127..127


@dataclass(frozen=True)
class Field:
    dtype: torch.dtype
    count: int  # values per token
    offset: int  # bytes from the start of the token's row


@dataclass(frozen=True)
class TokenLayout:
    quant: str | None
    latent: Field
    scale: Field | None  # fp32 scales of the latent; None when not quantized
    rope: Field
    row_bytes: int  # bytes per token, padding for alignment included (none at usual widths)
    index: Field | None = None  # DSA indexer key; None for dense MLA
    index_scale: Field | None = None  # its fp32 scales when quantized


def check_quant(quant: str | None) -> None:
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")


def token_layout(cfg: MLAConfig, dtype: torch.dtype, quant: str | None) -> TokenLayout:
    """Where each part of a token sits in its row of bytes; each field aligned to its element size."""
    check_quant(quant)
    check_compute_dtype(dtype)
    latent_width = cfg.kv_lora_rank
    if quant == "fp8" and latent_width % FP8_GROUP:
        raise ValueError(f"fp8 needs kv_lora_rank divisible by {FP8_GROUP}, got {latent_width}")
    parts = [("latent", {None: dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[quant], latent_width)]
    if quant is not None:
        parts.append(("scale", torch.float32, latent_width // FP8_GROUP if quant == "fp8" else 1))
    parts.append(("rope", dtype, cfg.qk_rope_head_dim))
    if cfg.is_sparse:
        parts.append(("index", parts[0][1], cfg.index_head_dim))
        if quant is not None:
            parts.append(("index_scale", torch.float32, index_groups(cfg.index_head_dim, quant)))
    fields, offset = {}, 0
    for name, dt, count in parts:
        offset = _align(offset, dt.itemsize)
        fields[name] = Field(dt, count, offset)
        offset += dt.itemsize * count
    row = _align(offset, max(dt.itemsize for _, dt, _ in parts))
    return TokenLayout(
        quant,
        fields["latent"],
        fields.get("scale"),
        fields["rope"],
        row,
        fields.get("index"),
        fields.get("index_scale"),
    )


def index_rotated(cfg: MLAConfig, quant: str | None) -> bool:
    """fp8 indexer keys are stored Hadamard-rotated (DeepSeek's reference): when the width is a power of 2."""
    d = cfg.index_head_dim
    return cfg.is_sparse and quant == "fp8" and d & (d - 1) == 0


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a power of two) times the orthonormal Walsh–Hadamard matrix H_n / √n, in fp32:
    orthogonal, so (Hq)·(Hk) = q·k, while it spreads an outlier channel over all n values before fp8."""
    n = x.shape[-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        y = torch.cat([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]], dim=-1).view(-1, n)
        h *= 2
    return (y * n**-0.5).view(x.shape)


def index_groups(width: int, quant: str) -> int:
    """fp32 scales of one quantized indexer key: one per 128 values (fp8) when they divide, else one."""
    return width // FP8_GROUP if quant == "fp8" and width % FP8_GROUP == 0 else 1


def field_view(rows: torch.Tensor, field: Field) -> torch.Tensor:
    """Typed view [N, count] of one field of a uint8 tensor of token rows [N, row_bytes]."""
    size = field.dtype.itemsize
    return rows[:, field.offset : field.offset + size * field.count].view(field.dtype)


def put_fields(
    store: torch.Tensor, layer: int, target: torch.Tensor, fields: list[tuple[Field, torch.Tensor]]
) -> None:
    """Write token rows `target` [N] of one layer of a uint8 pool `store` [layers, rows, row_bytes]:
    each field's values [N, count] replace its bytes, the rest of each row is kept (read first). One
    `index_put_` of whole byte rows into the pool tensor itself: writing through dtype, column or
    layer views of the pool instead makes torch.compile copy the whole pool back (docs/compile.md)."""
    new = store[layer].index_select(0, target)  # [N, row_bytes]: a fresh copy of the rows
    for field, values in fields:
        field_view(new, field).copy_(values.reshape(target.numel(), -1))
    store.index_put_((torch.full_like(target, layer), target), new)


def quantize(
    latent: torch.Tensor, quant: str, groups: int | None = None, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [N, L] → (values [N, L] in fp8 or int8, fp32 scales [N, L/128] or [N, 1]; [N, groups]
    when given). `pow2`: scales rounded up to a power of two (DeepSeek's fp8 indexer keys). A group
    with a non-finite value gets a NaN scale, so that it dequantizes to NaN: poisoning stays detectable."""
    x = latent.float()
    n, width = x.shape
    if groups is None:
        groups = width // FP8_GROUP if quant == "fp8" else 1
    x = x.view(n, groups, width // groups)
    top = FP8_MAX if quant == "fp8" else INT8_MAX
    # a group holding NaN or ±inf gets a NaN scale: dequantized, the whole group is NaN (int8 has no NaN)
    amax = x.abs().amax(dim=-1)  # [N, G]
    scale = torch.where(torch.isfinite(amax), amax / top, torch.full_like(amax, float("nan")))
    # an all-zero group keeps scale 1 so that dequantizing never divides 0 by 0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    y = (x / scale[..., None]).clamp_(-top, top)
    if quant == "fp8":
        return y.to(torch.float8_e4m3fn).view(n, width), scale
    # NaN has no int8 value (the cast is undefined): 0, the scale keeps the poisoning
    return y.nan_to_num_(0.0).round_().to(torch.int8).view(n, width), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [N, L], scales [N, G]) → latent [N, L] in `dtype`.

    One conversion and one in-place multiply in `dtype`: fp8 and int8 values are exact in bf16, so
    the only rounding beyond the format's is the scale's (2^-9 relative in bf16).
    """
    n, width = values.shape
    groups = scale.shape[-1]
    x = values.to(dtype)
    x.view(n, groups, width // groups).mul_(scale.to(dtype)[..., None])
    return x


def _align(offset: int, size: int) -> int:
    return -(-offset // size) * size

"""Cache economics: values and bytes per token, per layer, per model and per sequence.

One token's cache in one layer is a set of content vectors (quantizable) plus rope values (kept in
16 bits when the content is quantized, because rotated keys lose too much in 8 bits):

- fp32 / bf16: 4 / 2 bytes per value, rope included.
- fp8: one e4m3 byte per content value and one fp32 scale per 128-value tile of each vector,
  rope in bf16 (FlashMLA's layout: 512 + 4·4 + 64·2 = 656 bytes for the 576-wide latent).
- int8: one byte per content value and one fp32 scale per vector (per token for the latent:
  +4 bytes), rope in bf16 (512 + 4 + 128 = 644 bytes for the 576-wide latent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlakit.config import MLAConfig

CACHE_DTYPES = ("fp32", "bf16", "fp8", "int8")
VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "int8": 1}
QUANT_TILE = {"fp8": 128}  # values per fp32 scale; int8 has one scale per whole vector
SCALE_BYTES = 4  # an fp32 scale
ROPE_BYTES = 2  # rope values stay bf16 in the quantized formats
DEFAULT_GQA_GROUPS = (4, 8)


@dataclass(frozen=True)
class CacheLayout:
    """What one token stores in one layer: `vectors` as (count, width) pairs, plus `rope` values."""

    vectors: tuple[tuple[int, int], ...]
    rope: int = 0

    @property
    def values(self) -> int:
        return sum(count * width for count, width in self.vectors) + self.rope

    def content_bytes(self, dtype: str) -> int:
        """Bytes of the content vectors, scales included."""
        check_cache_dtype(dtype)
        total = 0
        for count, width in self.vectors:
            total += count * width * VALUE_BYTES[dtype]
            if dtype in ("fp8", "int8"):
                tiles = math.ceil(width / QUANT_TILE[dtype]) if dtype in QUANT_TILE else 1
                total += count * tiles * SCALE_BYTES  # the fp32 scales
        return total

    def rope_bytes(self, dtype: str) -> int:
        check_cache_dtype(dtype)
        return self.rope * (ROPE_BYTES if dtype in ("fp8", "int8") else VALUE_BYTES[dtype])

    def bytes(self, dtype: str) -> int:
        return self.content_bytes(dtype) + self.rope_bytes(dtype)


# indexer key values per fp32 scale in the fp8 layout (DeepSeek's reference, vLLM); one scale per key
# when the width is not a multiple of it (mlakit.cache.quant)
INDEX_TILE = 128


def index_key_bytes(cfg: MLAConfig, dtype: str = "bf16") -> int:
    """One token's DSA indexer key in one layer: 256 B (bf16) or 132 B (fp8 + fp32 scale) at d_I 128."""
    check_cache_dtype(dtype)
    if not cfg.is_sparse:
        raise ValueError(f"model {cfg.name!r} has no indexer (index_topk is None): not a DSA model")
    d = cfg.index_head_dim
    if dtype in ("fp8", "int8"):
        groups = d // INDEX_TILE if dtype == "fp8" and d % INDEX_TILE == 0 else 1
        return d + groups * SCALE_BYTES
    return d * VALUE_BYTES[dtype]


def check_cache_dtype(dtype: str) -> None:
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"dtype must be one of {CACHE_DTYPES}, got {dtype!r}")


def gqa_groups_defined(cfg: MLAConfig, groups) -> list[int]:
    """The group counts that make a GQA of this head count: 1 < g < heads and g divides heads."""
    out = []
    for g in groups:
        if isinstance(g, bool) or not isinstance(g, int) or g <= 0:
            raise ValueError(f"GQA group counts must be positive integers, got {g!r}")
        if 1 < g < cfg.num_heads and cfg.num_heads % g == 0 and g not in out:
            out.append(g)
    return out


def cache_layouts(cfg: MLAConfig, gqa_groups=DEFAULT_GQA_GROUPS) -> dict[str, CacheLayout]:
    """mla, expanded (what a materializing cache holds), mha, gqa<g> and mqa at the same head widths.

    MHA, GQA and MQA keep keys of the content width (nope) and values of the value width per
    cached head (the DeepSeek-V2 paper's comparison, with positions rotated in place).
    """
    h, lat, dn, dr, dv = (
        cfg.num_heads,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    layouts = {
        "mla": CacheLayout(((1, lat),), rope=dr),  # [c_kv | k_pe], shared by every head
        "expanded": CacheLayout(((h, dn), (h, dv)), rope=h * dr),  # per-head [k_nope | k_pe] and v
        "mha": CacheLayout(((h, dn), (h, dv))),  # one key and one value per head
    }
    for g in gqa_groups_defined(cfg, gqa_groups):
        layouts[f"gqa{g}"] = CacheLayout(((g, dn), (g, dv)))  # one key and value per group
    layouts["mqa"] = CacheLayout(((1, dn), (1, dv)))  # one key and value for all heads
    return layouts


def mla_equivalent_gqa_groups(cfg: MLAConfig) -> float:
    """The GQA group count whose cache equals the model's MLA cache: (L + dr) / (nope + v), 2.25 at V2/V3
    widths; a DSA model caches its indexer key too, (L + dr + d_I) / (nope + v): 2.75 for V3.2."""
    values = cfg.latent_dim + (cfg.index_head_dim if cfg.is_sparse else 0)
    return values / (cfg.qk_nope_head_dim + cfg.v_head_dim)


def cache_economics(cfg: MLAConfig, context: int, dtype: str = "bf16", gqa_groups=DEFAULT_GQA_GROUPS) -> dict:
    """Values and bytes per token per layer, per token (all layers) and per sequence of `context` tokens."""
    check_cache_dtype(dtype)
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer number of tokens >= 0, got {context!r}")
    layouts = cache_layouts(cfg, gqa_groups)
    per_layer = {name: lay.bytes(dtype) for name, lay in layouts.items()}
    values = {name: lay.values for name, lay in layouts.items()}
    if cfg.is_sparse:
        values, per_layer = _with_indexer_row(cfg, dtype, values, per_layer)
    out = {
        "num_layers": cfg.num_layers,
        "values_per_token_per_layer": values,
        "bytes_per_token_per_layer": per_layer,
        "bytes_per_token": {name: b * cfg.num_layers for name, b in per_layer.items()},
        "bytes_per_sequence": {name: b * cfg.num_layers * context for name, b in per_layer.items()},
        "mla_equivalent_gqa_groups": mla_equivalent_gqa_groups(cfg),  # the mla+indexer row for DSA
    }
    if cfg.is_sparse:
        out["indexer"] = _indexer_economics(cfg, context, dtype, per_layer["mla"])
        out["dense_layer"] = {
            "mla_equivalent_gqa_groups": cfg.latent_dim / (cfg.qk_nope_head_dim + cfg.v_head_dim)
        }
    return out


def _with_indexer_row(cfg: MLAConfig, dtype: str, values: dict, per_layer: dict) -> tuple[dict, dict]:
    """A DSA model caches the latent and its indexer key: that row ("mla+indexer") comes first; "mla"
    stays beside it as the latent alone (what a dense layer of these widths caches)."""
    key = "mla+indexer"
    values = {key: values["mla"] + cfg.index_head_dim, **values}
    per_layer = {key: per_layer["mla"] + index_key_bytes(cfg, dtype), **per_layer}
    return values, per_layer


def _indexer_economics(cfg: MLAConfig, context: int, dtype: str, mla_per_layer: int) -> dict:
    """DSA caches one indexer key per token per layer beside the latent (same slots, same pages)."""
    key = index_key_bytes(cfg, dtype)
    with_key = mla_per_layer + key
    return {
        "index_key_bytes_per_token_per_layer": key,
        "mla_with_indexer_bytes_per_token_per_layer": with_key,
        "mla_with_indexer_bytes_per_token": with_key * cfg.num_layers,
        "mla_with_indexer_bytes_per_sequence": with_key * cfg.num_layers * context,
    }


def format_bytes(n: float) -> str:
    """Decimal units (1 kB = 1000 B), about three significant figures: 70272 -> '70.3 kB'.

    Rounds half up by floor(x·10^d + 0.5) so the explorer page's JavaScript gives the same text.
    """
    units = ("B", "kB", "MB", "GB", "TB", "PB")
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n /= 1000
        i += 1
    digits = 0 if i == 0 or n >= 100 else 1 if n >= 10 else 2
    scale = 10**digits
    return f"{math.floor(n * scale + 0.5) / scale:.{digits}f} {units[i]}"

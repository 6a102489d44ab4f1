"""V4Config: every width of a DeepSeek-V4 attention layer (CSA / HCA / sliding window), presets, from_hf.

Torch-free, like MLAConfig. docs/v4.md has the mechanism; `mlakit.cost.v4` the arithmetic.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from mlakit import config_checks as checks

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
# the published configs' per-layer `compress_ratios` (0: window only)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass
class V4Config:
    hidden_size: int  # model width D
    num_heads: int  # query heads H (one shared K = V head)
    head_dim: int  # width of every head and of the shared K = V entry (512)
    qk_rope_head_dim: int  # rotated tail of each head, interleaved pairs (64)
    q_lora_rank: int  # query down-projection rank; the indexer's queries read it too
    o_groups: int  # head groups of the grouped low-rank output (block-diagonal o_a_proj)
    o_lora_rank: int  # per-group output rank d_g
    layer_types: tuple[str, ...]  # per layer: sliding_attention, compressed_sparse_attention or heavily_...
    sliding_window: int = 128  # window n_win every layer keeps (query t sees t-n_win+1..t)
    csa_ratio: int = 4  # tokens per CSA entry m (overlapping windows of 2m)
    hca_ratio: int = 128  # tokens per HCA entry m'
    attention_sink: bool = True  # a learnable per-head logit in every softmax (`sinks`)
    index_n_heads: int = 64  # CSA lightning-indexer heads
    index_head_dim: int = 128  # indexer key width (its own compressor's entries)
    index_topk: int = 512  # compressed entries each CSA query attends to
    rope_theta: float = 10000.0  # rotary base of sliding-window layers (no YaRN)
    compress_rope_theta: float = 160000.0  # rotary base of CSA / HCA layers and their compressors
    rope_scaling: dict[str, Any] | None = None  # YaRN of the compressed layers (no magnitude correction)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank"):
            setattr(self, f, checks.positive_int(f, getattr(self, f)))
        for f in (
            "sliding_window",
            "csa_ratio",
            "hca_ratio",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
        ):
            setattr(self, f, checks.positive_int(f, getattr(self, f)))
        self.qk_rope_head_dim = checks.even(
            "qk_rope_head_dim", checks.positive_int("qk_rope_head_dim", self.qk_rope_head_dim)
        )
        self.attention_sink = checks.boolean("attention_sink", self.attention_sink)
        self.rope_theta = checks.number("rope_theta", self.rope_theta, above=0)
        self.compress_rope_theta = checks.number("compress_rope_theta", self.compress_rope_theta, above=0)
        self.rms_norm_eps = checks.number("rms_norm_eps", self.rms_norm_eps, above=0)
        self.max_position_embeddings = checks.positive_int(
            "max_position_embeddings", self.max_position_embeddings
        )
        self.name = checks.text("name", self.name)
        self.rope_scaling = _compress_scaling(self.rope_scaling, self.compress_rope_theta)
        self.layer_types = _layer_types(self.layer_types)
        _check_widths(self)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """`head_dim^-0.5`: V4 scales neither the softmax nor cos/sin by YaRN's magnitude correction."""
        return self.head_dim**-0.5

    def ratio(self, layer_type: str) -> int:
        """Tokens per compressed entry of a layer type (0: window only)."""
        return {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[layer_type]

    def count(self, layer_type: str) -> int:
        return sum(t == layer_type for t in self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    def replace(self, **changes: Any) -> V4Config:
        return replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> V4Config:
        """A published model's attention widths: see `V4_PRESETS`."""
        key = name.lower() if isinstance(name, str) else None
        if key not in V4_PRESETS:
            raise ValueError(f"preset {name!r} is unknown; expected one of {sorted(V4_PRESETS)}")
        return cls(name=key, **V4_PRESETS[key])

    @classmethod
    def from_hf(cls, source: Any) -> V4Config:
        """From a transformers DeepseekV4Config, a dict, a config.json path or a model folder."""
        from mlakit.hf.config import load_config_dict

        return cls(**hf_kwargs(load_config_dict(source)))

    @classmethod
    def resolve(cls, model: str | V4Config) -> V4Config:
        if isinstance(model, V4Config):
            return model
        if isinstance(model, str) and model.lower() in V4_PRESETS:
            return cls.preset(model)
        if isinstance(model, str | os.PathLike) and os.path.exists(model):
            return cls.from_hf(model)
        raise ValueError(
            f"model {model!r} is neither a V4 preset ({', '.join(sorted(V4_PRESETS))}) nor a config"
        )


def _layer_types(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise ValueError(f"layer_types must be a non-empty list of {LAYER_TYPES}, got {value!r}")
    bad = [t for t in value if t not in LAYER_TYPES]
    if bad:
        raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {bad}")
    return tuple(value)


def _compress_scaling(value: Any, theta: float) -> dict[str, Any] | None:
    if value is None:
        return None
    out = checks.rope_scaling(value, theta)
    if out is not None and out.get("attention_factor", 1.0) != 1.0:
        raise ValueError(
            f"rope_scaling['attention_factor'] must be 1.0 for DeepSeek-V4 (cos/sin are not scaled), "
            f"got {out['attention_factor']!r}"
        )
    return out


def _check_widths(cfg: V4Config) -> None:
    if cfg.head_dim <= cfg.qk_rope_head_dim:
        raise ValueError(f"head_dim must be > qk_rope_head_dim ({cfg.qk_rope_head_dim}), got {cfg.head_dim}")
    if cfg.index_head_dim <= cfg.qk_rope_head_dim:
        raise ValueError(
            f"index_head_dim must be > qk_rope_head_dim ({cfg.qk_rope_head_dim}), got {cfg.index_head_dim}"
        )
    # the grouped output projection splits the heads into o_groups groups of whole heads
    if cfg.num_heads % cfg.o_groups:
        raise ValueError(
            f"o_groups must divide num_heads ({cfg.num_heads}) into groups of whole heads, got {cfg.o_groups}"
        )


def hf_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    """V4Config keyword arguments from a DeepseekV4Config dict or a published config.json."""
    if d.get("num_key_value_heads", 1) != 1:
        raise ValueError(
            f"num_key_value_heads must be 1 (one shared K = V head), got {d['num_key_value_heads']!r}"
        )
    for key in ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank"):
        if key not in d:
            raise ValueError(f"config has no {key!r}; is it a DeepSeek-V4 config?")
    rates = dict(_field(d, "compress_rates", dict) or {})
    rates.setdefault(CSA, d.get("compress_rate_csa", 4))
    rates.setdefault(HCA, d.get("compress_rate_hca", 128))
    rope_dim = d.get("qk_rope_head_dim")
    if rope_dim is None:
        head_dim = checks.positive_int("head_dim", d["head_dim"])
        factor = d.get("partial_rotary_factor")
        factor = 64 / 512 if factor is None else checks.number("partial_rotary_factor", factor, above=0)
        rope_dim = int(head_dim * factor)
    out = dict(
        hidden_size=d["hidden_size"],
        num_heads=d["num_attention_heads"],
        head_dim=d["head_dim"],
        qk_rope_head_dim=rope_dim,
        q_lora_rank=d["q_lora_rank"],
        o_groups=d.get("o_groups", 8),
        o_lora_rank=d.get("o_lora_rank", 1024),
        layer_types=_hf_layer_types(d),
        sliding_window=d.get("sliding_window", 128),
        csa_ratio=rates[CSA],
        hca_ratio=rates[HCA],
        rope_theta=d.get("rope_theta", 10000.0),
        compress_rope_theta=d.get("compress_rope_theta", 160000.0),
        rope_scaling=_hf_scaling(d),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        max_position_embeddings=d.get("max_position_embeddings", 1048576),
        name=d.get("_name_or_path") or "custom",
    )
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        if key in d:
            out[key] = d[key]
    return out


def _hf_layer_types(d: dict[str, Any]) -> list[str]:
    n = d.get("num_hidden_layers")
    types = _field(d, "layer_types", list | tuple)
    if types is None and d.get("compress_ratios") is not None:
        ratios = list(_field(d, "compress_ratios", list | tuple))
        bad = [r for r in ratios if r not in _RATIO_TO_TYPE]
        if bad:
            raise ValueError(f"compress_ratios entries must be 0, 4 or 128, got {bad}")
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    if types is None:
        raise ValueError("config has neither layer_types nor compress_ratios")
    # the published lists carry one more entry than layers: the MTP layer's
    return list(types[:n] if isinstance(n, int) else types)


def _hf_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        s = dict(rp["compress"])
    else:
        s = dict(_field(d, "rope_scaling", dict) or {})
    kind = s.get("rope_type", s.get("type", "default"))
    if kind != "yarn":
        return None
    s["rope_type"] = "yarn"
    s.pop("type", None)
    s.setdefault("attention_factor", 1.0)
    return s


def _field(d: dict[str, Any], key: str, kind: Any) -> Any:
    """`d[key]` when it is a `kind` (a JSON list or object) or absent / null; a ValueError otherwise."""
    value = d.get(key)
    if value is not None and not isinstance(value, kind):
        what = "an object {...}" if kind is dict else "a list"
        raise ValueError(f"{key} must be {what} or null, got {value!r} ({type(value).__name__})")
    return value


def _published_types(ratios: list[int], layers: int) -> tuple[str, ...]:
    return tuple(_RATIO_TO_TYPE[r] for r in ratios[:layers])


_YARN = {
    "rope_type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
    "attention_factor": 1.0,
}

# deepseek-ai/DeepSeek-V4-Flash config.json: compress_ratios [0, 0, (4, 128) x 20, 4, 0] (44 entries, the
# last the MTP layer's); widths equal transformers 5.24's DeepseekV4Config defaults
_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]
# deepseek-ai/DeepSeek-V4-Pro config.json: compress_ratios [128, 128, (4, 128) x 29, 4, 0] (62 entries);
# widths from its config.json (transformers' DeepseekV4GroupedLinear docstring names H, D, g, d_g too)
_PRO_RATIOS = [128, 128] + [4, 128] * 29 + [4, 0]

V4_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v4-flash": dict(
        hidden_size=4096,
        num_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        layer_types=_published_types(_FLASH_RATIOS, 43),
        index_topk=512,
        rope_scaling=dict(_YARN),
    ),
    "deepseek-v4-pro": dict(
        hidden_size=7168,
        num_heads=128,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        layer_types=_published_types(_PRO_RATIOS, 61),
        index_topk=1024,
        rope_scaling=dict(_YARN),
    ),
}

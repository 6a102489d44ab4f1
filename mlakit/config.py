"""MLAConfig: every width of an MLA layer, the published presets, and transformers configs."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from mlakit import config_checks as checks


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1·mscale·ln(factor) + 1` (1 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class MLAConfig:
    hidden_size: int  # model width D
    num_heads: int  # attention heads H
    q_lora_rank: int | None  # query down-projection rank; None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int  # latent width L, the cached c_kv
    qk_nope_head_dim: int  # per-head key/query content width dn
    qk_rope_head_dim: int  # decoupled rope width dr, cached once per token (shared by heads)
    v_head_dim: int  # per-head value width dv
    num_layers: int = 1  # layers in the model (for cache totals)
    rope_theta: float = 10000.0  # rotary base
    rope_scaling: dict[str, Any] | None = None  # None (default rope) or {"rope_type": "yarn", "factor": ...}
    rope_interleave: bool = False  # rope dims laid out as interleaved pairs (DeepSeek) or two halves
    rms_norm_eps: float = 1e-6  # eps of q_a_layernorm and kv_a_layernorm
    attention_bias: bool = False  # bias on q_a_proj, kv_a_proj_with_mqa and o_proj
    max_position_embeddings: int = 4096  # the model's context window (informational)
    name: str = field(default="custom", compare=False)  # preset or source name

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_layers"):
            setattr(self, f, checks.positive_int(f, getattr(self, f)))
        self.qk_rope_head_dim = checks.even(
            "qk_rope_head_dim", checks.positive_int("qk_rope_head_dim", self.qk_rope_head_dim)
        )
        self.q_lora_rank = checks.optional_positive_int("q_lora_rank", self.q_lora_rank)
        self.rope_theta = checks.number("rope_theta", self.rope_theta, above=0)
        self.rms_norm_eps = checks.number("rms_norm_eps", self.rms_norm_eps, above=0)
        self.rope_interleave = checks.boolean("rope_interleave", self.rope_interleave)
        self.attention_bias = checks.boolean("attention_bias", self.attention_bias)
        self.max_position_embeddings = checks.positive_int(
            "max_position_embeddings", self.max_position_embeddings
        )
        self.name = checks.text("name", self.name)
        self.rope_scaling = checks.rope_scaling(self.rope_scaling, self.rope_theta)

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width, nope + rope (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_yarn(self) -> bool:
        return self.rope_scaling is not None

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim^-0.5`, times `mscale(factor, mscale_all_dim)^2` under YaRN (never latent^-0.5)."""
        scale = self.qk_head_dim**-0.5
        if self.is_yarn:
            mscale_all_dim = self.rope_scaling.get("mscale_all_dim") or 0.0
            if mscale_all_dim:
                m = yarn_mscale(self.rope_scaling["factor"], mscale_all_dim)
                scale *= m * m
        return scale

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> MLAConfig:
        return replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> MLAConfig:
        """A published model's attention widths: see `PRESETS`."""
        key = name.lower() if isinstance(name, str) else None
        if key not in PRESETS:
            raise ValueError(f"preset {name!r} is unknown; expected one of {sorted(PRESETS)}")
        return cls(name=key, **PRESETS[key])

    @classmethod
    def from_hf(cls, source: Any) -> MLAConfig:
        """From a transformers config object, a dict, a config.json path or a model folder.

        Every field is checked as the constructor checks it (ValueError naming the key): booleans must
        be JSON true/false (the strings "true"/"false" and 0/1 are refused, never coerced), widths
        integers, and a config.json that is not a JSON object is refused with the file named.
        """
        from mlakit.hf.config import config_dict_to_kwargs, load_config_dict

        d = load_config_dict(source)
        return cls(**config_dict_to_kwargs(d))

    @classmethod
    def resolve(cls, model: str | MLAConfig) -> MLAConfig:
        """A preset name, a config.json path or a model folder (what `--model` takes)."""
        if isinstance(model, MLAConfig):
            return model
        if not isinstance(model, str | os.PathLike):
            raise ValueError(
                f"model must be a preset name, a config.json path or a model folder, got {model!r} "
                f"({type(model).__name__})"
            )
        model = os.fspath(model)
        if model.lower() in PRESETS:
            return cls.preset(model)
        if os.path.exists(model):
            return cls.from_hf(model)
        raise ValueError(
            f"model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
            "nor an existing config.json or model folder"
        )


def _yarn(factor: float, original: int, mscale: float, mscale_all_dim: float, beta_fast: float = 32) -> dict:
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": beta_fast,
        "beta_slow": 1,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


_V3_ATTN = dict(
    hidden_size=7168,
    num_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_layers=61,
    rope_theta=10000.0,
    rope_scaling=_yarn(40, 4096, 1.0, 1.0),
    rope_interleave=True,
    max_position_embeddings=163840,
)

# published attention widths, from each model's config.json
PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v2": dict(
        hidden_size=5120,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_layers=60,
        rope_scaling=_yarn(40, 4096, 0.707, 0.707),
        rope_interleave=True,
        max_position_embeddings=163840,
    ),
    "deepseek-v2-lite": dict(
        hidden_size=2048,
        num_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_layers=27,
        rope_scaling=_yarn(40, 4096, 0.707, 0.707),
        rope_interleave=True,
        max_position_embeddings=163840,
    ),
    "deepseek-v3": dict(_V3_ATTN),
    "deepseek-v3.2": dict(_V3_ATTN),
    "kimi-k2": dict(
        _V3_ATTN,
        num_heads=64,
        rope_theta=50000.0,
        rope_scaling=_yarn(32, 4096, 1.0, 1.0, beta_fast=1),
        max_position_embeddings=131072,
    ),
    "glm-4.7-flash": dict(
        hidden_size=2048,
        num_heads=20,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        num_layers=47,
        rope_theta=1_000_000.0,
        rope_interleave=True,
        max_position_embeddings=202752,
    ),
    "glm-5": dict(
        hidden_size=6144,
        num_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        num_layers=78,
        rope_theta=1_000_000.0,
        rope_interleave=True,
        max_position_embeddings=202752,
    ),
    "minicpm3-4b": dict(
        hidden_size=2560,
        num_heads=40,
        q_lora_rank=768,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_layers=62,
        rope_theta=10000.0,
        rope_interleave=False,
        max_position_embeddings=32768,
    ),
}


def load_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)

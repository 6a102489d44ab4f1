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
    # DeepSeek Sparse Attention (docs/sparse.md); all None: dense MLA
    index_n_heads: int | None = None  # lightning-indexer heads H_I
    index_head_dim: int | None = None  # indexer head width d_I; one d_I key per token is cached
    index_topk: int | None = None  # tokens each query attends to (k)
    indexer_rope_interleave: bool | None = None  # indexer rope pairs interleaved (GLM-5) or halves (V3.2)

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
        _check_indexer(self)

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width, nope + rope (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_sparse(self) -> bool:
        """True for DeepSeek Sparse Attention (an indexer selects index_topk tokens per query)."""
        return self.index_topk is not None

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

    def dense(self) -> MLAConfig:
        """The same widths without the indexer (dense MLA)."""
        return replace(self, **dict.fromkeys(_INDEXER_FIELDS))

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


_INDEXER_FIELDS = ("index_n_heads", "index_head_dim", "index_topk", "indexer_rope_interleave")


def _check_indexer(cfg: MLAConfig) -> None:
    """The DSA fields: all None (dense MLA) or all set, with a query latent and room for the rope dims."""
    given = [f for f in _INDEXER_FIELDS if getattr(cfg, f) is not None]
    if not given:
        return
    missing = [f for f in _INDEXER_FIELDS if getattr(cfg, f) is None]
    if missing:
        raise ValueError(
            f"indexer fields are all-or-none: {', '.join(given)} set but {', '.join(missing)} missing"
        )
    for f in _INDEXER_FIELDS[:3]:
        setattr(cfg, f, checks.positive_int(f, getattr(cfg, f)))
    cfg.indexer_rope_interleave = checks.boolean("indexer_rope_interleave", cfg.indexer_rope_interleave)
    if cfg.q_lora_rank is None:
        raise ValueError("index_topk is set but q_lora_rank is None: indexer queries read the query latent")
    if cfg.index_head_dim <= cfg.qk_rope_head_dim:
        raise ValueError(
            f"index_head_dim must be > qk_rope_head_dim ({cfg.qk_rope_head_dim}): its first "
            f"qk_rope_head_dim dims are rotated, got {cfg.index_head_dim}"
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
    "deepseek-v3.2": dict(
        _V3_ATTN, index_n_heads=64, index_head_dim=128, index_topk=2048, indexer_rope_interleave=False
    ),
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
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        indexer_rope_interleave=True,
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
    # the families below: widths from the transformers 5.24 config class defaults, which its docstring
    # says mirror the named checkpoint (e.g. YoutuConfig → tencent/Youtu-LLM-2B); num_layers counts the
    # MLA layers only (what the latent cache holds)
    "youtu-llm-2b": dict(  # YoutuConfig
        hidden_size=2048,
        num_heads=16,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_layers=32,
        rope_interleave=True,
        max_position_embeddings=131072,
    ),
    "ax-k1": dict(_V3_ATTN, num_heads=64, rope_scaling=None, max_position_embeddings=32768),  # AXK1Config
    "mistral-small-4": dict(  # Mistral4Config (mistralai/Mistral-Small-4-119B-2603)
        hidden_size=4096,
        num_heads=32,
        q_lora_rank=1024,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_layers=36,
        rope_scaling=_yarn(128, 8192, 1.0, 1.0),
        rope_interleave=True,
        max_position_embeddings=1048576,
    ),
    "longcat-flash": dict(  # LongcatFlashConfig (meituan-longcat/LongCat-Flash-Chat): 2 MLA per layer
        _V3_ATTN,
        hidden_size=6144,
        num_heads=64,
        num_layers=56,
        rope_theta=10_000_000.0,
        rope_scaling=None,
        max_position_embeddings=131072,
    ),
    "kimi-linear-48b": dict(  # KimiLinearConfig (moonshotai/Kimi-Linear-48B-A3B-Instruct): NoPE MLA
        hidden_size=2304,
        num_heads=32,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_layers=6,  # 6 of 27 layers are MLA, the rest KDA linear attention
        max_position_embeddings=1048576,
    ),
    "ling-3-flash": dict(  # BailingHybridConfig (inclusionAI/Ling-3.0-Flash)
        hidden_size=2560,
        num_heads=32,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_layers=7,  # 7 of 42 layers are MLA, the rest linear attention
        rope_theta=6_000_000.0,
        rope_interleave=True,
        max_position_embeddings=262144,
    ),
    "hy4-preview": dict(  # HYV4Config (tencent/Hy4-preview); DSA, refused by mlakit.hf for now
        hidden_size=2816,
        num_heads=32,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        num_layers=34,
        max_position_embeddings=262144,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=2048,
        indexer_rope_interleave=False,
    ),
    "ax-k2": dict(  # AXK2Config (skt/A.X-K2); DSA, refused by mlakit.hf for now
        hidden_size=2048,
        num_heads=32,
        q_lora_rank=384,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_layers=48,
        rope_interleave=True,
        max_position_embeddings=131072,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=2048,
        indexer_rope_interleave=False,
    ),
    "mistral-large-4": dict(  # MistralLarge4TextConfig (mistralai/Mistral-Large-4-1T-A52B); dense widths:
        # its indexer runs without a q_lora latent, which MLAConfig cannot describe; DSA, refused
        hidden_size=6144,
        num_heads=64,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_layers=72,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 2048.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "attention_factor": 1.0,
        },
        rope_interleave=True,
        rms_norm_eps=1e-5,  # its latent norms take config.rms_norm_eps
        max_position_embeddings=1048576,
    ),
}


def load_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)

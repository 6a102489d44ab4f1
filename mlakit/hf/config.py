"""Read a transformers MLA config (object, dict, config.json or folder) into MLAConfig fields.

Kept apart from `hf.py` so that `MLAConfig.from_hf` never imports transformers.
"""

from __future__ import annotations

import json
import os
from typing import Any

# model types whose rope pairs are interleaved unless the config says otherwise
_INTERLEAVED_BY_DEFAULT = {
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "kimi_k2",
    "glm4_moe_lite",
    "glm_moe_dsa",
}

# DSA models: the layout of the indexer's rope (DeepSeek-V3.2 half-split, GLM-5 interleaved)
_INDEXER_ROPE_INTERLEAVE = {"deepseek_v32": False, "glm_moe_dsa": True}

_REQUIRED = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")


def load_config_dict(source: Any) -> dict[str, Any]:
    """A plain dict from a transformers config object, a dict, a config.json path or a model folder."""
    if isinstance(source, dict):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"config source {os.fspath(source)!r}: no such config.json or model folder")
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if hasattr(source, "to_dict"):
        d = source.to_dict()
        # a v5 config standardizes rope into rope_parameters; read it from the object when present
        rope = getattr(source, "rope_parameters", None)
        if rope is not None:
            d["rope_parameters"] = dict(rope)
        return d
    raise ValueError(
        f"config source of type {type(source).__name__} is not supported; expected a transformers config, "
        "a dict, a config.json path or a model folder"
    )


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
    params = d.get("rope_parameters") or {}
    if params and not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a dict, got {type(params).__name__}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported for MLA configs")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return float(theta), None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported; mlakit supports 'default' and 'yarn'")
    scaling = dict(scaling)
    if scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = d.get("max_position_embeddings")
    return float(theta), scaling


def config_dict_to_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    """MLAConfig keyword arguments from a transformers config dict."""
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"config has no {', '.join(missing)}: not an MLA model config")
    heads = d["num_attention_heads"]
    v_head_dim = d.get("v_head_dim")
    if v_head_dim is None:
        # transformers' MiniCPM3 takes hidden_size / num_heads when v_head_dim is unset
        v_head_dim = d["hidden_size"] // heads
    model_type = d.get("model_type", "")
    interleave = d.get("rope_interleave")
    if interleave is None:
        interleave = model_type in _INTERLEAVED_BY_DEFAULT
    theta, scaling = _rope(d)
    return dict(
        hidden_size=d["hidden_size"],
        num_heads=heads,
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"],
        v_head_dim=v_head_dim,
        num_layers=d.get("num_hidden_layers", 1),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=bool(interleave),
        # transformers' attention builds its two latent norms with eps 1e-6 whatever rms_norm_eps says
        rms_norm_eps=1e-6,
        attention_bias=bool(d.get("attention_bias", False)),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        name=d.get("_name_or_path") or model_type or "custom",
        **indexer_kwargs(d),
    )


def indexer_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    """The DSA fields of a config dict ({} for dense MLA); an unknown indexer rope layout raises."""
    if d.get("index_topk") is None:
        return {}
    model_type = d.get("model_type", "")
    interleave = d.get("indexer_rope_interleave", _INDEXER_ROPE_INTERLEAVE.get(model_type))
    if interleave is None:
        raise ValueError(
            f"config of model_type {model_type!r} has an indexer (index_topk) but mlakit does not know its "
            f"indexer rope layout; known: {sorted(_INDEXER_ROPE_INTERLEAVE)}"
        )
    return dict(
        index_n_heads=d.get("index_n_heads"),
        index_head_dim=d.get("index_head_dim"),
        index_topk=d["index_topk"],
        indexer_rope_interleave=bool(interleave),
    )

"""Read a transformers MLA config (object, dict, config.json or folder) into MLAConfig fields.

Kept apart from `hf.py` so that `MLAConfig.from_hf` never imports transformers.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mlakit import config_checks as checks

# model types whose rope pairs are interleaved unless the config says otherwise
_INTERLEAVED_BY_DEFAULT = {
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "kimi_k2",
    "glm4_moe_lite",
    "glm_moe_dsa",
}

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
        return read_json_object(path, "config")
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


def read_json_object(path: str, what: str) -> dict[str, Any]:
    """The JSON object in the file at `path`; any other content is a ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} file {path}: not a readable JSON object ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict):
        raise ValueError(
            f"{what} file {path}: expected a JSON object {{...}}, got a JSON {type(data).__name__}"
        )
    return data


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
    params = d.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a dict or null, got {params!r} ({type(params).__name__})")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported for MLA configs")
    theta = params.get("rope_theta")
    if theta is None:
        theta = d.get("rope_theta", 10000.0)
    scaling = d.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a dict or null, got {scaling!r} ({type(scaling).__name__})")
    scaling = scaling or params
    name = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    if not scaling or checks.rope_kind(name, scaling) == "default":
        return theta, None
    scaling = dict(scaling)
    if scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = d.get("max_position_embeddings")
    return theta, scaling


def config_dict_to_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    """MLAConfig keyword arguments from a transformers config dict."""
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"config has no {', '.join(missing)}: not an MLA model config")
    heads = checks.positive_int("num_attention_heads", d["num_attention_heads"])
    v_head_dim = d.get("v_head_dim")
    if v_head_dim is None:
        # transformers' MiniCPM3 takes hidden_size / num_heads when v_head_dim is unset
        v_head_dim = checks.positive_int("hidden_size", d["hidden_size"]) // heads
        if v_head_dim == 0:
            raise ValueError(
                f"v_head_dim is absent and hidden_size // num_attention_heads = "
                f"{d['hidden_size']} // {heads} "
                "is 0; expected a positive value width"
            )
    model_type = d.get("model_type")
    model_type = "" if model_type is None else checks.text("model_type", model_type)
    interleave = d.get("rope_interleave")
    if interleave is None:
        interleave = model_type in _INTERLEAVED_BY_DEFAULT
    layers = d.get("num_hidden_layers")
    layers = 1 if layers is None else checks.positive_int("num_hidden_layers", layers)
    bias = d.get("attention_bias")
    if d.get("rms_norm_eps") is not None:
        checks.number("rms_norm_eps", d["rms_norm_eps"], above=0)
    max_pos = d.get("max_position_embeddings")
    name = d.get("_name_or_path") or model_type or "custom"
    theta, scaling = _rope(d)
    return dict(
        hidden_size=d["hidden_size"],
        num_heads=heads,
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"],
        v_head_dim=v_head_dim,
        num_layers=layers,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=checks.boolean("rope_interleave", interleave),
        # transformers' attention builds its two latent norms with eps 1e-6 whatever rms_norm_eps says
        rms_norm_eps=1e-6,
        attention_bias=False if bias is None else checks.boolean("attention_bias", bias),
        max_position_embeddings=4096 if max_pos is None else max_pos,
        name=checks.text("_name_or_path", name),
    )

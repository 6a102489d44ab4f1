"""Read a transformers MLA config (object, dict, config.json or folder) into MLAConfig fields, for
every family `families.FAMILIES` names (a multimodal config: its text config).

Kept apart from `hf.py` so that `MLAConfig.from_hf` never imports transformers.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mlakit import config_checks as checks
from mlakit.hf.families import FAMILIES

# model types whose rope pairs are interleaved unless the config says otherwise
_INTERLEAVED_BY_DEFAULT = {"kimi_k2", "sarvam_mla"} | {
    f.model_type for f in FAMILIES.values() if f.rope in ("complex", "config", "interleave")
}
# model types whose attention ignores rope_interleave (one layout whatever the config says); DeepSeek-V2
# and MiniCPM3 keep reading it, as mlakit always did
_FIXED_LAYOUT = {
    f.model_type: f.rope == "interleave" for f in FAMILIES.values() if f.rope in ("interleave", "half")
}
_FIXED_LAYOUT.pop("minicpm3")
# model types whose q_a/kv_a layernorms take config.rms_norm_eps (the others build them with 1e-6)
_LATENT_EPS_FROM_CONFIG = {"hy_v4_vl_text", "dots3_note_text", "glm5_next_text", "mistral_large4_text"}

# DSA models: the layout of the indexer's rope (DeepSeek-V3.2 half-split, GLM-5 interleaved)
# the indexer's rope layout, read from each family's modeling file (transformers 5.24)
_INDEXER_ROPE_INTERLEAVE = {
    "deepseek_v32": False,
    "glm_moe_dsa": True,
    "axk2": False,
    "hy_v4": False,
    "hy_v4_vl_text": False,
    "mistral_large4": True,
    "mistral_large4_text": True,
}

_REQUIRED = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
# keys whose absence has a default here; a JSON null reads as absent (as transformers' config classes
# take None for "use the default"): num_hidden_layers -> 1, max_position_embeddings -> 4096,
# model_type -> "" (no family: the rope layout and latent eps then follow the generic rules)
NULL_AS_ABSENT = {"num_hidden_layers": 1, "max_position_embeddings": 4096, "model_type": ""}
# transformers' defaults (5.24) for a DSA config that leaves them out: every DSA config class
# defaults index_topk to 2048 (and runs sparse), and the configs whose latent norms read
# rms_norm_eps default it to 1e-5
TRANSFORMERS_INDEX_TOPK = 2048
TRANSFORMERS_RMS_NORM_EPS = 1e-5


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
        if "kv_lora_rank" not in _object_dict(source) and hasattr(source, "get_text_config"):
            source = source.get_text_config()  # a multimodal model: its language model holds the MLA
        d = _object_dict(source)
        # a v5 config standardizes rope into rope_parameters; read it from the object when present
        try:
            rope = getattr(source, "rope_parameters", None)
        except Exception:  # noqa: BLE001 (per-layer configs raise their own error for a global attribute)
            rope = None
        if rope is not None:
            d["rope_parameters"] = dict(rope) if isinstance(rope, dict) else rope
        return d
    raise ValueError(
        f"config source of type {type(source).__name__} is not supported; expected a transformers config, "
        "a dict, a config.json path or a model folder"
    )


def _object_dict(source: Any) -> dict[str, Any]:
    """`source.to_dict()`, refused unless it is a dict (a broken config object returns a list, None...)."""
    to_dict = getattr(source, "to_dict", None)
    if not callable(to_dict):
        raise ValueError(
            f"config object of type {type(source).__name__} has no callable to_dict(); expected a "
            "transformers config"
        )
    d = to_dict()
    if not isinstance(d, dict):
        raise ValueError(
            f"config object of type {type(source).__name__}: to_dict() returned a {type(d).__name__}, "
            "expected a dict of the config's fields"
        )
    return dict(d)


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
        raise ValueError(
            f"{d.get('model_type', 'this config')}: per-layer-type rope_parameters "
            f"({', '.join(params)}) are not supported for MLA configs"
        )
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
    """MLAConfig keyword arguments from a transformers config dict (a multimodal one: its text_config).
    A JSON null reads as an absent key wherever a default exists (`NULL_AS_ABSENT`, rope_scaling,
    rope_parameters, attention_bias, rms_norm_eps, index_topk); the widths `_REQUIRED` are required."""
    if "kv_lora_rank" not in d and isinstance(d.get("text_config"), dict):
        d = d["text_config"]
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
    interleave = _FIXED_LAYOUT.get(model_type, d.get("rope_interleave"))
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
        num_layers=_num_layers(d, layers),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=checks.boolean("rope_interleave", interleave),
        # most families build the two latent norms with eps 1e-6 whatever rms_norm_eps says
        rms_norm_eps=_latent_eps(d, model_type),
        attention_bias=False if bias is None else checks.boolean("attention_bias", bias),
        max_position_embeddings=4096 if max_pos is None else max_pos,
        name=checks.text("_name_or_path", name),
        **indexer_kwargs(d),
    )


def _latent_eps(d: dict[str, Any], model_type: str) -> float:
    """The eps of the two latent norms: most families build them with 1e-6 whatever rms_norm_eps says;
    the others read rms_norm_eps (transformers' default 1e-5 when the config leaves it out)."""
    if model_type not in _LATENT_EPS_FROM_CONFIG:
        return 1e-6
    eps = d.get("rms_norm_eps")
    return TRANSFORMERS_RMS_NORM_EPS if eps is None else eps


def indexer_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    """The DSA fields of a config dict ({} for dense MLA); an unknown indexer rope layout raises. A config
    with indexer widths (index_n_heads, index_head_dim) but no index_topk is DSA with transformers'
    default index_topk (2048), as transformers loads it: never silently dense."""
    has_indexer = d.get("index_n_heads") is not None or d.get("index_head_dim") is not None
    if d.get("index_topk") is None and not has_indexer:
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
        index_topk=TRANSFORMERS_INDEX_TOPK if d.get("index_topk") is None else d["index_topk"],
        indexer_rope_interleave=checks.boolean("indexer_rope_interleave", interleave),
    )


def _num_layers(d: dict[str, Any], layers: int) -> int:
    """MLA layers (what the latent cache holds): LongCat-Flash has two per decoder layer and names them
    num_layers; a hybrid (Kimi Linear, Ling 3) counts the layers that are not linear attention."""
    if d.get("model_type") == "longcat_flash" and d.get("num_hidden_layers") is None:
        return 2 * checks.positive_int("num_layers", d.get("num_layers"))
    kinds = d.get("layer_types")
    if isinstance(kinds, list) and "linear_attention" in kinds:
        return sum(kind != "linear_attention" for kind in kinds)
    return layers

"""Hostile configs: every bad field is a ValueError naming it; whatever is accepted builds and runs a layer.

A table of the failure classes found by fuzzing (wrong types, out-of-range values, YaRN sub-keys,
broken config.json files), then a hypothesis fuzz that mutates valid config dicts at random.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.common import tiny_config, yarn_scaling

from mlakit import MLAConfig
from mlakit.attention import MLAAttention

# a tiny DeepSeek-V3-style config.json (what from_hf reads)
HF = {
    "model_type": "deepseek_v3",
    "hidden_size": 32,
    "num_attention_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 12,
    "qk_nope_head_dim": 6,
    "qk_rope_head_dim": 4,
    "v_head_dim": 5,
    "num_hidden_layers": 2,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "rope_interleave": True,
}


def yarn(**changes):
    return {**yarn_scaling(), **changes}


def hf_yarn(**changes):
    return {**HF, "rope_scaling": {**HF["rope_scaling"], **changes}}


# (id, MLAConfig keyword changes to tiny_config, field the message must name)
CTOR = [
    ("interleave-str", {"rope_interleave": "false"}, "rope_interleave"),
    ("interleave-int", {"rope_interleave": 1}, "rope_interleave"),
    ("interleave-none", {"rope_interleave": None}, "rope_interleave"),
    ("bias-str", {"attention_bias": "false"}, "attention_bias"),
    ("bias-list", {"attention_bias": []}, "attention_bias"),
    ("theta-none", {"rope_theta": None}, "rope_theta"),
    ("theta-list", {"rope_theta": [1.0]}, "rope_theta"),
    ("theta-dict", {"rope_theta": {}}, "rope_theta"),
    ("theta-str", {"rope_theta": "abc"}, "rope_theta"),
    ("theta-nan", {"rope_theta": math.nan}, "rope_theta"),
    ("theta-inf", {"rope_theta": math.inf}, "rope_theta"),
    ("theta-bool", {"rope_theta": True}, "rope_theta"),
    ("theta-1-yarn", {"rope_theta": 1.0, "rope_scaling": yarn()}, "rope_theta"),
    ("theta-half-yarn", {"rope_theta": 0.5, "rope_scaling": yarn()}, "rope_theta"),
    ("eps-str", {"rms_norm_eps": "abc"}, "rms_norm_eps"),
    ("eps-negative", {"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ("heads-str", {"num_heads": "4"}, "num_heads"),
    ("heads-float", {"num_heads": 4.0}, "num_heads"),
    ("max-pos-str", {"max_position_embeddings": "4096"}, "max_position_embeddings"),
    ("max-pos-float", {"max_position_embeddings": 4096.0}, "max_position_embeddings"),
    ("max-pos-zero", {"max_position_embeddings": 0}, "max_position_embeddings"),
    ("max-pos-none", {"max_position_embeddings": None}, "max_position_embeddings"),
    ("name-int", {"name": 3}, "name"),
    ("scaling-str", {"rope_scaling": "yarn"}, "rope_scaling"),
    ("scaling-list", {"rope_scaling": [("rope_type", "yarn")]}, "rope_scaling"),
    ("scaling-type-int", {"rope_scaling": {"rope_type": 1}}, "rope_type"),
    ("factor-list", {"rope_scaling": yarn(factor=[4.0])}, "factor"),
    ("factor-str", {"rope_scaling": yarn(factor="4")}, "factor"),
    ("factor-nan", {"rope_scaling": yarn(factor=math.nan)}, "factor"),
    ("factor-negative", {"rope_scaling": yarn(factor=-2.0)}, "factor"),
    ("original-str", {"rope_scaling": yarn(original_max_position_embeddings="abc")}, "original_max"),
    ("original-zero", {"rope_scaling": yarn(original_max_position_embeddings=0)}, "original_max"),
    ("original-negative", {"rope_scaling": yarn(original_max_position_embeddings=-1)}, "original_max"),
    ("original-nan", {"rope_scaling": yarn(original_max_position_embeddings=math.nan)}, "original_max"),
    ("original-float", {"rope_scaling": yarn(original_max_position_embeddings=16.0)}, "original_max"),
    ("beta-fast-negative", {"rope_scaling": yarn(beta_fast=-1)}, "beta_fast"),
    ("beta-slow-negative", {"rope_scaling": yarn(beta_slow=-1)}, "beta_slow"),
    ("beta-fast-zero", {"rope_scaling": yarn(beta_fast=0)}, "beta_fast"),
    ("beta-fast-below-slow", {"rope_scaling": yarn(beta_fast=1, beta_slow=2)}, "beta_fast"),
    ("mscale-all-dim-str", {"rope_scaling": yarn(mscale_all_dim="1")}, "mscale_all_dim"),
    ("mscale-negative", {"rope_scaling": yarn(mscale=-1.0)}, "mscale"),
    ("mscale-overflow", {"rope_scaling": yarn(mscale_all_dim=1e307)}, "mscale_all_dim"),
    ("mscale-huge", {"rope_scaling": yarn(mscale_all_dim=2.0**70)}, "mscale_all_dim"),
    ("attention-factor-huge", {"rope_scaling": yarn(attention_factor=2.0**70)}, "attention_factor"),
    ("beta-fast-huge", {"rope_scaling": yarn(beta_fast=1e308)}, "beta_fast"),
    ("factor-below-one", {"rope_scaling": yarn(factor=1e-300)}, "factor"),
    ("attention-factor-zero", {"rope_scaling": yarn(attention_factor=0.0)}, "attention_factor"),
    ("truncate-str", {"rope_scaling": yarn(truncate="no")}, "truncate"),
]


@pytest.mark.parametrize("changes, field", [c[1:] for c in CTOR], ids=[c[0] for c in CTOR])
def test_constructor_refuses_and_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**changes)


def drop(key):
    return {k: v for k, v in HF.items() if k != key}


# (id, config dict given to from_hf, field the message must name)
FROM_HF = [
    ("interleave-str", {**HF, "rope_interleave": "false"}, "rope_interleave"),
    ("bias-str", {**HF, "attention_bias": "false"}, "attention_bias"),
    ("bias-int", {**HF, "attention_bias": 0}, "attention_bias"),
    ("heads-zero-no-v", {**drop("v_head_dim"), "num_attention_heads": 0}, "num_attention_heads"),
    ("heads-str", {**HF, "num_attention_heads": "4"}, "num_attention_heads"),
    ("heads-above-hidden-no-v", {**drop("v_head_dim"), "num_attention_heads": 64}, "v_head_dim"),
    ("hidden-str-no-v", {**drop("v_head_dim"), "hidden_size": "32"}, "hidden_size"),
    ("model-type-list", {**HF, "model_type": []}, "model_type"),
    ("model-type-list-no-interleave", {**drop("rope_interleave"), "model_type": []}, "model_type"),
    ("theta-none", {**HF, "rope_theta": None, "rope_scaling": None}, "rope_theta"),
    ("theta-str", {**HF, "rope_theta": "abc"}, "rope_theta"),
    ("eps-str", {**HF, "rms_norm_eps": "abc"}, "rms_norm_eps"),
    ("layers-str", {**HF, "num_hidden_layers": "2"}, "num_hidden_layers"),
    ("layers-zero", {**HF, "num_hidden_layers": 0}, "num_hidden_layers"),
    ("scaling-str", {**HF, "rope_scaling": "yarn"}, "rope_scaling"),
    ("scaling-int", {**HF, "rope_scaling": 4}, "rope_scaling"),
    ("parameters-str", {**HF, "rope_scaling": None, "rope_parameters": "yarn"}, "rope_parameters"),
    ("factor-list", hf_yarn(factor=[4]), "factor"),
    ("original-str", hf_yarn(original_max_position_embeddings="abc"), "original_max"),
    ("beta-slow-negative", hf_yarn(beta_slow=-1), "beta_slow"),
    ("max-pos-str", {**HF, "max_position_embeddings": "64"}, "max_position_embeddings"),
    (
        "max-pos-list-as-original",
        {**HF, "rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": [64]},
        "max_position_embeddings",
    ),
    ("q-lora-str", {**HF, "q_lora_rank": "16"}, "q_lora_rank"),
    ("name-int", {**HF, "_name_or_path": 7}, "_name_or_path"),
]


@pytest.mark.parametrize("d, field", [c[1:] for c in FROM_HF], ids=[c[0] for c in FROM_HF])
def test_from_hf_refuses_and_names_the_field(d, field):
    with pytest.raises(ValueError, match=field):
        MLAConfig.from_hf(d)


CONFIG_FILES = {
    "not-json": b"{hidden_size: 32",
    "empty": b"",
    "truncated": json.dumps(HF).encode()[:-7],
    "binary": bytes(range(256)),
    "bom": b"\xef\xbb\xbf" + json.dumps(HF).encode(),
    "json-list": b"[1, 2]",
    "json-string": b'"deepseek_v3"',
    "json-number": b"3",
    "json-null": b"null",
}


@pytest.mark.parametrize("content", list(CONFIG_FILES.values()), ids=list(CONFIG_FILES))
def test_broken_config_json_names_the_file(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    for source in (path, tmp_path, str(tmp_path)):
        with pytest.raises(ValueError, match="config file .*config.json"):
            MLAConfig.from_hf(source)
    with pytest.raises(ValueError, match="config.json"):
        MLAConfig.resolve(str(path))


@pytest.mark.parametrize("value", [None, 3, ["deepseek-v3"], b"deepseek-v3"], ids=repr)
def test_preset_and_resolve_refuse_non_strings(value):
    with pytest.raises(ValueError, match="preset"):
        MLAConfig.preset(value)
    with pytest.raises(ValueError, match="model"):
        MLAConfig.resolve(value)


def test_accepted_values_are_normalized_to_plain_types():
    np = pytest.importorskip("numpy")
    cfg = tiny_config(num_heads=np.int64(3), rope_theta=10000, rope_scaling=yarn(factor=4, beta_fast=32))
    assert type(cfg.num_heads) is int and type(cfg.rope_theta) is float
    assert type(cfg.rope_scaling["factor"]) is float and type(cfg.rope_scaling["beta_fast"]) is float
    assert MLAConfig.from_hf({**HF, "rope_interleave": False}).rope_interleave is False


# ---------------------------------------------------------------- hypothesis fuzz

GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.sampled_from([2**70, -(2**70)]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.text(max_size=4),
    st.sampled_from(["true", "false", "yarn", "default", "4", "1e-6"]),
    st.lists(st.integers(0, 4), max_size=2),
    st.dictionaries(st.sampled_from(["type", "factor"]), st.integers(0, 4), max_size=2),
)
TOP_KEYS = sorted(HF) + ["rope_parameters", "_name_or_path"]
YARN_SUBKEYS = [
    "type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
]


@st.composite
def mutated_config(draw):
    d = json.loads(json.dumps(HF))
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            d[draw(st.sampled_from(TOP_KEYS))] = draw(GARBAGE)
        elif isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"][draw(st.sampled_from(YARN_SUBKEYS))] = draw(GARBAGE)
    return d


@st.composite
def mutated_kwargs(draw):
    d = MLAConfig.from_hf(HF).to_dict()
    fields = sorted(d)
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()) or not isinstance(d.get("rope_scaling"), dict):
            d[draw(st.sampled_from(fields))] = draw(GARBAGE)
        else:
            d["rope_scaling"][draw(st.sampled_from(YARN_SUBKEYS))] = draw(GARBAGE)
    return d


def small_enough(cfg: MLAConfig) -> bool:
    widths = (cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank or 1, cfg.kv_lora_rank, cfg.qk_head_dim)
    return max(widths) <= 80 and cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) <= 2000


def runs_one_forward(cfg: MLAConfig) -> None:
    torch.manual_seed(0)
    layer = MLAAttention(cfg)
    hidden = torch.randn(1, 3, cfg.hidden_size)
    with torch.no_grad():
        out = layer(hidden)
    assert out.shape == hidden.shape
    assert bool(torch.isfinite(out).all()), cfg


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_config())
def test_mutated_configs_give_a_value_error_or_a_working_config(d):
    try:
        cfg = MLAConfig.from_hf(d)
    except ValueError:
        return
    check_working(cfg)


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_kwargs())
def test_mutated_constructor_arguments_give_a_value_error_or_a_working_config(kwargs):
    try:
        cfg = MLAConfig(**kwargs)
    except ValueError:
        return
    check_working(cfg)


def check_working(cfg: MLAConfig) -> None:
    """Plain types stored, a finite scale, and a layer that builds and (when small) runs."""
    assert isinstance(cfg.rope_interleave, bool) and isinstance(cfg.attention_bias, bool)
    assert all(
        type(getattr(cfg, f)) is int for f in ("hidden_size", "num_heads", "kv_lora_rank", "num_layers")
    )
    assert isinstance(cfg.rope_theta, float) and math.isfinite(cfg.softmax_scale) and cfg.softmax_scale > 0
    if small_enough(cfg):
        runs_one_forward(cfg)
    else:
        MLAAttention(cfg, device="meta")

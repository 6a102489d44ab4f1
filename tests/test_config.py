"""MLAConfig: published presets, invariants, softmax scale, and from_hf from every kind of source."""

from __future__ import annotations

import json

import pytest
from support.common import tiny_config, yarn_scaling

from mlakit import PRESETS, MLAConfig

# (preset, hidden, heads, q_lora_rank, kv_lora_rank, nope, rope, v, layers), from each model's config.json
PUBLISHED = [
    ("deepseek-v2", 5120, 128, 1536, 512, 128, 64, 128, 60),
    ("deepseek-v2-lite", 2048, 16, None, 512, 128, 64, 128, 27),
    ("deepseek-v3", 7168, 128, 1536, 512, 128, 64, 128, 61),
    ("deepseek-v3.2", 7168, 128, 1536, 512, 128, 64, 128, 61),
    ("kimi-k2", 7168, 64, 1536, 512, 128, 64, 128, 61),
    ("glm-4.7-flash", 2048, 20, 768, 512, 192, 64, 256, 47),
    ("glm-5", 6144, 64, 2048, 512, 192, 64, 256, 78),
    ("minicpm3-4b", 2560, 40, 768, 256, 64, 32, 64, 62),
    # from the transformers 5.24 config class defaults; tests/test_hf_families.py checks them against it
    ("youtu-llm-2b", 2048, 16, 1536, 512, 128, 64, 128, 32),
    ("ax-k1", 7168, 64, 1536, 512, 128, 64, 128, 61),
    ("mistral-small-4", 4096, 32, 1024, 256, 64, 64, 128, 36),
    ("longcat-flash", 6144, 64, 1536, 512, 128, 64, 128, 56),
    ("kimi-linear-48b", 2304, 32, None, 512, 128, 64, 128, 6),
    ("ling-3-flash", 2560, 32, None, 512, 128, 64, 128, 7),
    ("hy4-preview", 2816, 32, 1536, 512, 192, 64, 256, 34),
    ("ax-k2", 2048, 32, 384, 128, 64, 32, 64, 48),
    ("mistral-large-4", 6144, 64, None, 512, 64, 64, 128, 72),
]


@pytest.mark.parametrize("row", PUBLISHED, ids=[r[0] for r in PUBLISHED])
def test_preset_widths_are_published(row):
    name, *widths = row
    cfg = MLAConfig.preset(name)
    got = [
        cfg.hidden_size,
        cfg.num_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.num_layers,
    ]
    assert got == widths
    assert cfg.name == name


def test_every_preset_is_tested_and_preset_names_are_case_insensitive():
    assert sorted(PRESETS) == sorted(r[0] for r in PUBLISHED)
    assert MLAConfig.preset("DeepSeek-V3") == MLAConfig.preset("deepseek-v3")


def test_minicpm3_value_width_is_hidden_over_heads():
    assert MLAConfig.preset("minicpm3-4b").v_head_dim == 2560 // 40 == 64


@pytest.mark.parametrize(
    "name,theta,factor,interleave",
    [
        ("deepseek-v3", 10000.0, 40, True),
        ("deepseek-v2", 10000.0, 40, True),
        ("kimi-k2", 50000.0, 32, True),
        ("glm-5", 1e6, None, True),
        ("glm-4.7-flash", 1e6, None, True),
        ("minicpm3-4b", 10000.0, None, False),
    ],
    ids=lambda v: str(v),
)
def test_preset_rope_settings(name, theta, factor, interleave):
    cfg = MLAConfig.preset(name)
    assert cfg.rope_theta == theta
    assert cfg.rope_interleave is interleave
    assert (cfg.rope_scaling or {}).get("factor") == factor


def test_derived_widths_of_v3():
    cfg = MLAConfig.preset("deepseek-v3")
    assert cfg.qk_head_dim == 192
    assert cfg.latent_dim == 576


def test_v3_softmax_scale_by_hand():
    # 192^-0.5 = 0.0721687836, mscale(40, 1.0) = 0.1·ln 40 + 1 = 1.3688879454 -> 0.0721687836 · 1.3688879454²
    assert MLAConfig.preset("deepseek-v3").softmax_scale == pytest.approx(0.1352337788608801, rel=1e-12)
    # never the latent width: 576^-0.5 = 0.0417
    assert MLAConfig.preset("deepseek-v3").softmax_scale != pytest.approx(576**-0.5, rel=1e-2)


def test_v2_softmax_scale_by_hand():
    # mscale(40, 0.707) = 0.0707·ln 40 + 1 = 1.2608037774
    assert MLAConfig.preset("deepseek-v2").softmax_scale == pytest.approx(0.1147213867929261, rel=1e-12)


def test_softmax_scale_without_yarn_or_without_mscale_all_dim():
    assert MLAConfig.preset("glm-5").softmax_scale == pytest.approx(256**-0.5)
    cfg = tiny_config(rope_scaling={**yarn_scaling(), "mscale_all_dim": None})
    assert cfg.softmax_scale == pytest.approx(10**-0.5)


WIDTH_FIELDS = [
    "hidden_size",
    "num_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_layers",
]


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, "8"], ids=["zero", "negative", "float", "bool", "str"])
@pytest.mark.parametrize("field", WIDTH_FIELDS)
def test_invalid_width_names_the_field(field, bad):
    with pytest.raises(ValueError, match=field):
        tiny_config(**{field: bad})


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"qk_rope_head_dim": 5}, "qk_rope_head_dim"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}}, "factor"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 4}},
            "factor",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
        ({"rope_scaling": "yarn"}, "rope_scaling"),
    ],
    ids=["odd-rope", "theta", "eps", "yarn-no-factor", "yarn-zero-factor", "yarn-no-original", "not-a-dict"],
)
def test_invalid_settings_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**changes)


@pytest.mark.parametrize("kind", ["longrope", "linear", "dynamic", "llama3"])
def test_unknown_rope_type_is_named(kind):
    with pytest.raises(ValueError, match=kind):
        tiny_config(rope_scaling={"rope_type": kind, "factor": 2.0})
    with pytest.raises(ValueError, match=kind):
        MLAConfig.from_hf({**V3_JSON, "rope_scaling": {"type": kind, "factor": 2.0}})
    with pytest.raises(ValueError, match=kind):
        MLAConfig.from_hf({**V3_JSON, "rope_scaling": None, "rope_parameters": {"rope_type": kind}})


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="deepseek-v9"):
        MLAConfig.preset("deepseek-v9")


# ---------------------------------------------------------------- from_hf

# DeepSeek-V3's published config.json, the keys an attention layer reads
V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_hidden_layers": 61,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "attention_bias": False,
}

MINICPM3_JSON = {
    "model_type": "minicpm3",
    "hidden_size": 2560,
    "num_attention_heads": 40,
    "q_lora_rank": 768,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "num_hidden_layers": 62,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
}


@pytest.fixture
def v3_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V3_JSON))
    return tmp_path


@pytest.mark.parametrize("kind", ["dict", "json-path", "folder-path", "folder-str"])
def test_from_hf_sources_give_the_v3_preset(kind, v3_folder):
    source = {
        "dict": V3_JSON,
        "json-path": str(v3_folder / "config.json"),
        "folder-path": v3_folder,
        "folder-str": str(v3_folder),
    }[kind]
    cfg = MLAConfig.from_hf(source)
    assert cfg == MLAConfig.preset("deepseek-v3")
    assert cfg.softmax_scale == pytest.approx(0.1352337788608801, rel=1e-12)


def test_from_hf_transformers_object_gives_the_v3_preset():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3Config(**{k: v for k, v in V3_JSON.items() if k != "model_type"})
    assert MLAConfig.from_hf(hf) == MLAConfig.preset("deepseek-v3")


def test_from_hf_rope_parameters_style():
    # transformers 5 writes theta and scaling into one `rope_parameters` dict
    scaling = {k: v for k, v in V3_JSON["rope_scaling"].items() if k != "type"}
    d = {**V3_JSON, "rope_scaling": None, "rope_theta": None}
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, **scaling}
    assert MLAConfig.from_hf(d) == MLAConfig.preset("deepseek-v3")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": None},
        {"rope_scaling": {"type": "default"}},
        {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ],
    ids=["none", "default-scaling", "default-parameters"],
)
def test_from_hf_default_rope(rope):
    cfg = MLAConfig.from_hf({**V3_JSON, **rope})
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0
    assert cfg.softmax_scale == pytest.approx(192**-0.5)


def test_from_hf_yarn_without_original_takes_max_position_embeddings():
    scaling = {"type": "yarn", "factor": 4.0}
    cfg = MLAConfig.from_hf({**V3_JSON, "rope_scaling": scaling, "max_position_embeddings": 2048})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 2048


def test_from_hf_v_head_dim_none_is_hidden_over_heads():
    cfg = MLAConfig.from_hf(MINICPM3_JSON)
    assert cfg.v_head_dim == 64
    assert cfg.rope_interleave is False
    assert cfg == MLAConfig.preset("minicpm3-4b")
    assert MLAConfig.from_hf({**MINICPM3_JSON, "v_head_dim": None}).v_head_dim == 64
    # not the nope width: with nope 96 the value width stays 2560 / 40
    assert MLAConfig.from_hf({**MINICPM3_JSON, "qk_nope_head_dim": 96}).v_head_dim == 64


@pytest.mark.parametrize(
    "model_type,interleave",
    [("deepseek_v2", True), ("deepseek_v3", True), ("glm4_moe_lite", True), ("minicpm3", False)],
)
def test_from_hf_layout_defaults_and_override(model_type, interleave):
    d = {**V3_JSON, "model_type": model_type}
    assert MLAConfig.from_hf(d).rope_interleave is interleave
    assert MLAConfig.from_hf({**d, "rope_interleave": not interleave}).rope_interleave is (not interleave)


def test_from_hf_q_lora_rank_none():
    assert MLAConfig.from_hf({**V3_JSON, "q_lora_rank": None}).q_lora_rank is None


@pytest.mark.parametrize(
    "missing", ["hidden_size", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim"]
)
def test_from_hf_missing_width_is_named(missing):
    d = {k: v for k, v in V3_JSON.items() if k != missing}
    with pytest.raises(ValueError, match=missing):
        MLAConfig.from_hf(d)


def test_from_hf_bad_width_is_named():
    with pytest.raises(ValueError, match="qk_nope_head_dim"):
        MLAConfig.from_hf({**V3_JSON, "qk_nope_head_dim": 0})


@pytest.mark.parametrize("source", [42, "/no/such/folder"], ids=["int", "missing-path"])
def test_from_hf_bad_source(source):
    with pytest.raises(ValueError, match="config"):
        MLAConfig.from_hf(source)


class _BrokenConfig:
    """A config object whose to_dict() returns `value` (a list, None, a string...) instead of a dict."""

    def __init__(self, value, text=None):
        self.value, self.text = value, text

    def to_dict(self):
        return self.value

    def get_text_config(self):
        return self.text


@pytest.mark.parametrize(
    "source,match",
    [
        (_BrokenConfig([1, 2]), "to_dict\\(\\) returned a list, expected a dict"),
        (_BrokenConfig(None), "to_dict\\(\\) returned a NoneType, expected a dict"),
        (_BrokenConfig("kv_lora_rank"), "to_dict\\(\\) returned a str, expected a dict"),
        (_BrokenConfig({}, text=_BrokenConfig([3])), "to_dict\\(\\) returned a list"),
        (_BrokenConfig({}, text=None), "NoneType has no callable to_dict"),
    ],
    ids=["list", "none", "str", "text-config-list", "text-config-none"],
)
def test_from_hf_broken_config_object_is_a_value_error(source, match):
    with pytest.raises(ValueError, match=match):
        MLAConfig.from_hf(source)


@pytest.mark.parametrize("top", ["[1, 2]", "null", '"deepseek"', "7"], ids=["list", "null", "str", "int"])
def test_from_hf_config_json_top_level_not_an_object(tmp_path, top):
    (tmp_path / "config.json").write_text(top)
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object"):
        MLAConfig.from_hf(tmp_path)


def test_resolve(v3_folder):
    assert MLAConfig.resolve("deepseek-v3") == MLAConfig.preset("deepseek-v3")
    assert MLAConfig.resolve(str(v3_folder)) == MLAConfig.preset("deepseek-v3")
    cfg = tiny_config()
    assert MLAConfig.resolve(cfg) is cfg
    with pytest.raises(ValueError, match="no-such-model"):
        MLAConfig.resolve("no-such-model")


def test_to_dict_round_trips():
    cfg = MLAConfig.preset("kimi-k2")
    assert MLAConfig(**cfg.to_dict()) == cfg


def test_from_hf_dsa_without_index_topk_is_sparse_with_transformers_default():
    from support.dsa import hf_config

    d = hf_config("v32").to_dict()
    d.pop("index_topk")
    theirs = type(hf_config("v32"))(**d)
    cfg = MLAConfig.from_hf(d)
    assert cfg.is_sparse and cfg.index_topk == theirs.index_topk == 2048


def test_from_hf_mistral_large4_text_without_rms_norm_eps_takes_transformers_default():
    from support.dsa import hf_config
    from transformers import CONFIG_MAPPING

    d = hf_config("v32").to_dict()
    d.update(model_type="mistral_large4_text")
    d.pop("rms_norm_eps")
    assert MLAConfig.from_hf(d).rms_norm_eps == CONFIG_MAPPING["mistral_large4_text"]().rms_norm_eps


@pytest.mark.parametrize("key", ["num_hidden_layers", "max_position_embeddings", "model_type"])
def test_from_hf_reads_json_null_as_absent_as_documented(key):
    from support.dsa import hf_config

    from mlakit.hf.config import NULL_AS_ABSENT

    d = hf_config("v32").to_dict()
    d.pop("index_topk")  # a model_type-free DSA config: read without its family's indexer rope table
    d["indexer_rope_interleave"] = False
    nulled, dropped = dict(d, **{key: None}), {k: v for k, v in d.items() if k != key}
    assert MLAConfig.from_hf(nulled) == MLAConfig.from_hf(dropped)
    assert key in NULL_AS_ABSENT

"""V4Attention (prefill, no cache) against transformers' DeepseekV4Attention (eager, fp32) and against
mlakit's own fp64 reference, for every layer type; V4Config checks and presets."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_close
from support.v4 import TYPES, HFRunner, hf_config, pair

from mlakit.v4 import V4Attention, V4Config
from mlakit.v4.reference import v4_reference

CFG = hf_config()


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["window", "csa", "hca"])
@pytest.mark.parametrize("b,s", [(1, 1), (2, 5), (1, 16), (2, 37)], ids=lambda v: str(v))
def test_prefill_matches_transformers(layer, b, s):
    ref, ours = pair(CFG, layer)
    torch.manual_seed(s)
    h = torch.randn(b, s, 32)
    want = HFRunner(CFG, ref).step(h, use_cache=False)
    with torch.no_grad():
        got = ours(h)
    assert_close(f"{TYPES[layer]} B{b}-S{s}", got, want, 2e-6)


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["window", "csa", "hca"])
def test_fp64_reference(layer):
    _, ours = pair(CFG, layer)
    torch.manual_seed(3)
    h = torch.randn(1, 41, 32)
    want = v4_reference(ours, h[0])
    with torch.no_grad():
        got64 = ours.double()(h.double())[0]
    assert_close("fp64 layer vs reference", got64, want, 1e-12)
    with torch.no_grad():
        got32 = ours.float()(h)[0]
    assert_close("fp32 layer vs reference", got32.double(), want, 2e-6)


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["window", "csa", "hca"])
def test_ragged_one_layer_call(layer):
    """Right-padded rows through new_tokens equal each row alone; padding outputs are 0."""
    _, ours = pair(CFG, layer)
    torch.manual_seed(4)
    h = torch.randn(3, 23, 32)
    counts = [23, 9, 17]
    with torch.no_grad():
        got = ours(h, new_tokens=counts)
        for r, n in enumerate(counts):
            assert_close(f"row {r}", got[r, :n], ours(h[r : r + 1, :n])[0], 1e-6)
            assert torch.all(got[r, n:] == 0)


def test_config_from_hf_and_presets():
    cfg = V4Config.from_hf(CFG)
    assert cfg.layer_types == tuple(TYPES) and cfg.csa_ratio == 4 and cfg.hca_ratio == 16
    assert cfg.qk_rope_head_dim == 8 and cfg.rope_scaling["factor"] == 4.0
    flash, pro = V4Config.preset("deepseek-v4-flash"), V4Config.preset("deepseek-v4-pro")
    assert (
        flash.num_layers,
        flash.count("sliding_attention"),
        flash.count("compressed_sparse_attention"),
    ) == (
        43,
        2,
        21,
    )
    assert (
        pro.num_layers,
        pro.count("heavily_compressed_attention"),
        pro.count("compressed_sparse_attention"),
    ) == (
        61,
        31,
        30,
    )
    # the published config.json form: per-layer compress_ratios with the MTP layer's entry last
    d = {**flash.to_dict(), "num_attention_heads": 64, "num_hidden_layers": 43}
    d["compress_ratios"] = [0, 0] + [4, 128] * 20 + [4, 0]
    d.pop("layer_types")
    assert V4Config.from_hf(d).layer_types == flash.layer_types


def test_rope_tables_match_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rot = DeepseekV4RotaryEmbedding(CFG)
    for layer, label in ((0, "main"), (1, "compress")):
        ours = V4Attention(V4Config.from_hf(CFG), layer_idx=layer)
        torch.testing.assert_close(ours.inv_freq, getattr(rot, f"{label}_inv_freq"), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "field,value",
    [
        ("head_dim", 8),
        ("o_groups", 3),
        ("layer_types", ["full_attention"]),
        ("layer_types", []),
        ("csa_ratio", 0),
        ("index_topk", 1.5),
        ("attention_sink", "yes"),
        ("sliding_window", True),
    ],
)
def test_config_refusals_name_the_field(field, value):
    kw = V4Config.from_hf(CFG).to_dict()
    kw[field] = value
    with pytest.raises(ValueError, match=field if field != "head_dim" else "head_dim"):
        V4Config(**kw)


def test_o_groups_must_split_whole_heads_in_constructor_and_from_hf():
    """6 heads in 4 groups: num_heads * head_dim divides by 4, the heads do not; both entry points refuse."""
    kw = V4Config.from_hf(CFG).to_dict() | {"num_heads": 6, "o_groups": 4}
    with pytest.raises(ValueError, match=r"o_groups must divide num_heads \(6\).*got 4"):
        V4Config(**kw)
    hf = CFG.to_dict() | {"num_attention_heads": 6, "o_groups": 4}
    with pytest.raises(ValueError, match=r"o_groups must divide num_heads \(6\).*got 4"):
        V4Config.from_hf(hf)
    assert V4Config.from_hf(hf | {"o_groups": 3}).o_groups == 3


@pytest.mark.parametrize(
    "key,value",
    [
        ("layer_types", {"a": 1}),
        ("layer_types", 3.5),
        ("compress_rates", [1]),
        ("compress_rates", 4),
        ("rope_parameters", None),
        ("partial_rotary_factor", [1]),
    ],
    ids=["types-dict", "types-float", "rates-list", "rates-int", "no-rope-then-bad-scaling", "factor-list"],
)
def test_from_hf_wrong_json_kinds_are_value_errors(key, value):
    d = CFG.to_dict()
    d[key] = value
    if key == "rope_parameters":
        d["rope_scaling"] = [1]
        key = "rope_scaling"
    if key == "partial_rotary_factor":
        d.pop("qk_rope_head_dim", None)
    with pytest.raises(ValueError, match=key):
        V4Config.from_hf(d)


def test_layer_refusals():
    cfg = V4Config.from_hf(CFG)
    with pytest.raises(ValueError, match="layer_idx"):
        V4Attention(cfg, layer_idx=3)
    with pytest.raises(ValueError, match="width 31"):
        V4Attention(cfg, layer_idx=0)(torch.randn(1, 2, 31))


def test_from_hf_reads_a_published_config_folder(tmp_path):
    """A config.json as DeepSeek publishes it (per-layer compress_ratios with the MTP entry, rope_scaling)."""
    import json

    pro = V4Config.preset("deepseek-v4-pro")
    published = {
        "model_type": "deepseek_v4",
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_key_value_heads": 1,
        "num_hidden_layers": 61,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1536,
        "o_groups": 16,
        "o_lora_rank": 1024,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 1024,
        "sliding_window": 128,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "type": "yarn",
        },
        "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    got = V4Config.from_hf(str(tmp_path))
    assert got.to_dict() | {"name": pro.name} == pro.to_dict()
    from mlakit.commands.v4 import is_v4

    assert is_v4(str(tmp_path)) and not is_v4("deepseek-v3")

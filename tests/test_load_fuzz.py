"""Hostile checkpoints and arguments for load_attention: a ValueError that says what and where, or a layer.

Each case builds a tiny two-layer safetensors checkpoint in tmp_path (no transformers needed), breaks
one thing, and expects the message to name it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from mlakit.attention import MLAAttention  # noqa: E402
from mlakit.config import MLAConfig  # noqa: E402
from mlakit.hf import load_attention  # noqa: E402
from mlakit.hf.load import INDEX_FILE  # noqa: E402

CONFIG = {
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
    "torch_dtype": "float32",
}
KV_B = "model.layers.1.self_attn.kv_b_proj.weight"


def layer_tensors(layer: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(layer)
    module = MLAAttention(MLAConfig.from_hf(CONFIG))
    prefix = f"model.layers.{layer}.self_attn."
    return {prefix + k: v.detach().clone() for k, v in module.state_dict().items()}


def to_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every 2D weight as e4m3 with a [1, 1] fp32 scale (the tiny widths fit one 128x128 block)."""
    out = {}
    for name, t in tensors.items():
        if t.dim() == 2:
            out[name] = (t * 64).to(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = torch.full((1, 1), 1 / 64)
        else:
            out[name] = t
    return out


def write_checkpoint(folder, config=None, tensors=None, fp8=False):
    os.makedirs(folder, exist_ok=True)
    if tensors is None:
        tensors = {**layer_tensors(0), **layer_tensors(1)}
        tensors = to_fp8(tensors) if fp8 else tensors
    if config is None:
        config = dict(CONFIG)
        if fp8:
            config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    safetensors_torch.save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def with_config(**changes):
    return lambda folder: write_checkpoint(folder, config={**CONFIG, **changes})


def with_fp8_tensor(name: str, value):
    def build(folder):
        tensors = to_fp8({**layer_tensors(0), **layer_tensors(1)})
        tensors[name] = value(tensors[name])
        config = {**CONFIG, "quantization_config": {"weight_block_size": [128, 128]}}
        write_checkpoint(folder, config=config, tensors=tensors)

    return build


def with_tensor(name: str, value):
    def build(folder):
        tensors = {**layer_tensors(0), **layer_tensors(1)}
        tensors[name] = value(tensors[name])
        write_checkpoint(folder, tensors=tensors)

    return build


def poke(value):
    def change(t):
        t = t.clone()
        t.view(-1)[-1] = value
        return t

    return change


def write_file(name: str, data: bytes):
    def build(folder):
        write_checkpoint(folder)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)

    return build


SCALE = KV_B + "_scale_inv"
# (id, build(folder), load_attention kwargs, message regex)
CASES = [
    ("folder-none", None, dict(path=None), "path must be a checkpoint folder"),
    ("folder-int", None, dict(path=3), "path must be a checkpoint folder"),
    ("dtype-int32", write_checkpoint, dict(dtype=torch.int32), "dtype must be None or one of"),
    ("dtype-bool", write_checkpoint, dict(dtype=torch.bool), "dtype must be None or one of"),
    ("dtype-str", write_checkpoint, dict(dtype="float32"), "dtype must be None or one of"),
    ("dtype-fp8", write_checkpoint, dict(dtype=torch.float8_e4m3fn), "dtype must be None or one of"),
    ("device-nonsense", write_checkpoint, dict(device="nonsense"), "device 'nonsense'"),
    ("device-int-list", write_checkpoint, dict(device=[0]), "device"),
    ("device-meta", write_checkpoint, dict(device="meta"), "device 'meta'"),
    ("device-absent-gpu", write_checkpoint, dict(device="cuda:99"), "device 'cuda:99'"),
    ("torch-dtype-list", with_config(torch_dtype=["float32"]), {}, "config dtype"),
    ("torch-dtype-int8", with_config(torch_dtype="int8"), {}, "config dtype 'int8'"),
    ("block-size-int", with_config(quantization_config={"weight_block_size": 128}), {}, "weight_block_size"),
    (
        "block-size-bools",
        with_config(quantization_config={"weight_block_size": [True, 1]}),
        {},
        "weight_block",
    ),
    ("quant-config-list", with_config(quantization_config=[128, 128]), {}, "quantization_config"),
    ("quant-config-str", with_config(quantization_config="fp8"), {}, "quantization_config"),
    ("quant-config-int", with_config(quantization_config=8), {}, "quantization_config"),
    ("scale-int", with_fp8_tensor(SCALE, lambda t: t.to(torch.int32)), {}, "_scale_inv has dtype"),
    ("scale-bool", with_fp8_tensor(SCALE, lambda t: t.bool()), {}, "_scale_inv has dtype"),
    ("scale-nan", with_fp8_tensor(SCALE, poke(float("nan"))), {}, "scale_inv.*NaN or infinite"),
    ("scale-inf", with_fp8_tensor(SCALE, lambda t: t * float("inf")), {}, "scale_inv.*NaN or infinite"),
    ("fp8-weight-nan", with_fp8_tensor(KV_B, poke(float("nan"))), {}, "kv_b_proj.weight.*NaN"),
    ("weight-nan", with_tensor(KV_B, poke(float("nan"))), {}, "kv_b_proj.weight.*NaN"),
    ("weight-inf", with_tensor(KV_B, poke(float("-inf"))), {}, "kv_b_proj.weight.*NaN or infinite"),
    (
        "fp16-overflow",
        with_tensor(KV_B, poke(1e6)),
        dict(dtype=torch.float16),
        r"kv_b_proj.*float16.*infinite",
    ),
    ("index-binary", write_file(INDEX_FILE, bytes(range(256))), {}, INDEX_FILE.replace(".", r"\.")),
    ("index-list", write_file(INDEX_FILE, b"[]"), {}, "index.*JSON object"),
    ("config-not-json", write_file("config.json", b"{model_type"), {}, r"config\.json"),
    ("config-binary", write_file("config.json", b"\x89PNG\r\n\x1a\n\0\0"), {}, r"config\.json"),
    ("config-list", write_file("config.json", b"[1]"), {}, r"config\.json.*JSON object"),
    ("layer-out-of-range", write_checkpoint, dict(layer=2), r"layer must be an integer in 0\.\.1"),
    ("layer-float", write_checkpoint, dict(layer=1.0), r"layer must be an integer"),
    ("layer-beyond-checkpoint", with_config(num_hidden_layers=None), dict(layer=5), r"layers\.5\.self_attn"),
]


@pytest.mark.parametrize("build, kwargs, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_checkpoint_raises_a_named_value_error(tmp_path, build, kwargs, message):
    folder = str(tmp_path / "ckpt")
    if build is not None:
        build(folder)
    kwargs = {"path": folder, "layer": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        load_attention(kwargs.pop("path"), kwargs.pop("layer"), **kwargs)


def expected_layer1(fp8: bool) -> dict[str, torch.Tensor]:
    tensors = layer_tensors(1)
    if fp8:
        tensors = {k: v for k, v in to_fp8(tensors).items() if not k.endswith("_scale_inv")}
        tensors = {k: v.float() / 64 if v.dim() == 2 else v for k, v in tensors.items()}
    return {k.removeprefix("model.layers.1.self_attn."): v for k, v in tensors.items()}


# (id, config changes, layer, fp8): inputs the loader must accept
ACCEPTED = [
    ("np-int64-layer", {}, np.int64(1), False),
    ("no-num-hidden-layers", {"num_hidden_layers": None}, 1, False),
    ("fp8", {"quantization_config": {"weight_block_size": [128, 128]}}, 1, True),
    ("quant-config-null", {"quantization_config": None}, 1, False),
]


@pytest.mark.parametrize("changes, layer, fp8", [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepted_inputs_load_the_right_tensors(tmp_path, changes, layer, fp8):
    folder = str(tmp_path / "ckpt")
    write_checkpoint(folder, config={**CONFIG, **changes} if changes else None, fp8=fp8)
    got = load_attention(folder, layer).state_dict()
    want = expected_layer1(fp8)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name

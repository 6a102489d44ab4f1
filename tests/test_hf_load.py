"""mlakit.hf.load_attention: checkpoint folders written by save_pretrained, broken ones, block-fp8."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_hf import assert_close, one_thread, tiny_model  # noqa: E402, F401 (one_thread: autouse fixture)

import mlakit.hf.load as hf_load  # noqa: E402
from mlakit.hf import load_attention  # noqa: E402

LAYER = 1


def save(model, folder, sharded=True):
    model.save_pretrained(folder, max_shard_size="20KB" if sharded else "1GB")
    index = os.path.exists(os.path.join(folder, hf_load.INDEX_FILE))
    assert index == sharded, f"save_pretrained wrote {'an' if index else 'no'} index"
    return folder


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "single-file"])
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "glm4-moe-lite", "minicpm3"])
def test_load_matches_in_memory_layer(tmp_path, name, sharded):
    model = tiny_model(name)
    folder = save(model, tmp_path / "ckpt", sharded)
    layer = load_attention(folder, LAYER)
    want = model.model.layers[LAYER].self_attn.state_dict()
    got = layer.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_loaded_layer_computes_what_transformers_does(tmp_path):
    model = tiny_model("deepseek-v3")
    folder = save(model, tmp_path / "ckpt")
    layer = load_attention(folder, LAYER)
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(7)[None].expand(2, 7)
    with torch.no_grad():
        rope = model.model.rotary_emb(hidden, positions)
        mask = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
        want, _ = model.model.layers[LAYER].self_attn(hidden, position_embeddings=rope, attention_mask=mask)
        got = layer(hidden)
    assert_close("loaded layer vs transformers", got, want)


def test_reads_only_that_layers_tensors(tmp_path, monkeypatch):
    model = tiny_model("deepseek-v3")
    folder = save(model, tmp_path / "ckpt")
    read = []
    real_open = hf_load._open

    class Spy:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(hf_load, "_open", lambda *a: Spy(real_open(*a)))
    load_attention(folder, LAYER)
    assert read and all(n.startswith(f"model.layers.{LAYER}.self_attn.") for n in read), read
    assert len(read) == 7


def rewrite_index(folder, change):
    path = os.path.join(folder, hf_load.INDEX_FILE)
    with open(path) as f:
        index = json.load(f)
    change(index)
    with open(path, "w") as f:
        json.dump(index, f)


def shard_of(folder, name):
    with open(os.path.join(folder, hf_load.INDEX_FILE)) as f:
        return os.path.join(folder, json.load(f)["weight_map"][name])


def rewrite_shard(folder, name, change):
    path = shard_of(folder, name)
    tensors = safetensors_torch.load_file(path)
    change(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


def write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(data)


KV_B = f"model.layers.{LAYER}.self_attn.kv_b_proj.weight"


def _drop_from_index(index):
    del index["weight_map"][KV_B]


def _escape_folder(index):
    index["weight_map"][KV_B] = "../elsewhere.safetensors"


def _no_weight_map(index):
    index.pop("weight_map")


BROKEN = {
    "missing-shard": (lambda folder: os.remove(shard_of(folder, KV_B)), "is missing from"),
    "missing-tensor-in-index": (
        lambda folder: rewrite_index(folder, _drop_from_index),
        "missing tensors.*kv_b_proj",
    ),
    "missing-tensor-in-shard": (
        lambda folder: rewrite_shard(folder, KV_B, lambda t: t.pop(KV_B)),
        "does not hold tensors.*kv_b_proj",
    ),
    "wrong-shape": (
        lambda folder: rewrite_shard(folder, KV_B, lambda t: t.update({KV_B: t[KV_B][:, :-1].contiguous()})),
        r"kv_b_proj.weight has shape \(80, 15\), config expects \(80, 16\)",
    ),
    "index-not-json": (
        lambda folder: write_bytes(os.path.join(folder, hf_load.INDEX_FILE), b"{not json"),
        "not a readable JSON index",
    ),
    "index-without-weight-map": (lambda folder: rewrite_index(folder, _no_weight_map), "weight_map"),
    "index-escapes-folder": (
        lambda folder: rewrite_index(folder, _escape_folder),
        "file name inside the folder",
    ),
    "truncated-shard": (lambda folder: os.truncate(shard_of(folder, KV_B), 40), "not a readable safetensors"),
    "no-config": (lambda folder: os.remove(os.path.join(folder, "config.json")), "no such config.json"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_raises(tmp_path, case):
    folder = save(tiny_model("deepseek-v3"), str(tmp_path / "ckpt"))
    breaker, message = BROKEN[case]
    breaker(folder)
    with pytest.raises(ValueError, match=message):
        load_attention(folder, LAYER)


def test_bad_arguments_and_pickle_only_folder(tmp_path):
    folder = save(tiny_model("deepseek-v3"), str(tmp_path / "ckpt"))
    for layer in (-1, 2, "1", 1.0):
        with pytest.raises(ValueError, match=r"layer must be an integer in 0\.\.1"):
            load_attention(folder, layer)
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        load_attention(tmp_path / "nowhere", 0)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(os.path.join(folder, "config.json"), pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="never unpickles"):
        load_attention(pickled, 0)


# widths that cut 128x128 blocks unevenly (160 = 128 + 32, 136, 130)
FP8_CONFIG = dict(
    model_type="deepseek_v3",
    hidden_size=160,
    num_attention_heads=2,
    q_lora_rank=136,
    kv_lora_rank=130,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_hidden_layers=3,
    torch_dtype="bfloat16",
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
)
FP8_SHAPES = {
    "q_a_proj.weight": (136, 160),
    "q_b_proj.weight": (48, 136),
    "kv_a_proj_with_mqa.weight": (138, 160),
    "kv_b_proj.weight": (64, 130),
    "o_proj.weight": (160, 32),
}
NORMS = {"q_a_layernorm.weight": (136,), "kv_a_layernorm.weight": (130,)}


def write_fp8_checkpoint(folder, drop=None, scale_rows_extra=0):
    """A single-file block-fp8 layer 2 (with unrelated layer-0 tensors) in DeepSeek-V3's layout."""
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors, dense = {"model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(1)}, {}
    prefix = "model.layers.2.self_attn."
    for name, (rows, cols) in FP8_SHAPES.items():
        w = (torch.randn(rows, cols, generator=g) * 3).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-rows // 128) + scale_rows_extra, -(-cols // 128), generator=g) + 0.5
        tensors[prefix + name] = w
        tensors[prefix + name + "_scale_inv"] = scale
        dense[name] = hand_dequant(w, scale)
    for name, shape in NORMS.items():
        tensors[prefix + name] = torch.randn(shape, generator=g).to(torch.bfloat16)
        dense[name] = tensors[prefix + name].float()
    if drop:
        tensors.pop(prefix + drop)
    safetensors_torch.save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(FP8_CONFIG, f)
    return dense


def hand_dequant(w, scale):
    """Block by block, written out: w[i-block, j-block] * scale[i, j]."""
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(-(-w.shape[0] // 128)):
        for j in range(-(-w.shape[1] // 128)):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            out[rows, cols] = w[rows, cols].float() * scale[i, j]
    return out


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["config-bf16", "fp32"])
def test_block_fp8_dequantized(tmp_path, dtype):
    dense = write_fp8_checkpoint(tmp_path / "fp8")
    layer = load_attention(tmp_path / "fp8", 2, dtype=dtype)
    want_dtype = dtype or torch.bfloat16
    state = layer.state_dict()
    assert sorted(state) == sorted(dense)
    for name, want in dense.items():
        assert state[name].dtype == want_dtype, name
        assert torch.equal(state[name], want.to(want_dtype)), name


@pytest.mark.parametrize(
    "case, kwargs, message",
    [
        ("missing-scale", dict(drop="kv_b_proj.weight_scale_inv"), "float8_e4m3fn but the checkpoint has no"),
        (
            "scale-shape",
            dict(scale_rows_extra=1),
            r"q_a_proj.weight_scale_inv has shape \(3, 2\), expected \(2, 2\)",
        ),
        ("missing-weight", dict(drop="o_proj.weight"), "missing tensors.*o_proj.weight"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_block_fp8_errors(tmp_path, case, kwargs, message):
    write_fp8_checkpoint(tmp_path / "fp8", **kwargs)
    with pytest.raises(ValueError, match=message):
        load_attention(tmp_path / "fp8", 2)

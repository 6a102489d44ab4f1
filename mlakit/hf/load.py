"""load_attention: one layer's MLAAttention from a checkpoint folder, reading only that layer's tensors.

Reads `config.json` and safetensors (sharded with `model.safetensors.index.json`, or a single
`model.safetensors`) through `safe_open`, so only the requested tensors leave the disk and nothing is
ever unpickled. DeepSeek-V3 block-fp8 weights (`weight_scale_inv`, one scale per 128×128 block) are
dequantized.
"""

from __future__ import annotations

import math
import numbers
import os
import re

import torch

from mlakit.attention import MLAAttention
from mlakit.config import MLAConfig
from mlakit.hf.config import load_config_dict, read_json_object

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK = (128, 128)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# what a loaded layer may compute in (fp8 weights are dequantized, never kept)
LAYER_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def load_attention(
    path: str | os.PathLike, layer: int, *, dtype: torch.dtype | None = None, device=None
) -> MLAAttention:
    """MLAAttention of decoder layer `layer` from a checkpoint folder.

    dtype: None takes config.json's `dtype`/`torch_dtype` (float32 when absent); fp8 weights are
    dequantized in fp32, then cast.
    """
    folder = _check_arguments(path, dtype, device)
    config = load_config_dict(folder)
    cfg = MLAConfig.from_hf(config)
    limit = _layer_limit(config, cfg)
    valid = f"0..{limit - 1}" if limit is not None else ">= 0"
    if (
        isinstance(layer, bool)
        or not isinstance(layer, numbers.Integral)
        or layer < 0
        or (limit is not None and layer >= limit)
    ):
        raise ValueError(f"layer must be an integer in {valid}, got {layer!r}")
    layer = int(layer)
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and layer < len(kinds) and kinds[layer] == "linear_attention":
        raise ValueError(f"layer {layer} is a linear-attention layer of this hybrid model, not MLA")
    dtype = dtype or _config_dtype(config)
    files = tensor_files(folder)
    if config.get("model_type") == "longcat_flash":  # MLA layer i: decoder layer i // 2, sublayer i % 2
        prefix = layer_prefix(files, layer // 2, sub=layer % 2)
    else:
        prefix = layer_prefix(files, layer)
    module = MLAAttention(cfg, device="meta", dtype=dtype)
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    # the module's own dtype per tensor: `dtype`, except what it keeps in fp32 (indexer.weights_proj)
    dtypes = {name: t.dtype for name, t in module.state_dict().items()}
    block = _block_size(config)
    state = read_layer(folder, files, prefix, shapes, block)
    state = {name: t.to(dtypes[name]) for name, t in state.items()}
    for name, t in state.items():
        _check_finite(f"{prefix}{name} (as {dtypes[name]})", t)
    module.load_state_dict(state, assign=True)
    return module.to(device) if device is not None else module


def _check_arguments(path, dtype, device) -> str:
    """The folder, once path, dtype and device are known good; nothing is read before."""
    if not isinstance(path, str | os.PathLike):
        raise ValueError(f"path must be a checkpoint folder (str or os.PathLike), got {path!r}")
    folder = os.fspath(path)
    if not isinstance(folder, str) or not os.path.isdir(folder):
        raise ValueError(f"path {folder!r} is not a checkpoint folder")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in LAYER_DTYPES):
        raise ValueError(
            f"dtype must be None or one of {', '.join(map(str, LAYER_DTYPES))}, got {dtype!r} "
            "(fp8 checkpoints are dequantized to one of these)"
        )
    if device is not None:
        try:
            where = torch.empty(0, device=device).device
        except (RuntimeError, TypeError, AssertionError) as e:
            raise ValueError(f"device {device!r} is not a usable torch device ({e})") from e
        if where.type == "meta":
            raise ValueError(
                "device 'meta' holds no data: load to a real device (or build MLAAttention on meta)"
            )
    return folder


def tensor_files(folder: str) -> dict[str, str]:
    """Tensor name → the safetensors file (a name inside `folder`) that holds it."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        return _read_index(index)
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(single):
        with _open(folder, SINGLE_FILE) as f:
            return {name: SINGLE_FILE for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    pickled = [
        n
        for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")
        if os.path.exists(os.path.join(folder, n))
    ]
    hint = (
        f"; found {pickled[0]}, which mlakit never unpickles (save with safe_serialization)"
        if pickled
        else ""
    )
    raise ValueError(f"checkpoint folder {folder!r} has neither {INDEX_FILE} nor {SINGLE_FILE}{hint}")


def _read_index(index: str) -> dict[str, str]:
    try:
        data = read_json_object(index, "index")
    except ValueError as e:
        raise ValueError(f"{index}: not a readable JSON index ({e})") from e
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: expected a non-empty 'weight_map' object of tensor name → file name")
    for name, file in weight_map.items():
        if not isinstance(name, str):
            raise ValueError(f"{index}: tensor name {name!r} is not a string")
        if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
            raise ValueError(
                f"{index}: tensor {name!r} maps to {file!r}; expected a file name inside the folder"
            )
    return weight_map


def layer_prefix(files: dict[str, str], layer: int, sub: int | None = None) -> str:
    """The name prefix of layer `layer`'s attention tensors, e.g. 'model.layers.3.self_attn.'
    ('model.layers.3.self_attn.1.' for sublayer 1 of a decoder layer holding two, as LongCat-Flash's)."""
    site = f"layers.{layer}.self_attn." + ("" if sub is None else f"{sub}.")
    pattern = re.compile(rf"^(.*?\b{re.escape(site)})")
    prefixes = sorted({m.group(1) for name in files if (m := pattern.match(name))})
    if not prefixes:
        raise ValueError(f"checkpoint has no tensor named '*{site}*'")
    if len(prefixes) > 1:
        raise ValueError(f"layer {layer} is ambiguous: attention tensors under {prefixes}")
    return prefixes[0]


def _layer_limit(config: dict, cfg: MLAConfig) -> int | None:
    """How many layers `layer` may index: LongCat-Flash's MLA sublayers, else the decoder layers (a
    hybrid's include its linear-attention ones); None when the config does not say."""
    if config.get("model_type") == "longcat_flash":
        return cfg.num_layers
    layers = config.get("num_hidden_layers")
    return None if layers is None else int(layers)


def read_layer(
    folder: str, files: dict[str, str], prefix: str, shapes: dict[str, tuple], block: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """Read (and dequantize) exactly the tensors `shapes` names, under `prefix`; check every shape."""
    missing = [prefix + n for n in shapes if prefix + n not in files]
    if missing:
        raise ValueError(f"checkpoint is missing tensors {missing}")
    wanted = {n: [prefix + n] for n in shapes}
    for n in shapes:
        if prefix + n + "_scale_inv" in files:
            wanted[n].append(prefix + n + "_scale_inv")
    raw = _read_tensors(folder, files, [full for names in wanted.values() for full in names])
    state = {}
    for n, shape in shapes.items():
        t = raw[prefix + n]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {prefix + n} has shape {tuple(t.shape)}, config expects {shape}")
        if t.dtype in FP8_DTYPES:
            scale_name = prefix + n + "_scale_inv"
            if scale_name not in raw:
                raise ValueError(f"tensor {prefix + n} is {t.dtype} but the checkpoint has no {scale_name}")
            t = dequantize_block_fp8(t, raw[scale_name], block, name=prefix + n)
        elif not t.dtype.is_floating_point:
            raise ValueError(f"tensor {prefix + n} has dtype {t.dtype}; expected a floating-point tensor")
        state[n] = t
    return state


def _read_tensors(folder: str, files: dict[str, str], names: list[str]) -> dict[str, torch.Tensor]:
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for file, file_names in by_file.items():
        with _open(folder, file) as f:
            present = set(f.keys())
            absent = [n for n in file_names if n not in present]
            if absent:
                raise ValueError(f"{file} does not hold tensors {absent} that the index places there")
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out


def _open(folder: str, file: str):
    from safetensors import SafetensorError, safe_open

    path = os.path.join(folder, file)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file {file} is missing from {folder}")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def dequantize_block_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    *,
    name: str = "weight",
) -> torch.Tensor:
    """fp8 weight [R, C] times its per-block scale [ceil(R/b0), ceil(C/b1)] → fp32 [R, C]."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: block-fp8 weights must be 2D, got shape {tuple(weight.shape)}")
    if not scale_inv.dtype.is_floating_point or scale_inv.dtype in FP8_DTYPES:
        raise ValueError(
            f"{name}_scale_inv has dtype {scale_inv.dtype}; expected fp32/bf16/fp16 scales "
            "(an integer or bool scale would round or zero whole blocks)"
        )
    _check_finite(f"{name}_scale_inv", scale_inv)
    rows, cols = weight.shape
    b0, b1 = block
    want = (math.ceil(rows / b0), math.ceil(cols / b1))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a "
            f"{rows}x{cols} weight in {b0}x{b1} blocks"
        )
    scale = scale_inv.float().repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    return weight.float() * scale


def _check_finite(name: str, t: torch.Tensor) -> None:
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"tensor {name} holds {bad} NaN or infinite values of {t.numel()}; expected finite")


def _block_size(config: dict) -> tuple[int, int]:
    quant = config.get("quantization_config")
    if quant is None:
        quant = {}
    if not isinstance(quant, dict):
        raise ValueError(f"config quantization_config must be an object or null, got {quant!r}")
    block = quant.get("weight_block_size")
    if block is None:
        return DEFAULT_BLOCK
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"quantization_config.weight_block_size must be two positive integers, got {block!r}"
        )
    return int(block[0]), int(block[1])


def _config_dtype(config: dict) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"config dtype {name!r} is not supported; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]

"""The weights' bytes of a model folder, summed from its safetensors headers (no tensor is read).

A safetensors file starts with an 8-byte little-endian header length N and N bytes of JSON naming each
tensor's `data_offsets` [begin, end) in the data that follows; the weights are the sum of end − begin.
A sharded checkpoint's files are those its `model.safetensors.index.json` names; otherwise every
`*.safetensors` file in the folder. Torch-free.
"""

from __future__ import annotations

import json
import os
import struct

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


def model_folder(model: str) -> str | None:
    """The folder of a --model that is a folder or a config.json path; None for a preset name."""
    if not isinstance(model, str):
        return None
    if os.path.isdir(model):
        return model
    if os.path.isfile(model):
        return os.path.dirname(os.path.abspath(model))
    return None


def weight_files(folder: str) -> list[str]:
    """The safetensors files holding the folder's weights (sorted), [] when it has none."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        from mlakit.hf.config import read_json_object

        shards = read_json_object(index, "safetensors index").get("weight_map")
        if not isinstance(shards, dict):
            raise ValueError(f"safetensors index file {index}: expected a weight_map object")
        return sorted({os.path.join(folder, str(name)) for name in shards.values()})
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def tensor_bytes(path: str) -> int:
    """Bytes of the tensors in one safetensors file, read from its header alone."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"safetensors file {path}: header of {n:,} bytes is over the format's limit")
            header = json.loads(f.read(n))
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"safetensors file {path}: not a safetensors header ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"safetensors file {path}: the header is not a JSON object")
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"safetensors file {path}: tensor {name!r} has no data_offsets [begin, end]")
        total += offsets[1] - offsets[0]
    return total


def folder_weights(model: str) -> dict | None:
    """{"bytes", "files", "folder"} for a --model folder with safetensors weights, else None."""
    folder = model_folder(model)
    if folder is None:
        return None
    files = weight_files(folder)
    if not files:
        return None
    return {"bytes": sum(tensor_bytes(p) for p in files), "files": len(files), "folder": folder}

"""What `LLM(model, ...)` accepts, resolved: the model, its tokenizer, the dtype, the cache size."""

from __future__ import annotations

import os
import re
import sys

import torch

from mlakit.ops.common import compute_dtype

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
DTYPES.update({"fp16": torch.float16, "float16": torch.float16})
CACHE_DTYPES = (None, "fp8", "int8")
# the cache's default size: this share of the memory free at start (at most DEFAULT_CAP bytes)
DEFAULT_SHARE = 0.2
DEFAULT_CAP = 4 * 2**30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def resolve_dtype(dtype, device) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be a torch.dtype or one of {sorted(DTYPES)}, got {dtype!r}")


def check_device(device) -> torch.device | None:
    """None, or a CPU / available CUDA device (a `torch.device` or its name); ValueError naming `device`."""
    if device is None:
        return None
    want = "None, 'cpu', 'cuda' or 'cuda:N' (a torch.device or its name)"
    if not isinstance(device, str | torch.device):
        raise ValueError(f"device must be {want}, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be {want}, got {device!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device must be {want}, got {device!r} (device type {dev.type!r} is not served)")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch build sees no CUDA device; use 'cpu' or None")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def check_tokenizer(tokenizer):
    """None, a tokenizer object (`encode`/`decode`), or a path: a folder or a tokenizer.json (loaded from
    local files only). ValueError naming `tokenizer` else."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str | os.PathLike):
        path = os.fspath(tokenizer)
        try:
            if os.path.isfile(path):
                from transformers import PreTrainedTokenizerFast

                return PreTrainedTokenizerFast(tokenizer_file=path)
            if os.path.isdir(path):
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any loader failure is a bad argument
            raise ValueError(f"tokenizer {path!r} could not be loaded: {type(e).__name__}: {e}") from None
        raise ValueError(f"tokenizer {path!r} is neither a tokenizer folder nor a tokenizer.json file")
    if not all(callable(getattr(tokenizer, name, None)) for name in ("encode", "decode")):
        raise ValueError(
            "tokenizer must be None, a path (folder or tokenizer.json) or a tokenizer object with "
            f"encode/decode, got {type(tokenizer).__name__}"
        )
    return tokenizer


def native_16bit(device) -> torch.dtype:
    """bf16 where the device has native bf16 matmuls, else fp32."""
    return torch.bfloat16 if compute_dtype(torch.bfloat16, device) == torch.bfloat16 else torch.float32


def parse_bytes(value) -> int:
    """Bytes from an integer or a string such as "2GiB", "512 MiB", "1.5GB"."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"cache_memory must be a positive byte count or a size like '2GiB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def load_model(model, tokenizer, dtype, device):
    """(a transformers causal LM in eval mode, its tokenizer or None)."""
    if isinstance(model, str) and model == "demo":
        from mlakit.engine.demo import demo_model, demo_tokenizer

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        m = demo_model(dtype or native_16bit(device), device)
        return m, tokenizer or demo_tokenizer()
    if isinstance(model, str | os.PathLike):
        return _load_folder(os.fspath(model), tokenizer, dtype, device)
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        if dtype is not None:
            model = model.to(dtype)
        if device is not None:
            model = model.to(device)
        return model.eval(), tokenizer
    raise ValueError(
        f"model must be 'demo', a model folder or a transformers PreTrainedModel, got {type(model).__name__}"
    )


def _load_folder(path: str, tokenizer, dtype, device):
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model {path!r} is not 'demo' nor a folder with a config.json")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mlakit.hf.families import FAMILIES

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    known = {f.model_type for f in FAMILIES.values()}
    if getattr(config, "model_type", None) not in known:
        raise ValueError(
            f"model {path!r}: model_type {config.model_type!r} is not an MLA family mlakit knows"
        )
    if tokenizer is None:
        tokenizer = _folder_tokenizer(path, AutoTokenizer)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    m = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype or native_16bit(device), local_files_only=True, device_map=None
    ).to(device)
    return m.eval(), tokenizer


# what a folder holds when it ships a tokenizer (transformers' fast and slow files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _folder_tokenizer(path: str, auto):
    """The folder's tokenizer, before any weight is loaded; None when it ships none (a weights-only
    folder serves token-id prompts, as vLLM's skip_tokenizer_init: text is refused by name)."""
    if not has_tokenizer_files(path):
        return None
    try:
        return auto.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"model {path!r}: its tokenizer files could not be loaded ({type(e).__name__}: {e}); pass "
            "tokenizer= a folder or tokenizer.json that loads"
        ) from None


def cache_blocks(num_blocks, cache_memory, bytes_per_page: int, device, most: int) -> int:
    """Pages of the cache: `num_blocks`, else `cache_memory` bytes, else DEFAULT_SHARE of free memory
    (at most DEFAULT_CAP); never more than `most` (every slot at the longest context). Printed."""
    budget = None if cache_memory is None else parse_bytes(cache_memory)  # checked even when unused
    if num_blocks is not None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        return num_blocks
    if cache_memory is not None:
        why = "cache_memory"
    else:
        free = free_memory(torch.device(device))
        budget = min(int(free * DEFAULT_SHARE), DEFAULT_CAP)
        why = f"{DEFAULT_SHARE:.0%} of {free / 2**30:.1f} GiB free, at most {DEFAULT_CAP / 2**30:.0f} GiB"
    blocks = min(budget // bytes_per_page, most)
    if blocks < 1:
        raise ValueError(f"cache_memory {budget} bytes holds no page of {bytes_per_page} bytes")
    print(
        f"mlakit.engine: latent cache {blocks * bytes_per_page / 2**30:.2f} GiB ({why}): {blocks} pages",
        file=sys.stderr,
    )
    return blocks

"""transformers bridge: patch a model's MLA layers to run mlakit, and load one layer from a checkpoint.

`patch(model)` makes every MLA attention of a transformers model decode with absorb (weights shared,
the cache still holding only the latent); `model.generate(...)` then returns the same tokens, faster;
`unpatch(model)` puts the original modules back. `load_attention(folder, layer)` builds one
`MLAAttention` from a safetensors checkpoint.

- `config.py`: transformers config (object, dict, config.json, folder) → MLAConfig fields; torch-free
- `attention.py`: `PatchedMLAAttention`, the module that replaces a transformers MLA attention
- `families.py`: every MLA attention class of transformers → how it is served, or why it is refused
- `patch.py`: `patch`, `unpatch`, `is_patched`, `SUPPORTED` (class names), `REFUSED` (class → reason)
- `load.py`: `load_attention` (safetensors only)

Names resolve lazily, so `mlakit.hf.config` (read by `MLAConfig.from_hf`) never imports torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "REFUSED": "mlakit.hf.patch",
    "SUPPORTED": "mlakit.hf.patch",
    "SUPPORTED_MODELS": "mlakit.hf.patch",
    "is_patched": "mlakit.hf.patch",
    "patch": "mlakit.hf.patch",
    "unpatch": "mlakit.hf.patch",
    "PatchedMLAAttention": "mlakit.hf.attention",
    "PatchedDSAAttention": "mlakit.hf.dsa",
    "load_attention": "mlakit.hf.load",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlakit.hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """Importing the submodule `mlakit.hf.patch` binds the name `patch` on this package to the module;
    the function of the same name is what `mlakit.hf.patch` must stay."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

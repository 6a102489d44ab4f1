"""mlakit: Multi-head Latent Attention with both algorithms, the cost model and the crossover.

Names resolve lazily, so that `import mlakit.config` (and the torch-free CLI commands: --help,
models, cache, crossover, cost) never import torch; `mlakit.MLAAttention` imports it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "MLAAttention": "mlakit.attention",
    "LatentCache": "mlakit.cache.contiguous",
    "PagedLatentCache": "mlakit.cache.paged",
    "PRESETS": "mlakit.config",
    "MLAConfig": "mlakit.config",
    "V4Attention": "mlakit.v4.attention",
    "V4Cache": "mlakit.v4.cache",
    "V4Config": "mlakit.v4.config",
}

__all__ = ["PRESETS", "LatentCache", "MLAAttention", "MLAConfig", "PagedLatentCache", "__version__"]
__all__ += ["V4Attention", "V4Cache", "V4Config"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlakit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

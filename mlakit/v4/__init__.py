"""DeepSeek-V4 compressed attention: V4Config, V4Attention (sliding / CSA / HCA), V4Cache.

Names resolve lazily, so that `mlakit.v4.config` (and the cost model that reads it) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "V4Attention": "mlakit.v4.attention",
    "V4Cache": "mlakit.v4.cache",
    "V4Config": "mlakit.v4.config",
    "V4_PRESETS": "mlakit.v4.config",
}

__all__ = ["V4_PRESETS", "V4Attention", "V4Cache", "V4Config"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlakit.v4' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

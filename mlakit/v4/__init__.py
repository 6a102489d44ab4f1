"""DeepSeek-V4 compressed attention: V4Config, V4Attention (sliding / CSA / HCA), V4Cache."""

from mlakit.v4.attention import V4Attention
from mlakit.v4.cache import V4Cache
from mlakit.v4.config import V4_PRESETS, V4Config

__all__ = ["V4_PRESETS", "V4Attention", "V4Cache", "V4Config"]

"""mlakit: Multi-head Latent Attention with both algorithms, the cost model and the crossover."""

from mlakit.attention import MLAAttention
from mlakit.cache.contiguous import LatentCache
from mlakit.cache.paged import PagedLatentCache
from mlakit.config import PRESETS, MLAConfig

__version__ = "0.1.0"

__all__ = ["PRESETS", "LatentCache", "MLAAttention", "MLAConfig", "PagedLatentCache", "__version__"]

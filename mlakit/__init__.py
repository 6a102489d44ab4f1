"""mlakit: Multi-head Latent Attention with both algorithms, the cost model and the crossover."""

from mlakit.attention import MLAAttention
from mlakit.cache import LatentCache
from mlakit.config import PRESETS, MLAConfig
from mlakit.paged import PagedLatentCache

__version__ = "0.1.0"

__all__ = ["PRESETS", "LatentCache", "MLAAttention", "MLAConfig", "PagedLatentCache", "__version__"]

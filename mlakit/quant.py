"""Moved to `mlakit.cache.quant`; this name stays an alias of it so that existing imports keep working."""

import sys

from mlakit.cache import quant as _moved

sys.modules[__name__] = _moved

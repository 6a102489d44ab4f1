"""Moved to `mlakit.cache.blocks`; this name stays an alias of it so that existing imports keep working."""

import sys

from mlakit.cache import blocks as _moved

sys.modules[__name__] = _moved

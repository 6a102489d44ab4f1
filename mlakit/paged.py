"""Moved to `mlakit.cache.paged`; this name stays an alias of it so that existing imports keep working."""

import sys

from mlakit.cache import paged as _moved

sys.modules[__name__] = _moved

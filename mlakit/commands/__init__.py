"""Subcommands of the `mlakit` CLI; each module has `register(subparsers)`.

Helpers every command shares live in `mlakit.commands.args` (torch-free): token counts with K/M
suffixes, bounded integers, --model and --out checks, the machine's available memory.
"""

import json
import math
import sys


def plural(n: int, word: str) -> str:
    """'1 new token', '2 new tokens', '1,024 tokens': the count with its noun, plural unless 1."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def emit_json(obj) -> None:
    """Print `obj` as strict JSON (never NaN or Infinity); ValueError naming the first bad key."""
    bad = _non_finite(obj, "")
    if bad is not None:
        raise ValueError(f"the result holds a non-finite number at {bad or 'top level'}; not printed as JSON")
    sys.stdout.write(json.dumps(obj, indent=2, allow_nan=False) + "\n")


def _non_finite(obj, path: str) -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    for key, value in items:
        found = _non_finite(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None

"""Field checks for MLAConfig: one function per kind of value, each returning the value it accepts.

Every check raises ValueError naming the field, what it got and what it expected, and returns the
value normalized to a plain Python type (an `np.int64` width becomes an `int`, an int theta a
`float`), so a config never stores a value of a type its users do not expect. A new field is one
line in `MLAConfig.__post_init__`: `self.x = positive_int("x", self.x)`. Torch-free.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


MAX_INT = 2**31 - 1


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def integer(name: str, value: Any, minimum: int | None = None) -> int:
    """An integer (not a bool, not a float, not a string) >= `minimum`, as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {_got(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def positive_int(name: str, value: Any, maximum: int = MAX_INT) -> int:
    """An integer in 1..maximum (widths and lengths index int64 tensors: 2**31 - 1 unless said)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 < value <= maximum:
        raise ValueError(f"{name} must be an integer in 1..{maximum}, got {_got(value)}")
    return int(value)


def optional_positive_int(name: str, value: Any) -> int | None:
    return None if value is None else positive_int(name, value)


def number(name: str, value: Any, *, above: float | None = None, at_least: float | None = None) -> float:
    """A finite real number (int or float, not a bool or string), > `above` and >= `at_least`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {_got(value)}")
    if above is not None and not value > above:
        raise ValueError(f"{name} must be a number > {above:g}, got {value!r}")
    if at_least is not None and not value >= at_least:
        raise ValueError(f"{name} must be a number >= {at_least:g}, got {value!r}")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    """True or False only: 'false', 0, None and other stand-ins are refused, never coerced."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false (a bool), got {_got(value)}")
    return value


def text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {_got(value)}")
    return value


def even(name: str, value: int) -> int:
    if value % 2:
        raise ValueError(f"{name} must be even (pairs are rotated), got {value}")
    return value


def rope_kind(name: str, scaling: dict) -> str:
    """'default' or 'yarn' from `rope_type` (or the older `type`); other kinds are refused."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind is None:
        return "default"
    if not isinstance(kind, str):
        raise ValueError(f"{name}['rope_type'] must be a string, got {_got(kind)}")
    if kind not in ("default", "yarn"):
        raise ValueError(f"{name} type {kind!r} is not supported; mlakit supports 'default' and 'yarn'")
    return kind


def rope_scaling(value: Any, rope_theta: float) -> dict[str, Any] | None:
    """None for default rope, else a yarn dict whose every key is checked and normalized."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"rope_scaling must be a dict or None, got {_got(value)}")
    if rope_kind("rope_scaling", value) == "default":
        return None
    s = {k: v for k, v in value.items() if k in YARN_KEYS and v is not None}
    key = "rope_scaling[{!r}]".format
    if "factor" not in s:
        raise ValueError("rope_scaling['factor'] is required for yarn, got none")
    if "original_max_position_embeddings" not in s:
        raise ValueError("rope_scaling['original_max_position_embeddings'] is required for yarn, got none")
    out: dict[str, Any] = {"rope_type": "yarn"}
    out["factor"] = number(key("factor"), s["factor"], at_least=1)
    out["original_max_position_embeddings"] = positive_int(
        key("original_max_position_embeddings"), s["original_max_position_embeddings"]
    )
    for k in ("beta_fast", "beta_slow"):
        if k in s:
            out[k] = number(key(k), s[k], above=0)
    if "attention_factor" in s:
        out["attention_factor"] = number(key("attention_factor"), s["attention_factor"], above=0)
        at_most(key("attention_factor"), out["attention_factor"], MAX_CORRECTION)
    for k in ("mscale", "mscale_all_dim"):
        if k in s:
            out[k] = number(key(k), s[k], at_least=0)
    if "truncate" in s:
        out["truncate"] = boolean(key("truncate"), s["truncate"])
    _yarn_consistent(out, rope_theta)
    return out


def at_most(name: str, value: float, limit: float) -> float:
    if value > limit:
        raise ValueError(f"{name} must be <= {limit:g}, got {value!r}")
    return value


# yarn's corrections multiply cos/sin and the softmax scale: past this, 16-bit scores overflow
MAX_CORRECTION = 1e3


def _yarn_consistent(s: dict[str, Any], rope_theta: float) -> None:
    # the correction range divides by ln(rope_theta) and runs from beta_fast (high) down to beta_slow
    if not rope_theta > 1:
        raise ValueError(
            f"rope_theta must be > 1 under yarn (its ramp divides by ln theta), got {rope_theta!r}"
        )
    fast, slow = s.get("beta_fast", 32.0), s.get("beta_slow", 1.0)
    if fast < slow:
        raise ValueError(
            f"rope_scaling['beta_fast'] must be >= rope_scaling['beta_slow'], got {fast!r} < {slow!r}"
        )
    original = s["original_max_position_embeddings"]
    if not original / (fast * 2 * math.pi) > 0:
        raise ValueError(
            f"rope_scaling['beta_fast'] = {fast!r} is too large for original_max_position_embeddings "
            f"{original} (the ramp takes log(original / (2 pi beta_fast)))"
        )
    for k in ("mscale", "mscale_all_dim"):
        # the magnitude correction 0.1·m·ln(factor) + 1 scales cos/sin and the softmax
        m = 0.1 * s.get(k, 0.0) * math.log(s["factor"]) + 1.0
        if not m <= MAX_CORRECTION:
            raise ValueError(
                f"rope_scaling[{k!r}] = {s[k]!r} with factor {s['factor']!r} makes the yarn magnitude "
                f"correction {m:.3g}; expected <= {MAX_CORRECTION:g}"
            )

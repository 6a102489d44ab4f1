"""`--max-minutes`: a long command says how long it will take before it starts, and refuses past the
limit with the flags that shorten it (torch-free)."""

from __future__ import annotations

import math


def add_time_limit_arg(p, default: float) -> None:
    p.add_argument(
        "--max-minutes",
        type=float,
        default=default,
        help=f"refuse a run estimated to take longer than this, before any work (default {default:g}; "
        "0: no limit)",
    )


def check_max_minutes(value) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"--max-minutes must be a finite number >= 0 (0: no limit), got {value!r}")


def over_limit(seconds: float, limit_minutes: float) -> bool:
    return bool(limit_minutes) and seconds > limit_minutes * 60


def check_time_limit(seconds: float, limit_minutes: float, what: str, how: str, lower: str) -> None:
    """Refuse when `seconds` exceeds `limit_minutes` (0: never); `lower` names the flags to lower."""
    check_max_minutes(limit_minutes)
    if over_limit(seconds, limit_minutes):
        raise ValueError(
            f"{what} would take about {format_duration(seconds)} ({how}), over --max-minutes "
            f"{limit_minutes:g}; lower {lower}, or raise --max-minutes (0: no limit)"
        )


def format_duration(seconds: float) -> str:
    """'12 s', '7 min 19 s', '3 h 20 min', '8.3 days'."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest} s"
    if seconds < 2 * 86400:
        hours, rest = divmod(round(seconds / 60), 60)
        return f"{hours} h {rest} min"
    days = seconds / 86400
    return f"{days:.1f} days" if days < 10 else f"{days:,.0f} days"

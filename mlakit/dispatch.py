"""choose(): which path to run for a call, from the cost model (or a measured profile)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from mlakit.config import MLAConfig
from mlakit.cost import crossover

Mode = Literal["auto", "absorb", "materialize"]
MODES = ("auto", "absorb", "materialize")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def choose(
    cfg: MLAConfig, new: int, cached: int | Sequence[int], profile=None
) -> Literal["absorb", "materialize"]:
    """Absorb when fewer new tokens than the crossover at the (mean) cached length, else materialize.

    With a `profile` (mlakit.calibration.CrossoverProfile) that matches `cfg`, the crossover it
    measured on this machine decides. Otherwise article 000's model (new and cached tokens
    independent); with no crossover (2L <= nope+v at long context) absorb always wins.
    """
    context = cached if isinstance(cached, int) else round(sum(cached) / max(1, len(cached)))
    if profile is not None:
        picked = profile.decide(cfg, new, context)
        if picked is not None:
            return picked
    point = crossover(cfg, context).exact
    if point is None or new < point:
        return "absorb"
    return "materialize"

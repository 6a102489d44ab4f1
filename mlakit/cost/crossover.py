"""Where absorb and materialize cost the same: from the multiply-add sums, and under the roofline.

The FLOP crossover is solved from the term sums themselves (their difference is a polynomial of
degree <= 2 in the new-token count), so no hand-written formula can drift from the terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlakit.config import MLAConfig
from mlakit.cost.roofline import MachineProfile, path_time, resolve_machine
from mlakit.cost.terms import check_count, check_model, path_macs


@dataclass(frozen=True)
class Crossover:
    exact: float | None  # new tokens where materialize becomes cheaper at this context; None: never
    asymptotic: float | None  # the long-context limit L·(nope+v) / (2L − nope − v); None: no limit


def asymptotic_crossover(cfg: MLAConfig) -> float | None:
    """`L·(nope+v) / (2L − nope − v)`; None when 2L <= nope + v (absorb never loses at long context)."""
    lat, dn, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    denom = 2 * lat - dn - dv
    if denom <= 0:
        return None
    return lat * (dn + dv) / denom


def crossover(cfg: MLAConfig, context, model: str = "independent") -> Crossover:
    """The new-token count past which materialize costs fewer multiply-adds, at `context` cached tokens.

    `exact` is the first n >= 0 where materialize − absorb changes sign from >= 0 to < 0, so absorb
    is cheaper (or equal) below it and materialize cheaper just above it; None when absorb is never
    more expensive. It is never negative or infinite.
    """
    check_count("context", context)
    check_model(model)
    return Crossover(exact=_solve(cfg, context, model), asymptotic=asymptotic_crossover(cfg))


def gap_coefficients(cfg: MLAConfig, cached, model: str = "independent") -> tuple:
    """(2a, 2b, 2c) with materialize − absorb = a·n² + b·n + c, from the term sums at n = 0, 1, 2."""
    g0, g1, g2 = (_gap(cfg, n, cached, model) for n in (0, 1, 2))
    two_a = g2 - 2 * g1 + g0
    return two_a, 2 * (g1 - g0) - two_a, 2 * g0


def _gap(cfg: MLAConfig, new, cached, model: str):
    """materialize − absorb multiply-adds."""
    return path_macs(cfg, "materialize", new, cached, model) - path_macs(cfg, "absorb", new, cached, model)


def _solve(cfg: MLAConfig, cached, model: str) -> float | None:
    return first_crossing(*gap_coefficients(cfg, cached, model))


def first_crossing(a, b, c) -> float | None:
    """Smallest n >= 0 where a·n² + b·n + c turns negative (a root it leaves downwards); None if none."""
    if c < 0:
        return 0.0
    if abs(a) <= 1e-12 * max(abs(b), abs(c), 1):
        return c / -b + 0.0 if b < 0 else None  # linear (the independent model): one root, if falling
    disc = b * b - 4 * a * c
    if disc <= 0:
        return None  # never below zero (c >= 0 rules out a < 0 here)
    q = -(b + math.copysign(math.sqrt(disc), b)) / 2  # the stable root pair q/a and c/q
    lo, hi = sorted((q / a, c / q))
    if a < 0:
        return max(hi, 0.0) + 0.0  # negative beyond the larger root
    return lo if lo >= 0 else None  # a > 0: negative between the roots, both >= 0 since c >= 0


def roofline_crossover(
    cfg: MLAConfig,
    context,
    machine: str | MachineProfile,
    dtype: str = "bf16",
    model: str = "independent",
    fused: bool = False,
    max_new: float = 2.0**24,
) -> float | None:
    """New tokens past which materialize is predicted faster under the roofline; None up to `max_new`.

    The time difference is piecewise (each term switches between compute and memory bound), so it
    is scanned on a geometric grid (8 points per doubling) and the first sign change is bisected.
    """
    check_count("context", context)
    profile = resolve_machine(machine)

    def gap(n: float) -> float:
        t_mat = path_time(cfg, "materialize", n, context, profile, dtype, model, fused)
        return t_mat - path_time(cfg, "absorb", n, context, profile, dtype, model, fused)

    prev = 0.0
    if gap(prev) <= 0:
        return 0.0
    for k in range(8 * math.ceil(math.log2(max_new)) + 1):
        n = 2.0 ** (k / 8)
        if gap(n) <= 0:
            return _bisect(gap, prev, n)
        prev = n
    return None


def _bisect(f, lo: float, hi: float) -> float:
    """f(lo) > 0 >= f(hi): shrink to a relative width of 1e-9."""
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        if f(mid) <= 0:
            hi = mid
        else:
            lo = mid
    return hi

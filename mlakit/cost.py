"""The cost model: multiply-adds per layer, term by term, and the crossover between the two paths.

Rule: a matmul (rows × inner)·(inner × cols) costs rows·cols·inner multiply-adds. Counts are per
layer and per sequence; `n` new tokens attend to a context of `t` keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlakit.config import MLAConfig

MODELS = ("independent", "causal")


@dataclass(frozen=True)
class Crossover:
    exact: float | None  # new tokens where the two totals meet at this context; None: absorb always wins
    asymptotic: float | None  # the long-context limit L·(nope+v) / (2L − nope − v)


def keys_seen(new: int, cached: int, model: str = "independent") -> float:
    """Total keys the new tokens attend to: n·c (articles' model) or n·c + n(n+1)/2 (causal prefill)."""
    if model == "independent":
        return new * cached
    if model == "causal":
        return new * cached + new * (new + 1) / 2
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")


def expanded_tokens(new: int, cached: int, model: str = "independent") -> int:
    """Tokens whose latents materialize expands: the cache (articles) or cache and new tokens (causal)."""
    return cached if model == "independent" else cached + new


def materialize_macs(cfg: MLAConfig, new: int, cached: int, model: str = "independent") -> dict[str, float]:
    h, lat, dn, dr, dv = _widths(cfg)
    t = expanded_tokens(new, cached, model)
    pairs = keys_seen(new, cached, model)
    return {
        "expand_k": t * h * dn * lat,  # c_kv · W_UK for every expanded token
        "expand_v": t * h * dv * lat,  # c_kv · W_UV for every expanded token
        "scores": pairs * h * (dn + dr),  # q · [k_nope | k_pe]
        "weighted_sum": pairs * h * dv,  # probs · V
    }


def absorb_macs(cfg: MLAConfig, new: int, cached: int, model: str = "independent") -> dict[str, float]:
    h, lat, dn, dr, dv = _widths(cfg)
    pairs = keys_seen(new, cached, model)
    return {
        "fold_q": new * h * dn * lat,  # q_nope · W_UK per new token
        "scores": pairs * h * (lat + dr),  # q_lat · [c_kv | k_pe]
        "mix_latents": pairs * h * lat,  # probs · c_kv
        "unfold_v": new * h * lat * dv,  # o_lat · W_UV per new token
    }


def path_macs(cfg: MLAConfig, mode: str, new: int, cached: int, model: str = "independent") -> float:
    """Total multiply-adds of one path's attention core (projections excluded)."""
    if mode == "absorb":
        return sum(absorb_macs(cfg, new, cached, model).values())
    if mode == "materialize":
        return sum(materialize_macs(cfg, new, cached, model).values())
    raise ValueError(f"mode must be 'absorb' or 'materialize', got {mode!r}")


def asymptotic_crossover(cfg: MLAConfig) -> float | None:
    """`L·(nope+v) / (2L − nope − v)`; None when 2L <= nope + v (absorb never loses)."""
    lat, dn, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    denom = 2 * lat - dn - dv
    if denom <= 0:
        return None
    return lat * (dn + dv) / denom


def crossover(cfg: MLAConfig, context: int, model: str = "independent") -> Crossover:
    """New-token count where absorb and materialize cost the same at `context` cached tokens."""
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    return Crossover(exact=_solve(cfg, context, model), asymptotic=asymptotic_crossover(cfg))


def _gap(cfg: MLAConfig, new: float, cached: int, model: str) -> float:
    """materialize − absorb, from the term sums themselves (so no formula can drift from them)."""
    return path_macs(cfg, "materialize", new, cached, model) - path_macs(cfg, "absorb", new, cached, model)


def _solve(cfg: MLAConfig, cached: int, model: str) -> float | None:
    # the gap is quadratic in n at most; take its coefficients from three evaluations
    g0, g1, g2 = (_gap(cfg, n, cached, model) for n in (0.0, 1.0, 2.0))
    a = (g2 - 2 * g1 + g0) / 2
    b = g1 - g0 - a
    c = g0
    roots = _positive_roots(a, b, c)
    if not roots:
        return None
    return min(roots)


def _positive_roots(a: float, b: float, c: float) -> list[float]:
    eps = 1e-12 * max(abs(a), abs(b), abs(c), 1.0)
    if abs(a) <= eps:
        if abs(b) <= eps:
            return []
        r = -c / b
        return [r] if r >= 0 else []
    disc = b * b - 4 * a * c
    if disc < 0:
        return []
    s = disc**0.5
    return sorted(r for r in ((-b - s) / (2 * a), (-b + s) / (2 * a)) if r >= 0)


def _widths(cfg: MLAConfig) -> tuple[int, int, int, int, int]:
    return cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

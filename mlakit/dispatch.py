"""choose(): which path to run for a call, from the cost model (or a measured profile)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

from mlakit.config import MLAConfig
from mlakit.cost import choose_sparse, crossover

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
    measured on this machine decides. Otherwise the independent model of *Understanding MLA
    Decoding* (new and cached tokens independent); with no crossover (2L <= nope+v at long context)
    absorb always wins.
    """
    context = cached if isinstance(cached, int) else round(sum(cached) / max(1, len(cached)))
    if profile is not None:
        picked = profile.decide(cfg, new, context)
        if picked is not None:
            return picked
    point = _exact_crossover(_widths(cfg), context)
    if point is None or new < point:
        return "absorb"
    return "materialize"


def sparse_path(cfg: MLAConfig, new: int, cached: int, mode: str) -> str | None:
    """DSA: "sparse-absorb" or "sparse-materialize" when some of the new queries sees more than
    index_topk keys (`mode` "auto": the cheaper by the sparse cost model), else None: every query sees
    at most k keys and DSA is dense attention (`choose` decides)."""
    if not cfg.is_sparse or cached + new <= cfg.index_topk:
        return None
    if mode == "auto":
        return choose_sparse(cfg, new, cached)
    return f"sparse-{mode}"


def _widths(cfg: MLAConfig) -> tuple[int, ...]:
    return (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)


@functools.lru_cache(maxsize=65536)
def _exact_crossover(widths: tuple[int, ...], context: int) -> float | None:
    # choose() runs per layer per step; the crossover depends on these widths and the context only
    heads, latent, nope, rope, value = widths
    cfg = MLAConfig(
        hidden_size=heads,
        num_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=latent,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=value,
    )
    return crossover(cfg, context).exact

"""Multiply-adds per layer, term by term, for both paths and the shared projections.

Rule: a matmul (rows × inner)·(inner × cols) costs rows·cols·inner multiply-adds. Counts are per
layer and per sequence; `new` tokens attend to `cached` tokens already in the cache. With integer
arguments every count is an exact Python int.
"""

from __future__ import annotations

import math
from numbers import Real

from mlakit.config import MLAConfig

# "independent": the articles' model (new and cached tokens independent; exact for decode).
# "causal": each new token also attends to the earlier new ones (prefill of a chunk).
MODELS = ("independent", "causal")
# what the CLI, the bench and the page count by default: a step of S new tokens attends within itself
# causally, as mlakit runs it (the Python functions keep `model="independent"` as their default)
DEFAULT_COUNTING = "causal"
MODES = ("absorb", "materialize")


def check_model(model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"model (the counting model) must be one of {MODELS}, got {model!r}")


def check_count(name: str, value) -> None:
    """A token count: a real number >= 0 (floats are allowed for the crossover solvers)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of tokens >= 0, got {value!r}")


def keys_seen(new, cached, model: str = "independent"):
    """(query, key) pairs the new tokens score: n·c (articles) or n·c + n(n+1)/2 (causal prefill)."""
    check_model(model)
    if model == "independent":
        return new * cached
    triangle = new * (new + 1) // 2 if isinstance(new, int) else new * (new + 1) / 2
    return new * cached + triangle


def expanded_tokens(new, cached, model: str = "independent"):
    """Tokens whose latents are read (and, by materialize, expanded): the cache, plus the chunk if causal."""
    check_model(model)
    return cached if model == "independent" else cached + new


def materialize_macs(cfg: MLAConfig, new, cached, model: str = "independent") -> dict:
    _check(new, cached)
    h, lat, dn, dr, dv = widths(cfg)
    t = expanded_tokens(new, cached, model)
    pairs = keys_seen(new, cached, model)
    return {
        "expand_k": t * h * dn * lat,  # c_kv · W_UK for every expanded token
        "expand_v": t * h * dv * lat,  # c_kv · W_UV for every expanded token
        "scores": pairs * h * (dn + dr),  # q · [k_nope | k_pe]
        "weighted_sum": pairs * h * dv,  # probs · V
    }


def absorb_macs(cfg: MLAConfig, new, cached, model: str = "independent") -> dict:
    _check(new, cached)
    h, lat, dn, dr, dv = widths(cfg)
    pairs = keys_seen(new, cached, model)
    return {
        "fold_q": new * h * dn * lat,  # q_nope · W_UK per new token
        "scores": pairs * h * (lat + dr),  # q_lat · [c_kv | k_pe]
        "mix_latents": pairs * h * lat,  # probs · c_kv
        "unfold_v": new * h * lat * dv,  # o_lat · W_UV per new token
    }


def shared_macs(cfg: MLAConfig, new) -> dict:
    """The projections both paths run on the new tokens (transformers' parameter names)."""
    check_count("new", new)
    d, h = cfg.hidden_size, cfg.num_heads
    q_width = h * cfg.qk_head_dim
    terms = {}
    if cfg.q_lora_rank is None:
        terms["q_proj"] = new * d * q_width  # hidden · W_q
    else:
        terms["q_a_proj"] = new * d * cfg.q_lora_rank  # hidden · W_DQ
        terms["q_b_proj"] = new * cfg.q_lora_rank * q_width  # c_q · W_UQ
    terms["kv_a_proj_with_mqa"] = new * d * cfg.latent_dim  # hidden · W_DKV (c_kv and k_pe)
    terms["o_proj"] = new * h * cfg.v_head_dim * d  # attention output · W_O
    return terms


def path_terms(cfg: MLAConfig, mode: str, new, cached, model: str = "independent") -> dict:
    """The named multiply-add terms of one path's attention core."""
    if mode == "absorb":
        return absorb_macs(cfg, new, cached, model)
    if mode == "materialize":
        return materialize_macs(cfg, new, cached, model)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def path_macs(
    cfg: MLAConfig, mode: str, new, cached, model: str = "independent", include_shared: bool = False
):
    """Total multiply-adds of one path: its attention core, plus the shared projections if asked."""
    total = sum(path_terms(cfg, mode, new, cached, model).values())
    if include_shared:
        total += sum(shared_macs(cfg, new).values())
    return total


def widths(cfg: MLAConfig) -> tuple[int, int, int, int, int]:
    """(heads, latent, nope, rope, value): the widths every count is built from."""
    return cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim


def _check(new, cached) -> None:
    check_count("new", new)
    check_count("cached", cached)

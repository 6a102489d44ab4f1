"""Memory one bench cell needs, estimated from the widths before anything is allocated.

Generous on purpose: every backend's cache at once (latent, MHA's full K/V, transformers' re-expanded
K/V), the cell's inputs, fp32 activations of the new tokens, and a fixed slack for the score chunks
and the expansion workspace.
"""

from __future__ import annotations

from mlakit.bench.grid import Cell, Grid
from mlakit.config import MLAConfig

SLACK = 768 << 20
VALUE_BYTES = {"fp32": 4, "bf16": 2}


def weights_bytes(cfg: MLAConfig, e: int) -> int:
    d, h, L, dr = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk, dv = cfg.qk_nope_head_dim + dr, cfg.v_head_dim
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk if cfg.q_lora_rank else d * h * qk
    mla = q + d * (L + dr) + L * h * (cfg.qk_nope_head_dim + dv) + h * dv * d
    kv_baselines = 4 * d * h * dv  # W_q, W_k, W_v, W_o of the MHA/GQA/MQA layers
    return (mla + kv_baselines) * e


def cell_bytes(cfg: MLAConfig, cell: Cell, dtype: str, decode: bool) -> int:
    e = VALUE_BYTES[dtype]
    h, dv = cfg.num_heads, cfg.v_head_dim
    tokens = cell.batch * (cell.cached + cell.new)
    per_cached = cfg.latent_dim  # the latent cache row
    if decode:  # the decode-only baselines run here: MHA's K/V, transformers' re-expanded K/V
        per_cached += 2 * h * dv + h * (cfg.qk_head_dim + dv)
    new = cell.batch * cell.new
    act = 4 * cfg.hidden_size + h * (cfg.qk_head_dim + 2 * cfg.kv_lora_rank + 2 * dv)
    return 2 * tokens * per_cached * e + new * (cfg.hidden_size * e + act * 4) + SLACK


def grid_bytes(cfg: MLAConfig, grid: Grid, dtype: str) -> tuple[int, Cell]:
    """The largest cell's need (weights included) and that cell."""
    need, worst = max((cell_bytes(cfg, c, dtype, c.new == grid.decode_new), c) for c in grid.cells())
    return weights_bytes(cfg, VALUE_BYTES[dtype]) + need, worst

"""Tensor parallel MLA: heads split across the ranks of a group, the latent cache replicated.

Rank r keeps a contiguous block of heads: its rows of `q_b_proj` (or `q_proj`) and `kv_b_proj`, and
the matching input columns of `o_proj`; the down-projections and norms are replicated, so every rank
computes and caches the same `[c_kv | k_pe]` (the latent is shared by all heads and cannot be split
by head). One all-reduce after `o_proj` sums the ranks' partial outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from mlakit.attention import MLAAttention
from mlakit.cache.contiguous import LatentCache, Slots
from mlakit.config import MLAConfig
from mlakit.distributed import fingerprint as fp
from mlakit.distributed.group import agree, all_reduce_sum, rank_and_world


def head_range(num_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's heads: contiguous blocks, the first num_heads % world_size one larger."""
    if world_size > num_heads:
        raise ValueError(
            f"tensor parallel over {world_size} ranks needs at least as many heads, got {num_heads}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    base, extra = divmod(num_heads, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_state_dict(
    cfg: MLAConfig, state: dict[str, torch.Tensor], rank: int, world_size: int
) -> tuple[MLAConfig, dict[str, torch.Tensor]]:
    """(config with rank's head count, rank's slice of a full MLAAttention state dict)."""
    _check_full_state(cfg, state)
    h0, h1 = head_range(cfg.num_heads, rank, world_size)
    qk, kv = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    dv = cfg.v_head_dim
    local = {}
    for name, t in state.items():
        if name in ("q_proj.weight", "q_b_proj.weight"):
            local[name] = t[h0 * qk : h1 * qk]
        elif name == "kv_b_proj.weight":
            local[name] = t[h0 * kv : h1 * kv]
        elif name == "o_proj.weight":
            local[name] = t[:, h0 * dv : h1 * dv]
        elif name == "o_proj.bias":
            # added once: the all-reduce sums every rank's copy
            local[name] = t if rank == 0 else torch.zeros_like(t)
        else:
            local[name] = t
    return cfg.replace(num_heads=h1 - h0), {k: v.clone() for k, v in local.items()}


def _check_full_state(cfg: MLAConfig, state: dict[str, torch.Tensor]) -> None:
    want = {k: tuple(v.shape) for k, v in MLAAttention(cfg, device="meta").state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want.keys() != got.keys():
        raise ValueError(
            f"state dict keys do not match the layer: missing {sorted(want.keys() - got.keys())}, "
            f"unexpected {sorted(got.keys() - want.keys())}"
        )
    bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    if bad:
        raise ValueError(f"state dict shapes (given, expected) do not match the layer: {bad}")


class TensorParallelMLA(nn.Module):
    """Rank's share of the heads of one MLA layer over `group`; `local` is an MLAAttention of them.

    `forward(hidden_states [B,S,D], cache=None, *, mode="auto", slots=None) -> [B,S,D]`, the same on
    every rank, as the full layer gives. Every rank must call it with the same inputs; each rank
    holds its own full (replicated) LatentCache.
    """

    def __init__(
        self, cfg: MLAConfig, state: dict[str, torch.Tensor], group=None, *, device=None, dtype=None
    ):
        super().__init__()
        rank, world = rank_and_world(group)
        local_cfg, local_state = shard_state_dict(cfg, state, rank, world)
        if dtype is None:
            dtype = state["kv_b_proj.weight"].dtype
        self.local = MLAAttention(local_cfg, device=device, dtype=dtype)
        self.local.load_state_dict(local_state)
        self.cfg = cfg
        self.group = group
        self.heads = head_range(cfg.num_heads, rank, world)

    @classmethod
    def from_layer(cls, layer: MLAAttention, group=None) -> TensorParallelMLA:
        return cls(layer.cfg, layer.state_dict(), group, device=layer.device, dtype=layer.dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: LatentCache | None = None,
        *,
        mode: str = "auto",
        slots: Slots = None,
    ) -> torch.Tensor:
        fields = fp.step_fields(hidden_states, cache, slots, mode=mode, heads=self.cfg.num_heads)
        snap, out, error = None, None, None
        try:
            snap = None if cache is None else cache.lengths.clone()
            out = self.local(hidden_states, cache, mode=mode, slots=slots)  # [B, S, D], partial sum
        except Exception as err:
            error = err
        try:
            agree(self.group, error, "tensor-parallel attention", fields)
        except BaseException:
            if snap is not None:
                cache.lengths.copy_(snap)
            raise
        return all_reduce_sum(out, self.group, "tensor-parallel all-reduce")

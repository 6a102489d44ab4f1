"""Context parallel MLA: each sequence's latent cache split by position across the ranks of a group.

Placement is round-robin by blocks: global position p lives on rank `(p // block_size) % world_size`,
at the next free row of that rank's local LatentCache (a rank's tokens stay in position order, so
local row j maps back to one global position). Every rank projects the new tokens, keeps the ones it
owns, attends with absorb over its own part under the causal mask in global positions, and returns
(latent output, lse); one all-gather and the log-sum-exp merge give the whole attention, then W_UV
and o_proj run once. docs/distributed.md has the math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlakit.attention import MLAAttention, width_mismatches
from mlakit.cache.contiguous import LatentCache, Slots
from mlakit.config import MLAConfig
from mlakit.distributed import fingerprint as fp
from mlakit.distributed.group import agree, all_gather_stacked, rank_and_world
from mlakit.ops.absorb import fold_queries, latent_attention, unfold_values
from mlakit.ops.common import query_chunk
from mlakit.ops.merge import merge

DEFAULT_BLOCK_SIZE = 64


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class BlockPlacement:
    """Which global positions one rank holds: blocks of `block_size` dealt round-robin over ranks."""

    rank: int
    world_size: int
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        _check_count("world_size", self.world_size, 1)
        _check_count("block_size", self.block_size, 1)
        _check_count("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """Rank holding each global position."""
        return (positions // self.block_size) % self.world_size

    def count(self, length: int) -> int:
        """Tokens of positions 0 .. length-1 that this rank holds."""
        return owned_tokens(length, self.rank, self.world_size, self.block_size)

    def global_positions(self, local: int, device=None) -> torch.Tensor:
        """[local]: the global position of each of this rank's first `local` rows."""
        j = torch.arange(local, device=device)
        block = (j // self.block_size) * self.world_size + self.rank
        return block * self.block_size + j % self.block_size


def owned_tokens(length: int, rank: int, world_size: int, block_size: int) -> int:
    """Tokens among positions 0 .. length-1 in blocks dealt round-robin to `rank` of `world_size`."""
    full, tail = divmod(length, block_size)
    blocks = (full - rank + world_size - 1) // world_size if full > rank else 0
    return blocks * block_size + (tail if full % world_size == rank else 0)


class ContextParallelCache:
    """One rank's part of a context-parallel latent cache: `batch_size` slots of up to `max_seq_len`.

    `lengths` (CPU long [batch]) counts each slot's tokens over all ranks and is the same on every
    rank; `local` is a LatentCache with only this rank's tokens, in position order.
    """

    def __init__(
        self,
        cfg: MLAConfig,
        batch_size: int,
        max_seq_len: int,
        placement: BlockPlacement,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        _check_count("batch_size", batch_size, 1)
        _check_count("max_seq_len", max_seq_len, 1)
        self.cfg = cfg
        self.placement = placement
        self.max_seq_len = max_seq_len
        # a rank may own nothing of a short cache; LatentCache wants one row at least
        rows = max(1, placement.count(max_seq_len))
        self.local = LatentCache(cfg, batch_size, rows, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    def held_bytes(self) -> int:
        """Bytes of cached tokens this rank holds (one layer)."""
        return int(self.local.lengths.sum()) * self.local.bytes_per_token

    def check_append(self, new_tokens: int, slots: torch.Tensor) -> None:
        after = self.lengths[slots] + new_tokens
        if bool((after > self.max_seq_len).any()):
            raise ValueError(
                f"appending {new_tokens} tokens to slots {slots.tolist()} with lengths "
                f"{self.lengths[slots].tolist()} exceeds max_seq_len {self.max_seq_len}"
            )

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lengths.clone(), self.local.lengths.clone()

    def restore(self, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Back to a snapshot: lowering the lengths drops the tokens written since."""
        self.lengths.copy_(snap[0])
        self.local.lengths.copy_(snap[1])

    def write(self, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
        """Keep the new tokens [B,S,L] / [B,S,dr] this rank owns; every rank advances `lengths`."""
        new = c_kv.shape[1]
        for row, slot in enumerate(slots.tolist()):
            positions = int(self.lengths[slot]) + torch.arange(new)
            mine = (self.placement.owner(positions) == self.placement.rank).to(c_kv.device)
            if bool(mine.any()):
                self.local.append(c_kv[row : row + 1, mine], k_pe[row : row + 1, mine], [slot])
        self.lengths[slots] += new

    def release(self, slot: int) -> None:
        self.local.release(slot)
        self.lengths[slot] = 0


class ContextParallelMLA(nn.Module):
    """An MLAAttention run context-parallel over `group` (every rank holds the full weights).

    `forward(hidden_states [B,S,D], cache, slots=None) -> [B,S,D]`, the same on every rank: decode
    (S=1) and prefill chunks alike. Every rank must call it with the same inputs.
    """

    def __init__(self, layer: MLAAttention, group=None, *, block_size: int = DEFAULT_BLOCK_SIZE):
        super().__init__()
        rank, world = rank_and_world(group)
        self.layer = layer
        self.group = group
        self.placement = BlockPlacement(rank, world, block_size)

    def new_cache(self, batch_size: int, max_seq_len: int) -> ContextParallelCache:
        return ContextParallelCache(
            self.layer.cfg,
            batch_size,
            max_seq_len,
            self.placement,
            dtype=self.layer.dtype,
            device=self.layer.device,
        )

    def forward(self, hidden_states: torch.Tensor, cache: ContextParallelCache, slots: Slots = None):
        snap, error = None, None
        p = self.placement
        fields = fp.step_fields(hidden_states, cache, slots, block_size=p.block_size, world_size=p.world_size)
        try:
            slot_ids = self._check(hidden_states, cache, slots)
            snap = cache.snapshot()
            o_lat, lse = self._local_part(hidden_states, cache, slot_ids)
        except Exception as err:
            error = err
        try:
            agree(self.group, error, "context-parallel attention", fields)
        except BaseException:
            if snap is not None:
                cache.restore(snap)
            raise
        # lse rides as one more channel so that a single all-gather carries both
        packed = torch.cat([o_lat.float(), lse[..., None]], dim=-1)  # [B, S, H, L+1]
        parts = all_gather_stacked(packed, self.group, "context-parallel all-gather")  # [W, B, S, H, L+1]
        o_lat, _ = merge(list(parts[..., :-1]), list(parts[..., -1]))
        _, w_uv = self.layer.up_weights()
        out = unfold_values(o_lat.to(self.layer.dtype), w_uv)  # [B, S, H, dv]
        return self.layer.o_proj(out.reshape(*hidden_states.shape[:2], -1))

    def _check(self, hidden_states, cache: ContextParallelCache, slots: Slots) -> torch.Tensor:
        self.layer._check_hidden(hidden_states)
        if not isinstance(cache, ContextParallelCache):
            raise ValueError(f"cache must be a ContextParallelCache, got {type(cache).__name__}")
        if cache.placement != self.placement:
            raise ValueError(f"cache is placed as {cache.placement}, layer runs as {self.placement}")
        cfg = self.layer.cfg
        differ = width_mismatches(cache.cfg, cfg)
        if differ:
            raise ValueError(f"cache was built for another config: {differ}")
        if (cache.dtype, cache.device) != (self.layer.dtype, self.layer.device):
            raise ValueError(
                f"cache holds {cache.dtype} on {cache.device}, layer computes {self.layer.dtype} "
                f"on {self.layer.device}"
            )
        slot_ids = cache.local.resolve_slots(slots, hidden_states.shape[0])
        cache.check_append(hidden_states.shape[1], slot_ids)
        return slot_ids

    def _local_part(self, hidden_states, cache: ContextParallelCache, slot_ids: torch.Tensor):
        """Write this rank's new tokens, attend over its part: (o_lat [B,S,H,L], lse [B,S,H])."""
        new = hidden_states.shape[1]
        start = cache.lengths[slot_ids]
        positions = (start[:, None] + torch.arange(new)).to(hidden_states.device)  # [B, S]
        q_nope, q_pe, c_kv, k_pe = self.layer.project(hidden_states, positions)
        cache.write(c_kv, k_pe, slot_ids)
        w_uk, _ = self.layer.up_weights()
        q_lat = fold_queries(q_nope, w_uk)  # [B, S, H, L]
        return self._attend_part(q_lat, q_pe, cache, slot_ids, positions)

    def _attend_part(self, q_lat, q_pe, cache: ContextParallelCache, slot_ids, positions):
        batch, new, heads, latent = q_lat.shape
        keys = int(cache.local.lengths[slot_ids].max())
        if keys == 0:
            # nothing here yet: weight 0 in the merge
            o_lat = torch.zeros_like(q_lat)
            return o_lat, torch.full((batch, new, heads), float("-inf"), device=q_lat.device)
        c_kv, k_pe = cache.local.view(slot_ids, keys)
        # rows past a slot's own local length sit at global positions beyond all its queries: masked too
        key_pos = self.placement.global_positions(keys, device=q_lat.device)  # [T]
        outs, lses = [], []
        step = query_chunk(heads * batch, keys, new)
        for a in range(0, new, step):
            mask = key_pos[None, None, :] > positions[:, a : a + step, None]  # [B, q, T]
            o, lse = latent_attention(
                q_lat[:, a : a + step], q_pe[:, a : a + step], c_kv, k_pe, mask, self.layer.scale
            )
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs, dim=1), torch.cat(lses, dim=1)

"""V4Plan: what every layer of one step reads, built once on the host (no host reads in a layer).

For each row b of the step (slot s_b, cached length L_b, n_b new tokens, padded width S):
- the window: the ring rows of s_b (position p lives in row p mod R_w), which of them and of the new
  tokens each query sees (t − n_win < p ≤ t), and where each new token is written;
- per compression ratio m present in the model: the entries that complete in this step (w with
  L_b ≤ (w+1)·m − 1 < L_b + n_b), for each the source of its coff·m pooled tokens (carried in the
  compressor ring, or new), its rope position w·m and its store row; which entries each query sees
  (w < (t+1) // m); and where each new token's projections are carried.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlakit.cache.protocol import StepLife


@dataclass
class CompressPlan:
    ratio: int  # m
    coff: int  # 2 for CSA's overlapping windows, 1 for HCA
    ring_rows: torch.Tensor  # [B, R] flat rows of each slot's carried tokens
    src: torch.Tensor  # [B, E·coff·m] index into cat(carried [R], new [S]) of each pooled token
    src_valid: torch.Tensor  # [B, E, coff·m] False for positions < 0 (the first CSA entry's half)
    entry_pos: torch.Tensor  # [B, E] rope position w·m of each completed entry
    entry_write: torch.Tensor  # [B·E] flat store row of each completed entry (spare row: none)
    ring_write: torch.Tensor  # [B·S] flat ring row of each new token (spare row: not carried)
    bias_idx: torch.Tensor  # [B, S] position mod m of each new token (its row of position_bias)
    store_rows: torch.Tensor  # [B, N] flat store rows of entries 0..N−1 of each slot
    visible: torch.Tensor  # [B, S, N] query t sees entry w: w < (t+1)//m, and t is a real token
    num_entries: int  # E: most entries completed by one row this step (0: no pooling)
    num_keys: int  # N: most entries any row holds after this step
    # the distinct rows the step writes (the spare row last): what a layer saves before writing
    # (`V4Cache._begin_layer`) and an uncommitted plan puts back (`V4Cache._given_up`)
    ring_undo: torch.Tensor | None = None  # [U] rows of ring_write
    store_undo: torch.Tensor | None = None  # [U] rows of entry_write


@dataclass(eq=False)
class V4Plan(StepLife):
    """One step over a V4Cache: what every layer reads (device tensors), then the host facts of the
    step protocol the MLA caches share (`mlakit.cache.protocol.StepLife`: state, why, ran, owners,
    seen; `slots`, `starts`, `counts` on the CPU)."""

    cache: object
    slots: torch.Tensor  # [B] CPU long: the slot of each row
    starts: torch.Tensor  # [B] CPU: L_b
    counts: torch.Tensor  # [B] CPU: n_b
    width: int  # S
    positions: torch.Tensor  # [B, S] L_b + i (padding continues the count)
    win_rows: torch.Tensor  # [B, R_w] flat window-ring rows of each slot
    win_visible: torch.Tensor  # [B, S, R_w + S]
    win_write: torch.Tensor  # [B·S]
    win_undo: torch.Tensor  # [U] the distinct window rows the step writes (the spare row last)
    compress: dict[int, CompressPlan] = field(default_factory=dict)
    # layer -> [(buffer name, rows, their values before the layer's first write)]: what `discard`, a
    # newer plan or a stale plan's settling puts back (the rings hold positions `lengths` still covers)
    saved: dict = field(default_factory=dict, repr=False)

    @property
    def batch(self) -> int:
        return self.slots.numel()


def undo_rows(write: torch.Tensor, spare: int) -> torch.Tensor:
    """The distinct rows of `write` (a CPU index of the rows a step writes), the spare row last."""
    real = torch.unique(write[write != spare])
    return torch.cat([real, torch.tensor([spare], dtype=real.dtype)])


def _ring_positions(starts: torch.Tensor, ring: int) -> torch.Tensor:
    """[B, R] the position each ring row holds for a slot of length L (−1 when it holds none)."""
    j = torch.arange(ring)[None, :]
    last = starts[:, None] - 1
    pos = last - torch.remainder(last - j, ring)
    return torch.where(pos >= 0, pos, torch.full_like(pos, -1))


def _write_rows(starts, counts, width: int, ring: int, slots, spare: int) -> torch.Tensor:
    """[B·S] ring row of new token i of row b; the spare row for padding and tokens a later one of the
    same step overwrites (only the last `ring` are kept: no two writes land on one row)."""
    i = torch.arange(width)[None, :]
    keep = (i < counts[:, None]) & (i >= counts[:, None] - ring)
    rows = slots[:, None] * ring + torch.remainder(starts[:, None] + i, ring)
    return torch.where(keep, rows, torch.full_like(rows, spare)).reshape(-1)


def window_plan(starts, counts, width: int, window: int, ring: int, slots, spare: int) -> tuple:
    positions = starts[:, None] + torch.arange(width)[None, :]  # [B, S]
    real = torch.arange(width)[None, :] < counts[:, None]
    old = _ring_positions(starts, ring)  # [B, R]
    keys = torch.cat([old, torch.where(real, positions, torch.full_like(positions, -1))], dim=1)
    t = positions[:, :, None]
    visible = (keys[:, None, :] >= 0) & (keys[:, None, :] <= t) & (keys[:, None, :] > t - window)
    visible &= real[:, :, None]
    rows = slots[:, None] * ring + torch.arange(ring)[None, :]
    write = _write_rows(starts, counts, width, ring, slots, spare)
    return positions, rows, visible, write


def compress_plan(starts, counts, width: int, ratio: int, coff: int, ring: int, per_slot: int, slots, spare):
    """The pooling, carrying and visibility of one compression ratio (see the module docstring)."""
    m, b = ratio, len(starts)
    first = torch.div(starts, m, rounding_mode="floor")
    done = torch.div(starts + counts, m, rounding_mode="floor")
    num = done - first  # entries completed per row
    e_max = int(num.max()) if b else 0
    e = torch.arange(max(e_max, 1))[None, :]
    w = first[:, None] + e  # [B, E]
    real_entry = e < num[:, None]
    j = torch.arange(coff * m)
    pos = (w[:, :, None] - coff + 1) * m + j  # [B, E, coff·m]
    src = torch.where(
        pos < starts[:, None, None], torch.remainder(pos, ring), ring + pos - starts[:, None, None]
    )
    src_valid = (pos >= 0) | ~real_entry[:, :, None]
    src = torch.where(real_entry[:, :, None] & (pos >= 0), src, torch.zeros_like(src))
    write = torch.where(real_entry, slots[:, None] * per_slot + w, torch.full_like(w, spare["store"]))
    n_keys = int(done.max()) if b else 0
    widx = torch.arange(n_keys)
    t = starts[:, None] + torch.arange(width)[None, :]
    real = torch.arange(width)[None, :] < counts[:, None]
    visible = (widx[None, None, :] < torch.div(t + 1, m, rounding_mode="floor")[:, :, None]) & real[
        :, :, None
    ]
    return CompressPlan(
        ratio=m,
        coff=coff,
        ring_rows=slots[:, None] * ring + torch.arange(ring)[None, :],
        src=src[:, : max(e_max, 1)].reshape(b, -1),
        src_valid=src_valid,
        entry_pos=w * m,
        entry_write=write.reshape(-1),
        ring_write=_write_rows(starts, counts, width, ring, slots, spare["ring"]),
        bias_idx=torch.remainder(t, m),
        store_rows=slots[:, None] * per_slot + widx[None, :],
        visible=visible,
        num_entries=e_max,
        num_keys=n_keys,
    )

"""StepPlan: what is the same for every layer of one step, decided once on the host.

`cache.plan(new_tokens, slots)` checks the step, allocates its rows and builds the device tensors
below; every layer then reads them (`layer(hidden, plan)`) without reading a tensor value back to
the host; `cache.commit(plan)` advances `lengths` once. vLLM's attention metadata and FlashMLA's
scheduler metadata play the same part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlakit.dispatch import choose, sparse_path

# the smallest key bucket: short contexts share one shape
MIN_BUCKET = 16
FINE_BUCKETS_FROM = 1024


def key_bucket(keys: int, multiple: int = 1, cap: int | None = None) -> int:
    """A fixed padded key length for `keys` keys: the next power of two (at least MIN_BUCKET) up to
    FINE_BUCKETS_FROM, then the next of eight steps per octave (the torch path does the work of the
    masked keys too: powers of two would double it just past each one; this pads at most 12.5%),
    rounded up to a multiple of `multiple` (a page), at most `cap` (a contiguous cache's max_seq_len)."""
    size = MIN_BUCKET
    while size < min(keys, FINE_BUCKETS_FROM):
        size *= 2
    if keys > FINE_BUCKETS_FROM:
        step = 1 << ((keys - 1).bit_length() - 4)
        size = -(-keys // step) * step
    size = -(-size // multiple) * multiple
    return max(keys, min(size, cap)) if cap is not None else size


@dataclass(eq=False)
class RowGroup:
    """Rows of the step that run one path, with what that path reads."""

    path: str  # "absorb" | "materialize" | "sparse-absorb" | "sparse-materialize" (DSA past index_topk)
    rows: torch.Tensor | None  # [R] long (device): the group's batch rows; None: every row
    kv_lens: torch.Tensor  # [R] long (device): context after the step
    key_len: int  # the bucket: keys attended (masked past kv_lens)
    slots: torch.Tensor | None  # [R] long (device), contiguous cache: the slots to gather
    slot_start: int | None  # contiguous cache: first slot when the slots are consecutive (a view)
    read_rows: torch.Tensor | None  # [R, key_len] long (device), paged cache: row of each key


@dataclass(eq=False)
class StepPlan:
    """One step of a model over a cache. Device tensors (what layers read) come first, then host facts
    that stay the same from step to step inside a bucket, then the bookkeeping `commit` uses (layers
    never read it)."""

    cache: object
    positions: torch.Tensor  # [B, S] long: position of each new token (padding continues the row)
    cos: torch.Tensor  # [B, S, dr/2] fp32: rope tables of those positions, YaRN factor applied
    sin: torch.Tensor  # [B, S, dr/2]
    write_rows: torch.Tensor  # [B, S] long: row of each new token in a layer's rows (padding: spare row)
    kv_lens: torch.Tensor  # [B] long: context of each row after the step
    valid: torch.Tensor  # [B, S] bool: position i of row b is one of its new tokens
    q_index: torch.Tensor | None  # [B, S] long: ragged rows, query window j <- token q_index[b, j]
    o_index: torch.Tensor | None  # [B, S] long: and back, token i <- window o_index[b, i]
    # [B, key_len / block_size] int32 (paged): pages of each row, sentinel past (fixed width in a bucket)
    block_table: torch.Tensor | None
    groups: tuple[RowGroup, ...]
    batch: int
    seq_len: int
    key_len: int  # the step's bucket (the largest of its groups')
    rope_key: tuple
    row_modes: tuple[str, ...]
    slots: torch.Tensor = field(repr=False)  # [B] CPU long
    starts: torch.Tensor = field(repr=False)  # [B] CPU long: lengths before the step
    counts: torch.Tensor = field(repr=False)  # [B] CPU long: new tokens of each row
    state: str = "open"  # "open" until committed or superseded by a newer plan
    # the absorb backend over pages that ran ("triton" | "torch" | "mixed"), set by the layers; None: none
    backend: str | None = None
    # cos/sin in the full-width form `mlakit.rope.apply_tables` reads: keys [B, S, dr], queries
    # [B, S, 1, dr] (built once per step so that each layer rotates in a few ops)
    rope_k: object = field(default=None, repr=False)
    rope_q: object = field(default=None, repr=False)

    @property
    def ragged(self) -> bool:
        return self.q_index is not None

    @property
    def mode(self) -> str:
        """The path of every row, or "mixed"."""
        return self.row_modes[0] if len(set(self.row_modes)) == 1 else "mixed"

    def check_open(self) -> None:
        if self.state != "open":
            raise ValueError(
                f"plan is {self.state}; a plan serves one step: make a new one with cache.plan(...)"
            )


def decide_paths(cfg, starts: list[int], counts: list[int], uniform: bool, mode: str, profile) -> list[str]:
    """The path of each row: the caller's mode, or what "auto" picks (one decision for a uniform batch
    at its mean context, one per row for a ragged one). A DSA row group goes sparse once one of its
    queries sees more than index_topk keys."""
    if cfg.is_sparse:
        if uniform:
            sparse = sparse_path(cfg, counts[0], max(starts), mode)
            if sparse is not None:
                return [sparse] * len(counts)
        else:
            sparse = [sparse_path(cfg, c, s, mode) for c, s in zip(counts, starts, strict=True)]
            if any(sparse):
                dense = decide_paths(cfg.dense(), starts, counts, uniform, mode, profile)
                return [sp or d for sp, d in zip(sparse, dense, strict=True)]
    if mode != "auto":
        return [mode] * len(counts)
    if uniform:
        return [choose(cfg, counts[0], starts, profile=profile)] * len(counts)
    return [choose(cfg, c, s, profile=profile) for c, s in zip(counts, starts, strict=True)]


def ragged_indices(counts: torch.Tensor, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rows: the ops' queries are the last tokens of a context, so row b's n_b tokens move to
    the end of a window of width S (the first S - n_b entries repeat token 0 and are discarded)."""
    i = torch.arange(seq_len)[None, :]
    shift = (seq_len - counts)[:, None]  # [B, 1]
    q_index = (i - shift).clamp_min(0)  # [B, S]
    o_index = (i + shift).clamp_max(seq_len - 1)  # [B, S]
    return q_index.to(device), o_index.to(device)


def build_groups(
    paths: list[str], kv_lens: torch.Tensor, slots: torch.Tensor, device, bucket, rows_of
) -> tuple:
    """One RowGroup per path, in a fixed order. `rows_of(rows, key_len)` gives (slots, slot_start,
    read_rows) for the rows of a group; `bucket(keys)` the key length."""
    groups = []
    for path in sorted(set(paths)):
        rows = torch.tensor([b for b, p in enumerate(paths) if p == path], dtype=torch.long)
        key_len = bucket(int(kv_lens[rows].max()))
        dev_slots, slot_start, read_rows = rows_of(rows, key_len)
        every = rows.numel() == len(paths)
        groups.append(
            RowGroup(
                path,
                None if every else rows.to(device),
                kv_lens[rows].to(device),
                key_len,
                dev_slots,
                slot_start,
                read_rows,
            )
        )
    return tuple(groups)


def make_plan(
    cache,
    slots: list[int],
    counts: list[int],
    uniform: bool,
    seq_len: int,
    mode: str,
    profile,
    write_rows: torch.Tensor,
    bucket,
    rows_of,
    table_of=None,
) -> StepPlan:
    """Assemble a StepPlan once the cache has checked the step and given its new tokens rows."""
    device = cache.device
    slot_t = torch.tensor(slots, dtype=torch.long)
    counts_t = torch.tensor(counts, dtype=torch.long)
    starts = cache.lengths[slot_t].clone()
    kv_lens = starts + counts_t
    positions = starts[:, None] + torch.arange(seq_len)  # [B, S]
    paths = decide_paths(cache.cfg, starts.tolist(), counts, uniform, mode, profile)
    ragged = bool((counts_t != seq_len).any())
    q_index, o_index = ragged_indices(counts_t, seq_len, device) if ragged else (None, None)
    cos, sin = cache.rope.cos_sin(positions.to(device))
    rope_k = cache.rope.full_tables(cos, sin)
    groups = build_groups(paths, kv_lens, slot_t, device, bucket, rows_of)
    key_len = max(g.key_len for g in groups)
    return StepPlan(
        cache=cache,
        positions=positions.to(device),
        cos=cos,
        sin=sin,
        write_rows=write_rows.to(device),
        kv_lens=kv_lens.to(device),
        valid=(torch.arange(seq_len)[None, :] < counts_t[:, None]).to(device),
        q_index=q_index,
        o_index=o_index,
        block_table=None if table_of is None else table_of(key_len),
        groups=groups,
        batch=len(slots),
        seq_len=seq_len,
        key_len=key_len,
        rope_key=cache.rope.key,
        row_modes=tuple(paths),
        slots=slot_t,
        starts=starts,
        counts=counts_t,
        rope_k=rope_k,
        rope_q=rope_k.unsqueeze_heads(),
    )


def local_plan(
    cfg, rope, counts: list[int], uniform: bool, seq_len: int, mode: str, profile, device
) -> StepPlan:
    """A plan without a cache: every row attends over its own new tokens only (positions 0..)."""
    batch = len(counts)
    counts_t = torch.tensor(counts, dtype=torch.long)
    positions = torch.arange(seq_len).expand(batch, seq_len)
    paths = decide_paths(cfg, [0] * batch, counts, uniform, mode, profile)
    ragged = bool((counts_t != seq_len).any())
    q_index, o_index = ragged_indices(counts_t, seq_len, device) if ragged else (None, None)
    cos, sin = rope.cos_sin(positions.to(device))
    rope_k = rope.full_tables(cos, sin)
    groups = build_groups(
        paths, counts_t, counts_t, device, lambda keys: seq_len, lambda rows, k: (None, 0, None)
    )
    return StepPlan(
        cache=None,
        positions=positions.to(device),
        cos=cos,
        sin=sin,
        write_rows=None,
        kv_lens=counts_t.to(device),
        valid=(torch.arange(seq_len)[None, :] < counts_t[:, None]).to(device),
        q_index=q_index,
        o_index=o_index,
        block_table=None,
        groups=groups,
        batch=batch,
        seq_len=seq_len,
        key_len=seq_len,
        rope_key=rope.key,
        row_modes=tuple(paths),
        slots=torch.arange(batch),
        starts=torch.zeros(batch, dtype=torch.long),
        counts=counts_t,
        rope_k=rope_k,
        rope_q=rope_k.unsqueeze_heads(),
    )

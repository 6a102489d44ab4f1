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
from mlakit.ops.absorb import KEY_BLOCK
from mlakit.ops.common import compute_dtype
from mlakit.rope import _work_dtype, rotation_matrices

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
class LeanStep:
    """What the short decode form of a planned absorb call reads (one new token per row, one row group
    on absorb, one key block, matmuls in the storage dtype): built once per step so that each layer
    runs ~22 aten ops (`MLAAttention._compute_lean`). Device tensors only; `rows` is a host fact."""

    bias: torch.Tensor  # [B, 1, key_len] in the cache dtype: 0 where a key is visible, -inf past kv_lens
    rotation: torch.Tensor  # [B, dr, dr] (fp32, fp64 for fp64): k @ R is the rotated key, per row
    gather_rows: torch.Tensor | None  # [B * key_len] long (paged): row of each key, a view of read_rows
    rows: int


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
    # "open" until committed, discarded, superseded by a newer plan or made stale (`why` says how)
    state: str = "open"
    # the absorb backend over pages that ran ("triton" | "torch" | "mixed"), set by the layers; None: none
    backend: str | None = None
    # cos/sin in the full-width form `mlakit.rope.apply_tables` reads: keys [B, S, dr], queries
    # [B, S, 1, dr] (built once per step so that each layer rotates in a few ops)
    rope_k: object = field(default=None, repr=False)
    rope_q: object = field(default=None, repr=False)
    # the short decode form's tensors when the step qualifies (see `lean_step`); None: the general path
    lean: LeanStep | None = field(default=None, repr=False)
    # the protocol's host bookkeeping (layers never read it; no device sync): the layers that wrote the
    # step's rows (`cache.write` records them), why the plan is no longer open, the `lengths` tensor
    # and its version when last seen (a cheap test that nothing lowered a slot's length since), and
    # the plan whose step this one serves (itself; another after `copy_from`: what a graph replays)
    ran: set = field(default_factory=set, repr=False)
    # layer_idx -> id of the module that ran it: each layer_idx runs a step in one module only
    owners: dict = field(default_factory=dict, repr=False)
    why: str | None = field(default=None, repr=False)
    seen: tuple | None = field(default=None, repr=False)
    host: StepPlan | None = field(default=None, repr=False)
    # what `cache.write` takes: (c_kv shape, k_pe shape, dtype, device index), made once per plan
    write_facts: tuple | None = field(default=None, repr=False)

    @property
    def ragged(self) -> bool:
        return self.q_index is not None

    @property
    def mode(self) -> str:
        """The path of every row, or "mixed"."""
        return self.row_modes[0] if len(set(self.row_modes)) == 1 else "mixed"

    def copy_from(self, other: StepPlan) -> None:
        """Refill this plan's device tensors with those of `other`, an open plan of the same cache, slots,
        counts and shapes (one bucket): what a captured CUDA graph replays with. Every host fact must
        match (a ValueError names the first that differs: capture another graph). From then on this
        plan serves `other`'s step: the layers run on it eagerly write `other`'s rows and record it on
        `other`; using this plan is checked against `other` (stale, committed, ...). A graph replay
        runs no Python, so it records nothing: after `graph.replay()` call `mark_replayed()`, which
        credits `other` with the layers this plan ran when it was captured (else `commit(other)` is
        refused: a refill alone writes no row)."""
        if not isinstance(other, StepPlan):
            raise ValueError(f"other must be a StepPlan from cache.plan(...), got {type(other).__name__}")
        other.check_open()
        mine, theirs = _host_facts(self), _host_facts(other)
        for name, a in mine.items():
            if theirs[name] != a:
                raise ValueError(
                    f"plans differ in shape or host facts: {name} {a!r} here, {theirs[name]!r} in other; "
                    "capture another graph"
                )
        pairs = [(self.rope_k.cos, other.rope_k.cos), (self.rope_k.sin, other.rope_k.sin)]
        for name in ("positions", "cos", "sin", "write_rows", "kv_lens", "valid", "q_index", "o_index"):
            pairs.append((getattr(self, name), getattr(other, name)))
        pairs.append((self.block_table, other.block_table))
        for mine_g, theirs_g in zip(self.groups, other.groups, strict=True):
            for name in ("rows", "kv_lens", "slots", "read_rows"):
                pairs.append((getattr(mine_g, name), getattr(theirs_g, name)))
        if self.lean is not None:
            # gather_rows is a view of the group's read_rows: refilled with it
            pairs += [(self.lean.bias, other.lean.bias), (self.lean.rotation, other.lean.rotation)]
        for dst, src in pairs:
            if (dst is None) != (src is None) or (dst is not None and dst.shape != src.shape):
                raise ValueError("plans differ in shape: capture another graph")
        for dst, src in pairs:
            if dst is not None:
                dst.copy_(src)
        self.host = other

    def mark_replayed(self) -> None:
        """Record that a graph captured with this plan was replayed after `copy_from(other)`: `other` is
        credited with the layers this plan ran at capture (exactly what the replay wrote), so that
        `cache.commit(other)` accepts the step. Refused (ValueError) on a plan never refilled, or one
        whose step is no longer open."""
        if self.host is None or self.host is self:
            raise ValueError(
                "mark_replayed: this plan was never refilled; call captured.copy_from(plan) before the "
                "replay, then captured.mark_replayed() after it"
            )
        self.host.check_open()
        self.host.ran |= self.ran

    def claim(self, layer_idx: int, module) -> None:
        """Record that `module` runs layer `layer_idx` of this step; a second module with the same
        layer_idx is refused (two layers of a stack built with one index) before it writes. The same
        module may run again (a retry after it raised rewrites the same rows)."""
        step = self if self.host is None else self.host
        if step.owners.setdefault(layer_idx, id(module)) != id(module):
            raise ValueError(
                f"layer_idx {layer_idx} already ran this step in another module: two layers of the stack "
                "have the same layer_idx (MLAAttention(cfg, layer_idx=i) for layer i)"
            )

    @property
    def step(self) -> StepPlan:
        """The plan whose step this one serves: itself, or the plan it was last refilled from."""
        return self if self.host is None else self.host

    def check_open(self) -> None:
        """Refuse (ValueError saying why) a plan that no longer serves an open step: committed,
        discarded, superseded by a newer plan, or stale (a slot released or a length changed since)."""
        plan = self if self.host is None else self.host
        if plan.state != "open":
            why = "" if plan.why is None else f" ({plan.why})"
            raise ValueError(
                f"plan is {plan.state}{why}; a plan serves one step: discard it if it is still open "
                "and make a new one with cache.plan(...)"
            )
        cache = plan.cache
        if cache is not None and not torch.compiler.is_dynamo_compiling():
            seen, lengths = plan.seen, cache.lengths
            # `lengths` untouched since last seen (one attribute read, no tensor op): nothing to check
            if seen is None or lengths is not seen[0] or seen[1] is None or lengths._version != seen[1]:
                cache.check_step(plan)


def lengths_seen(lengths: torch.Tensor) -> tuple:
    """(lengths, its version counter): what `check_open` compares. An inference tensor keeps no version
    (None): every check then reads the lengths (host values, still no tensor op)."""
    try:
        return lengths, lengths._version
    except RuntimeError:
        return lengths, None


def _host_facts(plan: StepPlan) -> dict:
    """What a captured graph bakes in (shapes, paths, views) and what commit reads (slots, counts)."""
    return {
        "cache": id(plan.cache),
        "batch": plan.batch,
        "seq_len": plan.seq_len,
        "key_len": plan.key_len,
        "row_modes": plan.row_modes,
        "ragged": plan.ragged,
        "rope_key": plan.rope_key,
        "slots": plan.slots.tolist(),
        "counts": plan.counts.tolist(),
        "lean rows": None if plan.lean is None else plan.lean.rows,
        "row groups (bucket, first consecutive slot, every row, gathered)": [
            (g.key_len, g.slot_start, g.rows is None, g.slots is None) for g in plan.groups
        ],
    }


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
    paths: list[str] | None = None,
) -> StepPlan:
    """Assemble a StepPlan once the cache has checked the step and given its new tokens rows (`paths`:
    the path of each row when decided already)."""
    device = cache.device
    slot_t = torch.tensor(slots, dtype=torch.long)
    counts_t = torch.tensor(counts, dtype=torch.long)
    starts = cache.lengths[slot_t].clone()
    kv_lens = starts + counts_t
    positions = starts[:, None] + torch.arange(seq_len)  # [B, S]
    if paths is None:
        paths = decide_paths(cache.cfg, starts.tolist(), counts, uniform, mode, profile)
    ragged = bool((counts_t != seq_len).any())
    q_index, o_index = ragged_indices(counts_t, seq_len, device) if ragged else (None, None)
    cos, sin = cache.rope.cos_sin(positions.to(device))
    rope_k = cache.rope.full_tables(cos, sin)
    groups = build_groups(paths, kv_lens, slot_t, device, bucket, rows_of)
    key_len = max(g.key_len for g in groups)
    lean = lean_step(cache, groups, seq_len, ragged, rope_k)
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
        lean=lean,
        write_facts=(
            (len(slots), seq_len, cache.cfg.kv_lora_rank),
            (len(slots), seq_len, cache.cfg.qk_rope_head_dim),
            cache.dtype,
            -1 if device.index is None else device.index,
        ),
    )


def lean_step(cache, groups, seq_len: int, ragged: bool, rope_k) -> LeanStep | None:
    """The short decode form's tensors, or None when the step needs the general path: more than one
    new token, ragged rows, several row groups or a path other than absorb, DSA, more keys than one
    block, matmuls in another dtype than the storage's (bf16 on a CPU without native bf16), or a
    context the cache cannot hand out as it stands (non-consecutive slots, a quantized paged cache)."""
    if seq_len != 1 or ragged or len(groups) != 1 or cache.cfg.is_sparse:
        return None
    (g,) = groups
    dtype, device = cache.dtype, cache.device
    if g.path != "absorb" or g.key_len > KEY_BLOCK or compute_dtype(dtype, device) != dtype:
        return None
    if not cache.lean_ready(g):
        return None
    keys = torch.arange(g.key_len, device=device)
    hidden = keys[None, :] >= g.kv_lens[:, None]  # the one query of row b sits at kv_lens[b] - 1
    bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    rotation = rotation_matrices(rope_k, _work_dtype(dtype))[:, 0]  # [B, dr, dr]
    gather = None if g.read_rows is None else g.read_rows.view(-1)
    return LeanStep(bias[:, None, :], rotation, gather, g.kv_lens.shape[0])


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

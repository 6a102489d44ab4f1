"""StepPlan: what is the same for every layer of one step, decided once on the host.

`cache.plan(new_tokens, slots)` checks the step, allocates its rows and builds the device tensors
below; every layer then reads them (`layer(hidden, plan)`) without reading a tensor value back to
the host; `cache.commit(plan)` advances `lengths` once. The step's tokens are one packed axis (`N`,
the sum of the rows' new tokens; no padding), its rows ordered decode -> extend -> prefill, and the
plan carries what vLLM's attention metadata carries: `query_start_loc`, `seq_lens`, `slot_mapping`
and the block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlakit.cache.protocol import StepLife
from mlakit.dispatch import choose, sparse_path
from mlakit.ops.absorb import KEY_BLOCK
from mlakit.ops.common import core_dtype
from mlakit.rope import _work_dtype, one_pass, rotation_matrices

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
    """Rows of the step that run one path over one kind of chunk, with what that path reads. The rows
    of a group are consecutive in the plan's order (decode -> extend -> prefill), and so are their
    packed tokens: a group's queries and outputs are views of the step's `[N, ...]` tensors."""

    path: str  # "absorb" | "materialize" | "sparse-absorb" | "sparse-materialize" (DSA past index_topk)
    kind: str  # "decode" (one new token a row) | "extend" (a chunk over a cached prefix) | "prefill"
    rows: tuple[int, int]  # plan rows [r0, r1)
    tokens: tuple[int, int]  # packed tokens [t0, t1) = (r1 - r0) rows x `new` tokens
    new: int  # new tokens (queries) of each row
    kv_lens: torch.Tensor  # [R] long (device): context after the step
    key_len: int  # the bucket: keys attended (masked past kv_lens)
    slots: torch.Tensor | None  # [R] long (device), contiguous cache: the slots to gather
    slot_start: int | None  # contiguous cache: first slot when the slots are consecutive (a view)
    read_rows: torch.Tensor | None  # [R, key_len] long (device), paged cache: row of each key
    # [R, new, key_len] additive mask in the attention core's dtype (0 visible, -inf hidden), built once
    # per plan for the one-block absorb (keys hidden from every query hold zeros in every cache)
    bias: torch.Tensor | None = None

    @property
    def batch_rows(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclass(eq=False)
class StepPlan(StepLife):
    """One step of a model over a cache. Device tensors (what layers read) come first, then host facts
    that stay the same from step to step inside a bucket, then the bookkeeping `commit` uses (layers
    never read it).

    Two orders: the caller's rows (`slots`, `starts`, `counts`, `kv_lens`, `row_modes`: as given to
    `cache.plan`) and the plan's rows, decode -> extend -> prefill (`order[i]` is the caller's row of plan
    row i); the packed tokens and every per-row tensor of the step (`query_start_loc`, `seq_lens`,
    `block_table`, the groups) follow the plan's order. Hidden states reach a layer packed, `[N, D]` in
    the plan's order, or as the caller's rectangle `[batch, seq_len, D]` (row b's first counts[b]
    positions are its tokens; the rest is padding, never read, zero in the output)."""

    cache: object
    positions: torch.Tensor  # [N] long: position of each packed token
    cos: torch.Tensor  # [N, dr/2] fp32: rope tables of those positions, YaRN factor applied
    sin: torch.Tensor  # [N, dr/2]
    slot_mapping: torch.Tensor | None  # [N] long: the cache row each token writes (None: no cache)
    query_start_loc: torch.Tensor  # [B + 1] int32: plan row i's tokens are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] long: context of each plan row after the step
    # [B, key_len / block_size] int32 (paged, plan order): pages of each row, sentinel past
    block_table: torch.Tensor | None
    # [N] long: flat index in [batch * seq_len] of each packed token (None: the rectangle is the packing)
    pack: torch.Tensor | None
    groups: tuple[RowGroup, ...]
    batch: int
    seq_len: int
    num_tokens: int
    key_len: int  # the step's bucket (the largest of its groups')
    rope_key: tuple
    row_modes: tuple[str, ...]  # the path of each caller row
    query_start_loc_cpu: list = field(repr=False, default_factory=list)
    seq_lens_cpu: list = field(repr=False, default_factory=list)
    order: tuple = field(repr=False, default=())
    num_decodes: int = 0
    num_extends: int = 0
    num_prefills: int = 0
    kv_lens: torch.Tensor | None = field(default=None, repr=False)  # [B] long (device), caller order
    slots: torch.Tensor = field(default=None, repr=False)  # [B] CPU long
    starts: torch.Tensor = field(default=None, repr=False)  # [B] CPU long: lengths before the step
    counts: torch.Tensor = field(default=None, repr=False)  # [B] CPU long: new tokens of each row
    # the absorb backend over pages that ran ("triton" | "torch" | "mixed"), set by the layers; None: none
    backend: str | None = None
    # rope in the full-width form `mlakit.rope.apply_tables` reads: keys [N, dr], queries [N, 1, dr];
    # and, for a step of decode rows only where apply_tables has no one-pass form (CUDA, fp64), one
    # rotation per token [N, dr, dr] (a bmm per tensor)
    rope_k: object = field(default=None, repr=False)
    rope_q: object = field(default=None, repr=False)
    rotation: torch.Tensor | None = field(default=None, repr=False)
    # the step's own latents per layer when there is no cache (`LocalContext`)
    local: object = field(default=None, repr=False)
    # the plan whose step this one serves (itself; another after `copy_from`: what a graph replays);
    # the lifecycle's fields (state, why, ran, owners, seen) are StepLife's
    host: StepPlan | None = field(default=None, repr=False)
    # what `cache.write` takes: (packed shape, rectangle shape, dtype, device index), made once per plan
    write_facts: tuple | None = field(default=None, repr=False)

    @property
    def ragged(self) -> bool:
        """Whether the caller's rectangle holds padding or rows out of the plan's order."""
        return self.pack is not None

    @property
    def context(self):
        """What the layers read the latents from: the cache, or the step's own (`LocalContext`)."""
        return self.local if self.cache is None else self.cache

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
        names = ("positions", "cos", "sin", "slot_mapping", "query_start_loc", "seq_lens", "kv_lens")
        for name in (*names, "block_table", "pack", "rotation"):
            pairs.append((getattr(self, name), getattr(other, name)))
        for mine_g, theirs_g in zip(self.groups, other.groups, strict=True):
            for name in ("kv_lens", "slots", "read_rows", "bias"):
                pairs.append((getattr(mine_g, name), getattr(theirs_g, name)))
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


def _host_facts(plan: StepPlan) -> dict:
    """What a captured graph bakes in (shapes, paths, views) and what commit reads (slots, counts)."""
    return {
        "cache": id(plan.cache),
        "batch": plan.batch,
        "seq_len": plan.seq_len,
        "num_tokens": plan.num_tokens,
        "key_len": plan.key_len,
        "row_modes": plan.row_modes,
        "ragged": plan.ragged,
        "order": plan.order,
        "rope_key": plan.rope_key,
        "slots": plan.slots.tolist(),
        "counts": plan.counts.tolist(),
        "row groups (path, kind, rows, bucket, first consecutive slot, gathered)": [
            (g.path, g.kind, g.rows, g.key_len, g.slot_start, g.slots is None) for g in plan.groups
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


def row_kind(start: int, count: int) -> str:
    """ "decode" (one new token), "extend" (a chunk over a cached prefix) or "prefill" (from position 0)."""
    if count == 1:
        return "decode"
    return "extend" if start > 0 else "prefill"


KIND_ORDER = {"decode": 0, "extend": 1, "prefill": 2}


def plan_order(starts: list[int], counts: list[int], paths: list[str]) -> list[int]:
    """The plan's row order: decode rows first, then extends, then prefills; inside each kind rows of one
    path and one chunk length together (each run becomes one group); otherwise the caller's order."""
    kinds = [row_kind(s, c) for s, c in zip(starts, counts, strict=True)]
    return sorted(range(len(counts)), key=lambda b: (KIND_ORDER[kinds[b]], paths[b], counts[b]))


def group_rows(order: list[int], starts: list[int], counts: list[int], paths: list[str]) -> list[tuple]:
    """(path, kind, r0, r1) per group over the plan's rows: runs of rows of one kind, path and chunk
    length (their queries are a rectangle [R, new] of the packed tokens: a view)."""
    groups = []
    for i, b in enumerate(order):
        key = (paths[b], row_kind(starts[b], counts[b]), counts[b])
        if groups and groups[-1][0] == key:
            groups[-1][2] = i + 1
        else:
            groups.append([key, i, i + 1])
    return [(key[0], key[1], r0, r1) for key, r0, r1 in groups]


def make_plan(
    cache,
    slots: list[int],
    counts: list[int],
    uniform: bool,
    seq_len: int,
    mode: str,
    profile,
    write_rows: torch.Tensor | None,
    bucket,
    rows_of,
    table_of=None,
    paths: list[str] | None = None,
    starts: list[int] | None = None,
) -> StepPlan:
    """Assemble a StepPlan once the cache has checked the step and given its new tokens rows
    (`write_rows` [B, >= counts[b]]: row b's tokens' cache rows in its first counts[b] entries; `paths`:
    the path of each row when decided already; `starts`: the lengths before the step, else read from
    the cache). `rows_of(rows, key_len)` gives (slots, slot_start, read_rows) of a group's caller rows,
    `table_of(key_len)` the block table of the caller's rows (paged)."""
    device = cache.device if cache is not None else None
    batch = len(counts)
    if starts is None:
        starts = cache.lengths[torch.tensor(slots, dtype=torch.long)].tolist()
    if paths is None:
        paths = decide_paths(cache.cfg, starts, counts, uniform, mode, profile)
    order = plan_order(starts, counts, paths)
    kv = [s + c for s, c in zip(starts, counts, strict=True)]
    # the packed axis, in the plan's order
    qsl = [0]
    for b in order:
        qsl.append(qsl[-1] + counts[b])
    # one host list per packed tensor, one tensor each (a tensor op per row costs ~3 us at 64 rows)
    positions = torch.tensor([p for b in order for p in range(starts[b], kv[b])], dtype=torch.long)
    identity = order == list(range(batch))
    flat = None  # each packed token's place in the caller's rectangle [B * S]
    if not identity or any(c != seq_len for c in counts):
        flat = torch.tensor([b * seq_len + i for b in order for i in range(counts[b])], dtype=torch.long)
    pack = None if flat is None else flat.to(device)
    rope = cache.rope
    cos, sin = rope.cos_sin(positions.to(device))
    rope_k = rope.full_tables(cos, sin)
    all_decode = all(c == 1 for c in counts)
    # (where `apply_tables` rotates in one pass, decode rows take it: one op per tensor, no bmm)
    dr = rope_k.cos.shape[-1]
    matrices = all_decode and not one_pass(rope_k.cos.device, cache.dtype, dr, rope_k.layout)
    rotation = rotation_matrices(rope_k, _work_dtype(cache.dtype)) if matrices else None
    slot_mapping = None
    if write_rows is not None:
        rows_flat = write_rows[:, :seq_len].reshape(-1)
        slot_mapping = (rows_flat if flat is None else rows_flat[flat]).to(device)
    order_t = torch.tensor(order, dtype=torch.long)
    kv_t = torch.tensor(kv, dtype=torch.long)
    groups = []
    core = core_dtype(cache.dtype, device)
    for path, kind, r0, r1 in group_rows(order, starts, counts, paths):
        rows = order_t[r0:r1]
        new = counts[order[r0]]
        key_len = bucket(max(kv[b] for b in order[r0:r1]))
        dev_slots, slot_start, read_rows = rows_of(rows, key_len)
        g_lens = kv_t[rows].to(device)
        groups.append(
            RowGroup(
                path,
                kind,
                (r0, r1),
                (qsl[r0], qsl[r1]),
                new,
                g_lens,
                key_len,
                dev_slots,
                slot_start,
                read_rows,
                _bias(path, g_lens, new, key_len, core, device),
            )
        )
    key_len = max(g.key_len for g in groups)
    table = None
    if table_of is not None:
        table = table_of(key_len)
        if not identity:
            table = table.index_select(0, order_t.to(table.device))
    kinds = [row_kind(starts[b], counts[b]) for b in order]
    seq_lens_cpu = [kv[b] for b in order]
    dt = cache.dtype
    return StepPlan(
        cache=cache,
        positions=positions.to(device),
        cos=cos,
        sin=sin,
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.long).to(device),
        block_table=table,
        pack=pack,
        groups=tuple(groups),
        batch=batch,
        seq_len=seq_len,
        num_tokens=qsl[-1],
        key_len=key_len,
        rope_key=rope.key,
        row_modes=tuple(paths),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens_cpu,
        order=tuple(order),
        num_decodes=kinds.count("decode"),
        num_extends=kinds.count("extend"),
        num_prefills=kinds.count("prefill"),
        kv_lens=kv_t.to(device),
        slots=torch.tensor(slots, dtype=torch.long),
        starts=torch.tensor(starts, dtype=torch.long),
        counts=torch.tensor(counts, dtype=torch.long),
        rope_k=rope_k,
        rope_q=rope_k.unsqueeze_heads(),
        rotation=rotation,
        write_facts=(
            (qsl[-1], batch, seq_len, cache.cfg.kv_lora_rank, cache.cfg.qk_rope_head_dim),
            dt,
            -1 if device is None or device.index is None else device.index,
        ),
    )


def _bias(path: str, kv_lens: torch.Tensor, new: int, key_len: int, dtype, device) -> torch.Tensor | None:
    """The additive causal mask [R, new, key_len] of a group that absorbs over one key block (0 where
    query i of a row, at position kv_lens - new + i, sees the key; -inf past it)."""
    if path != "absorb" or key_len > KEY_BLOCK:
        return None
    keys = torch.arange(key_len, device=device)
    query = kv_lens[:, None] - new + torch.arange(new, device=device)  # [R, new]
    hidden = keys[None, None, :] > query[:, :, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


class LocalContext:
    """The context of a cache-less step: each layer's own new latents, packed [N, ...]; row r of the
    step attends over its own tokens only (positions 0..). What the layers read through, as a cache."""

    def __init__(self, plan_rope_dtype, device):
        self.dtype, self.device = plan_rope_dtype, device
        self.layers: dict = {}

    def write(self, plan, layer, c_kv, k_pe) -> None:
        self.layers[layer] = [c_kv, k_pe, None]

    def write_index(self, plan, layer, k_idx) -> None:
        self.layers[layer][2] = k_idx

    def _rows(self, layer, g, field: int) -> torch.Tensor:
        t = self.layers[layer][field]
        t0, t1 = g.tokens
        return t[t0:t1].view(g.batch_rows, g.new, -1)

    def keys(self, layer, g) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(layer, g, 0), self._rows(layer, g, 1)

    def key_reader(self, layer, g):
        c, k = self.keys(layer, g)
        return lambda start, stop: (c[:, start:stop], k[:, start:stop])

    def in_place(self, layer, g):
        return None

    def index_keys(self, layer, g, key_len=None) -> torch.Tensor:
        return self._rows(layer, g, 2)

    def selected(self, layer, g, positions):
        from mlakit.ops.sparse import gather_rows

        c, k = self.keys(layer, g)
        return gather_rows(c, positions), gather_rows(k, positions)


def local_plan(
    cfg, rope, counts: list[int], uniform: bool, seq_len: int, mode: str, profile, device, dtype
) -> StepPlan:
    """A plan without a cache: every row attends over its own new tokens only (positions 0..)."""

    class _Facts:  # what make_plan reads of a cache
        pass

    facts = _Facts()
    facts.cfg, facts.rope, facts.dtype, facts.device = cfg, rope, dtype, torch.device(device)
    batch = len(counts)
    plan = make_plan(
        facts,
        list(range(batch)),
        counts,
        uniform,
        seq_len,
        mode,
        profile,
        None,
        lambda keys: keys,
        lambda rows, k: (None, None, None),
        starts=[0] * batch,
    )
    plan.cache = None
    plan.local = LocalContext(dtype, facts.device)
    return plan

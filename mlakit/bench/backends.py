"""The registry: name → Backend, every one prepared by ONE signature `prepare(ctx, cell, inputs) -> Step`.

A Step runs one layer step (projections, cache write, attention, o_proj) from the same state every
time: `reset()` (untimed) puts the cache back to `cell.cached` tokens, `run()` returns [B,S,D].
Each backend names its oracle, prepared by the same signature, that the gate checks it against.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mlakit.bench import hf_layer
from mlakit.bench.context import BenchContext, CellInputs
from mlakit.bench.grid import Cell
from mlakit.bench.kv import KVLayer, naive_attention
from mlakit.bench.layers import einsum_absorb
from mlakit.cache.contiguous import LatentCache
from mlakit.ops import reference


@dataclass
class Step:
    run: Callable[[], torch.Tensor]
    reset: Callable[[], None] = lambda: None
    describe: Callable[[], dict] = dict  # facts known after a run, e.g. {"path": "absorb"} for auto


Prepare = Callable[[BenchContext, Cell, CellInputs], Step]


@dataclass(frozen=True)
class Backend:
    name: str
    prepare: Prepare
    oracle: Prepare | None  # the reference this backend must agree with; None: not an attention (untested)
    cost_path: str | None  # "absorb" / "materialize": the cost-model path its work follows; None: KV layer
    decode_only: bool = False  # timed only at the grid's smallest new-token count
    available: Callable[[], bool] = field(default=lambda: True)
    kv_heads: Callable[[BenchContext], int] | None = None  # KV layers: key/value heads
    note: str = ""
    sparse_only: bool = False  # runs only for a DSA model (MLAConfig.is_sparse)


def _latent_cache(ctx: BenchContext, cell: Cell, x: CellInputs) -> LatentCache:
    cache = LatentCache(ctx.cfg, cell.batch, cell.cached + cell.new, dtype=ctx.dtype, device=ctx.device)
    if cell.cached:
        cache.append(x.c_kv, x.k_pe)
    return cache


def _sparse_cache(ctx: BenchContext, cell: Cell, x: CellInputs) -> LatentCache:
    """A DSA LatentCache (in x's dtype) holding the cell's cached latents and random indexer keys fixed
    by the cell (drawn in the run's dtype: the fp64 oracle sees the very same values)."""
    cfg, dtype = ctx.sparse_cfg, x.c_kv.dtype
    cache = LatentCache(cfg, cell.batch, cell.cached + cell.new, dtype=dtype, device=ctx.device)
    if cell.cached:
        gen = ctx.generator(cell, salt=2)
        k_idx = ctx.randn(cell.batch, cell.cached, cfg.index_head_dim, gen=gen).to(dtype)
        plan = cache.plan(cell.cached, batch=cell.batch, mode="absorb")
        cache.write(plan, 0, x.c_kv, x.k_pe)
        cache.write_index(plan, 0, k_idx)
        cache.commit(plan)
    return cache


def sparse_step(mode: str, dtype: torch.dtype | None = None) -> Prepare:
    """mlakit's DSA layer (indexer included) in `mode` over a DSA LatentCache. With `dtype` (the
    oracle: fp64), a copy of the layer, its cache and inputs in that dtype; the output is cast back."""

    def prepare(ctx: BenchContext, cell: Cell, x: CellInputs) -> Step:
        layer = ctx.sparse_layer()
        if dtype is not None:
            layer = copy.deepcopy(layer).to(dtype)
            layer.indexer.weights_proj.float()  # the indexer's head weights are fp32 by design
            x = CellInputs(*(t.to(dtype) for t in (x.hidden, x.c_kv, x.k_pe)))
        cache = _sparse_cache(ctx, cell, x)

        ran = {}

        def run() -> torch.Tensor:
            out, ran["plan"] = layer.step(x.hidden, cache, mode=mode)
            return out.to(ctx.dtype)

        return Step(
            run=run,
            reset=lambda: cache.lengths.fill_(cell.cached),
            describe=lambda: {"path": ran["plan"].mode} if mode == "auto" else {},
        )

    return prepare


def mlakit_step(mode: str, op=None) -> Prepare:
    """mlakit's layer in `mode` over a LatentCache; with `op`, that op replaces the path's attention."""

    def prepare(ctx: BenchContext, cell: Cell, x: CellInputs) -> Step:
        cache = _latent_cache(ctx, cell, x)
        layer = ctx.layer

        ran = {}

        def run() -> torch.Tensor:
            if op is None:
                out, ran["plan"] = layer.step(x.hidden, cache, mode=mode)
                return out
            with layer.using(op):
                out, ran["plan"] = layer.step(x.hidden, cache, mode=mode)
                return out

        return Step(
            run=run,
            reset=lambda: cache.lengths.fill_(cell.cached),
            describe=lambda: {"path": ran["plan"].mode} if mode == "auto" else {},
        )

    return prepare


def transformers_step(ctx: BenchContext, cell: Cell, x: CellInputs) -> Step:
    hf = ctx.hf_layer()
    cos_sin, mask = hf.inputs(x.hidden, cell.cached)
    state = {}

    def reset() -> None:
        state["cache"] = hf.new_cache(x.c_kv, x.k_pe)

    reset()
    return Step(run=lambda: hf.step(x.hidden, state["cache"], cos_sin, mask), reset=reset)


def kv_step(kv_heads: Callable[[BenchContext], int], attend=None) -> Prepare:
    """A KV layer with its own cache, filled with random keys and values fixed by the cell."""

    def prepare(ctx: BenchContext, cell: Cell, x: CellInputs) -> Step:
        layer = KVLayer(ctx.kv_weights(), kv_heads(ctx))
        k, v = layer.new_cache(cell.batch, cell.cached + cell.new, dtype=ctx.dtype, device=ctx.device)
        gen = ctx.generator(cell, salt=1)
        k[:, :, : cell.cached] = ctx.randn(*k[:, :, : cell.cached].shape, gen=gen)
        v[:, :, : cell.cached] = ctx.randn(*v[:, :, : cell.cached].shape, gen=gen)
        return Step(run=lambda: layer.step(x.hidden, k, v, cell.cached, attend=attend))

    return prepare


def projections_step(ctx: BenchContext, cell: Cell, x: CellInputs) -> Step:
    """The step's projections alone (q and kv down/up, norms, rope, o_proj): subtracted from a
    step's time, they leave its attention core."""
    layer = ctx.layer
    positions = (cell.cached + torch.arange(cell.new, device=ctx.device))[None].expand(cell.batch, -1)
    attn = torch.zeros(
        cell.batch, cell.new, ctx.cfg.num_heads * ctx.cfg.v_head_dim, dtype=ctx.dtype, device=ctx.device
    )

    def run() -> torch.Tensor:
        layer.project(x.hidden, positions)
        return layer.o_proj(attn)

    return Step(run=run)


def _gqa_heads(ctx: BenchContext) -> int:
    return math.gcd(ctx.cfg.num_heads, 8)


MLA_ORACLE = mlakit_step("absorb", op=reference)


def _kv_backend(name: str, heads: Callable[[BenchContext], int], note: str) -> Backend:
    return Backend(
        name,
        kv_step(heads),
        kv_step(heads, attend=naive_attention),
        None,
        decode_only=True,
        kv_heads=heads,
        note=note,
    )


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("mlakit-absorb", mlakit_step("absorb"), MLA_ORACLE, "absorb", note="mlakit, absorb path"),
        Backend(
            "mlakit-materialize",
            mlakit_step("materialize"),
            MLA_ORACLE,
            "materialize",
            note="mlakit, materialize path",
        ),
        Backend("mlakit-auto", mlakit_step("auto"), MLA_ORACLE, None, note="mlakit, the path auto picks"),
        Backend(
            "einsum-absorb",
            mlakit_step("absorb", op=einsum_absorb),
            MLA_ORACLE,
            "absorb",
            decode_only=True,
            note="absorb as reference inference code writes it (einsums, full scores)",
        ),
        Backend(
            "transformers",
            transformers_step,
            MLA_ORACLE,
            "materialize",
            decode_only=True,
            available=hf_layer.available,
            note="transformers DeepseekV3Attention + DynamicCache (re-expands every cached latent)",
        ),
        _kv_backend("mha", lambda ctx: ctx.cfg.num_heads, "MHA at the same heads and head width"),
        _kv_backend("gqa8", _gqa_heads, "GQA with 8 key/value heads"),
        _kv_backend("mqa", lambda ctx: 1, "MQA: one key/value head"),
        Backend(
            "mlakit-sparse",
            sparse_step("auto"),
            sparse_step("materialize", dtype=torch.float64),
            "sparse-absorb",
            decode_only=True,
            note="mlakit's DSA layer (indexer + top-k, auto: sparse-absorb past index_topk)",
            sparse_only=True,
        ),
        Backend(
            "mlakit-projections",
            projections_step,
            None,
            None,
            decode_only=True,
            note="the projections of an mlakit step alone (step minus these: the attention core)",
        ),
    )
}
DEFAULT_BACKENDS = tuple(BACKENDS)
PATHS = {"absorb": "mlakit-absorb", "materialize": "mlakit-materialize"}


def resolve_backends(names: list[str] | tuple[str, ...] | None, sparse: bool = False) -> list[Backend]:
    """The named backends (all when None) that can run here; ValueError on an unknown name. The
    sparse-only ones (mlakit-sparse) come with a DSA model (`sparse`) alone."""
    if names is None:
        return [b for b in BACKENDS.values() if b.available() and (sparse or not b.sparse_only)]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backends {unknown}; expected some of {sorted(BACKENDS)}")
    dense_only = [n for n in names if BACKENDS[n].sparse_only and not sparse]
    if dense_only:
        raise ValueError(f"backends {dense_only} need a DSA model (index_topk set), got a dense one")
    return [BACKENDS[n] for n in names]

"""Helpers of the cache tests: small configs and a tensor-storage peak meter; and the step protocol's
tiny setup (hidden 32, 2 heads, latent 16, rope 4; two layers; a contiguous cache of 3 slots x 32 tokens
or a paged one of 24 pages of 4), state snapshots compared bit for bit, and the visible latents of every
slot and layer.

assert_close, seeded layers and inputs come from support.common.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mlakit import LatentCache, MLAConfig
from mlakit.cache.paged import PagedLatentCache
from support.common import make_layer, tiny_config

# the same odd, unequal widths the layer tests use (nope 6 != v 5, L 20 != D 40)
small_config = tiny_config


def quant_config(**changes) -> MLAConfig:
    """fp8 needs the latent in groups of 128: two groups, rope 16 wide."""
    return small_config(kv_lora_rank=256, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=12, **changes)


class PeakMemory(TorchDispatchMode):
    """Bytes of tensor storage created inside the block and still alive, and its peak.

    A tracemalloc for torch: every storage an op creates is counted until it is freed (weakref
    finalizer). Storages created before the block (the cache, the weights) are not counted.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self._seen:
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


# the step protocol's tiny setup
CFG = MLAConfig(
    hidden_size=32,
    num_heads=2,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
)
# the same widths with a DSA indexer (the sparse repros)
DSA = MLAConfig(
    hidden_size=32,
    num_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=4,
    indexer_rope_interleave=False,
)
KINDS = ["contiguous", "paged"]
SLOTS, MAX_LEN = 3, 32


def make_cache(kind: str, layers: int = 2):
    if kind == "contiguous":
        return LatentCache(CFG, SLOTS, MAX_LEN, num_layers=layers)
    cache = PagedLatentCache(CFG, 24, 4, max_batch=SLOTS, num_layers=layers)
    cache.blocks.shuffle(5)
    return cache


def make_layers(n: int = 2, seed: int = 40) -> list:
    layers = [make_layer(CFG, seed=seed + i) for i in range(n)]
    for i, layer in enumerate(layers):
        layer.layer_idx = i
    return layers


def state(cache) -> list:
    """Every buffer, and the host bookkeeping that decides where the next rows go."""
    host = (
        (list(cache.written), list(cache._dirty))
        if isinstance(cache, LatentCache)
        else (list(cache.blocks.free), [list(t) for t in cache.blocks.tables], list(cache.blocks.tokens))
    )
    return [t.clone() for t in cache.buffers()] + [host]


def assert_same(cache, before, what: str = "a refused call") -> None:
    """Bit-identical buffers (NaN compares equal to itself as bytes) and host bookkeeping."""
    now = state(cache)
    for got, want in zip(now[:-1], before[:-1], strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{what} changed a buffer"
    assert now[-1] == before[-1], f"{what} changed the bookkeeping: {before[-1]} -> {now[-1]}"


def visible(cache, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_kv [n, L], k_pe [n, dr]) of the slot's first lengths[slot] tokens in one layer."""
    n = int(cache.lengths[slot])
    c_kv, k_pe = cache.view(torch.tensor([slot]), max(n, 1), layer=layer)
    return c_kv[0, :n].clone(), k_pe[0, :n].clone()


def run(layers, h, plan):
    for layer in layers:
        h = layer(h, plan)
    return h


def step(layers, cache, h, counts=None, slots=None):
    """One planned step over the whole stack, committed; returns the output."""
    plan = cache.plan(h.shape[1] if counts is None else counts, slots, seq_len=h.shape[1], batch=h.shape[0])
    out = run(layers, h, plan)
    cache.commit(plan)
    return out

"""Helpers of the paged-cache tests: small configs and a tensor-storage peak meter.

assert_close, seeded layers and inputs come from the shared tests/helpers.py.
"""

from __future__ import annotations

import weakref

import torch
from helpers import assert_close, make_layer, randn, rel_error  # noqa: F401  (re-exported)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mlakit import MLAConfig


def small_config(**changes) -> MLAConfig:
    """Unequal widths (nope 6 != v 5, L 20 != D 40) so that a swapped axis cannot go unnoticed."""
    base = dict(
        hidden_size=40,
        num_heads=3,
        q_lora_rank=24,
        kv_lora_rank=20,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        rope_interleave=True,
    )
    base.update(changes)
    return MLAConfig(**base)


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

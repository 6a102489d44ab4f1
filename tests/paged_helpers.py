"""Helpers of the paged-cache tests: assert_close that prints error and scale, small seeded layers.

(The shared tests/helpers.py has the same assert_close; this file keeps these tests self-contained.)
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mlakit import MLAAttention, MLAConfig


def rel_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """(max abs error, scale = max |want|, error / scale), in float64."""
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    err = (got64 - want64).abs().max().item() if want64.numel() else 0.0
    scale = want64.abs().max().item() if want64.numel() else 0.0
    return err, scale, err / max(scale, 1e-30)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> float:
    """Max |got - want| <= rtol · max |want|; prints both so that -s shows the margin."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert not torch.isnan(want).any(), f"{name}: the expected tensor has NaN"
    assert not torch.isnan(got).any(), f"{name}: got NaN where the expected tensor has none"
    err, scale, rel = rel_error(got, want)
    print(f"{name}: max err {err:.3e}, scale {scale:.3e}, relative {rel:.3e} (rtol {rtol:.1e})")
    assert rel <= rtol, (
        f"{name}: relative error {rel:.3e} > {rtol:.1e} (max err {err:.3e}, scale {scale:.3e})"
    )
    return rel


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


def make_layer(cfg: MLAConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> MLAAttention:
    """A layer with seeded weights ~ N(0, 1/fan_in) and norm gains ~ 1 ± 0.3."""
    layer = MLAAttention(cfg, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name.endswith("layernorm.weight"):
                values = 1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            elif p.dim() == 2:
                values = torch.randn(p.shape, generator=g, dtype=torch.float64) / p.shape[1] ** 0.5
            else:
                values = 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(values.to(p.dtype))
    return layer.eval()


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


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

"""Optional fused GPU kernels (Triton) for the absorbed decode over the paged cache.

- `absorb_decode.py`: the split-KV kernel over the pages and its LSE merge (`absorb_decode`);
- `paged.py`: `absorb_paged`, the whole absorb (fold, kernel, unfold) with `absorb_chunked`'s result;
- `configs.py`: the tiles per head count and latent format, and the split count.

`import mlakit` never imports this package, and this package imports without Triton: `available()`
says whether the kernel can run (Triton installed, and a CUDA device or Triton's interpreter).
"""

from __future__ import annotations

import importlib.util

import torch

from mlakit.kernels.absorb_decode import absorb_decode, interpreting
from mlakit.kernels.configs import GPU_CONFIGS, KernelConfig, choose_splits, pick_config
from mlakit.kernels.paged import BACKENDS, absorb_paged, pick_backend


def available(device: torch.device | str | None = None) -> bool:
    """Whether the kernel can run on `device` (default: CUDA if present): Triton importable, and the
    device a CUDA one, or Triton imported under TRITON_INTERPRET=1 (any device, on the CPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if interpreting():
        return True
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


__all__ = [
    "BACKENDS",
    "GPU_CONFIGS",
    "KernelConfig",
    "absorb_decode",
    "absorb_paged",
    "available",
    "choose_splits",
    "interpreting",
    "pick_backend",
    "pick_config",
]

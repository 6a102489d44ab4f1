"""Launch configurations of the absorbed-decode kernel, and the split count; no Triton, no device reads.

`triton.autotune` does not run under the interpreter (and would time inside a captured graph), so the
tiles come from a small table of our own keyed by head count and latent format. A caller can pass its
own `KernelConfig` to `absorb_decode(config=...)`; `benchmarks/gpu_decode.py --configs` times others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows (token, head) per program: they share every key tile
    block_n: int  # keys per step of the online softmax
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {value}")
        for name in ("num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"KernelConfig.{name} must be >= 1, got {getattr(self, name)}")


# (most heads, latent format) → tiles on a GPU; the first row whose head count fits wins. The tiles of
# the Triton MLA decode that SGLang and vLLM share (16 heads × 32 keys, 4 warps); fp8 rows dequantize
# a tile in registers, so they take the same tiles. Tensor-core dots need every tile side >= 16.
GPU_CONFIGS: tuple[tuple[int, str, KernelConfig], ...] = (
    (16, "16bit", KernelConfig(16, 32, 4, 2)),
    (1 << 30, "16bit", KernelConfig(16, 32, 4, 2)),
    (16, "fp8", KernelConfig(16, 32, 4, 2)),
    (1 << 30, "fp8", KernelConfig(16, 32, 4, 2)),
    (16, "int8", KernelConfig(16, 32, 4, 2)),
    (1 << 30, "int8", KernelConfig(16, 32, 4, 2)),
    (1 << 30, "fp32", KernelConfig(16, 16, 4, 1)),
)

# the interpreter runs one program after another, each op a numpy call on a whole tile: fewer, larger
# tiles are faster there (the GPU tiles are still tested by passing them explicitly)
INTERPRET_BLOCK_M = 64
INTERPRET_BLOCK_N = 64

# a split shorter than this many keys costs more in stage 2 than it gains in parallelism
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# programs per SM the split count aims for (several resident programs hide the page-gather latency)
PROGRAMS_PER_SM = 4


def latent_format(quant: str | None, dtype: torch.dtype) -> str:
    """The table's key for a token layout: "fp8", "int8", "fp32" or "16bit"."""
    if quant is not None:
        return quant
    return "fp32" if dtype == torch.float32 else "16bit"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pick_config(
    rows: int, heads: int, fmt: str, *, interpret: bool, override: KernelConfig | None = None
) -> KernelConfig:
    """Tiles for `rows` query rows (tokens × heads) of `heads` heads and latent format `fmt`."""
    if override is not None:
        return override
    if interpret:
        return KernelConfig(min(INTERPRET_BLOCK_M, max(16, next_pow2(rows))), INTERPRET_BLOCK_N, 1, 1)
    for most, key, cfg in GPU_CONFIGS:
        if key == fmt and heads <= most:
            return cfg
    raise ValueError(f"no kernel config for {heads} heads of format {fmt!r}; pass config=KernelConfig(...)")


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host-side property: no sync); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(batch: int, row_tiles: int, max_keys: int, sms: int) -> int:
    """Key splits per (row, row tile) from static facts only: the bucket's key capacity `max_keys`
    (block-table width × block size), the batch, the row tiles and the SM count.

    Enough programs to fill the SMs PROGRAMS_PER_SM deep, but no split under MIN_KEYS_PER_SPLIT keys
    of the bucket, and at most MAX_SPLITS.
    """
    base = max(1, batch * row_tiles)
    want = -(-sms * PROGRAMS_PER_SM // base)
    room = max(1, max_keys // MIN_KEYS_PER_SPLIT)
    return max(1, min(want, room, MAX_SPLITS))

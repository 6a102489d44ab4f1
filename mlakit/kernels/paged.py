"""absorb_paged: the absorb path over a paged cache with the fused kernel — `absorb_chunked`'s (out, lse).

The host side of the kernel: fold W_UK into the queries (one bmm), run `absorb_decode` over the pages
through the block table, unfold W_UV (one bmm). `pick_backend` is the switch an attention layer uses:
"triton" where the kernel runs fast (CUDA with Triton), "torch" elsewhere or when forced.
"""

from __future__ import annotations

import functools

import torch

from mlakit.cache.paged import PagedLatentCache
from mlakit.cache.quant import TokenLayout
from mlakit.kernels.absorb_decode import absorb_decode
from mlakit.kernels.checks import check_table
from mlakit.kernels.configs import KernelConfig
from mlakit.ops.absorb import fold_queries, unfold_values

BACKENDS = ("auto", "triton", "torch")


def absorb_paged(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache_or_pages: PagedLatentCache | torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    *,
    layout: TokenLayout | None = None,
    layer: int = 0,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
    interpret: bool | None = None,
    check: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`absorb` (see `mlakit.ops`) over paged rows: (out [B,S,H,dv] in q_nope's dtype, lse [B,S,H] fp32).

    `cache_or_pages`: a `PagedLatentCache` (the pages of its layer `layer`, its layout) or one layer's
    uint8 pages with `layout`. `block_table` [B, NB] and `kv_lens` [B] as `absorb_decode` takes them;
    on another device than the pages they are copied there (pass device tensors inside a captured graph).

    The kernel trusts the table and the lengths (a bad page id or a length past the table is skipped
    or reads NaN without a word), so they are checked (`kernels.checks.check_table`) where they are
    host facts: when both are CPU tensors (a ValueError before anything runs), or always with
    `check=True` (device tensors are read back: a sync, not for a captured graph). A step plan of a
    `PagedLatentCache` builds them on the host from its block manager: in range by construction.
    """
    pages, layout = _pages(cache_or_pages, layout, layer)
    if check or (block_table.device.type == "cpu" and kv_lens.device.type == "cpu"):
        for name, t in (("block_table", block_table), ("kv_lens", kv_lens)):
            if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t))}")
        if block_table.dim() != 2 or kv_lens.dim() != 1 or kv_lens.shape[0] != block_table.shape[0]:
            raise ValueError(
                f"block_table [B, NB] and kv_lens [B] disagree: {tuple(block_table.shape)} and "
                f"{tuple(kv_lens.shape)}"
            )
        check_table(block_table, kv_lens, pages.shape[0], pages.shape[1])
    device = pages.device
    q_lat = fold_queries(q_nope.to(w_uk.dtype), w_uk)  # [B, S, H, L]
    o_lat, lse = absorb_decode(
        q_lat,
        q_pe,
        pages,
        block_table.to(device, non_blocking=True),
        kv_lens.to(device, non_blocking=True),
        layout,
        scale,
        num_splits=num_splits,
        config=config,
        interpret=interpret,
    )
    out = unfold_values(o_lat.to(w_uv.dtype), w_uv)  # [B, S, H, dv]
    return out.to(q_nope.dtype), lse


def pick_backend(device: torch.device | str, backend: str = "auto", quant: str | None = None) -> str:
    """ "triton" or "torch" for the absorb path over pages on `device`. "auto": the kernel on a CUDA
    device of compute capability 8.0 or more (8.9 for fp8 rows: e4m3 conversions) when Triton is
    installed — the interpreter is for tests, never chosen by "auto"; "torch" forces the reference
    path; "triton" asks for the kernel (it raises later if it cannot run)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    from mlakit.kernels.absorb_decode import triton

    device = torch.device(device)
    if triton is None or device.type != "cuda":
        return "torch"
    need = (8, 9) if quant == "fp8" else (8, 0)
    return "triton" if _capability(device) >= need else "torch"


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _pages(cache_or_pages, layout: TokenLayout | None, layer: int) -> tuple[torch.Tensor, TokenLayout]:
    if isinstance(cache_or_pages, PagedLatentCache):
        if layout is not None and layout != cache_or_pages.layout:
            raise ValueError(f"layout {layout} differs from the cache's {cache_or_pages.layout}")
        layers = cache_or_pages.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
            raise ValueError(f"layer {layer!r} out of range, expected 0..{layers - 1}")
        return cache_or_pages.layer_pages(layer), cache_or_pages.layout
    if not isinstance(cache_or_pages, torch.Tensor) or layout is None:
        raise ValueError(
            "cache_or_pages must be a PagedLatentCache, or a pages tensor given with layout=, "
            f"got {type(cache_or_pages).__name__} and layout {layout!r}"
        )
    return cache_or_pages, layout

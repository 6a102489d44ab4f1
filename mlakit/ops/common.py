"""Helpers both paths share: the causal/ragged mask, an fp32 softmax that also returns lse."""

from __future__ import annotations

import torch

# scores computed at once are capped at this many elements (256 MB in fp32)
SCORE_BUDGET = 1 << 26


def _native_bf16() -> bool:
    """Native bf16 dot products: AVX512-BF16 or AMX-BF16 on x86 (oneDNN's own probe also says yes for
    AVX-512 without them, where bf16 is emulated), oneDNN's probe elsewhere (Arm BF16)."""
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)  # torch >= 2.3
    caps = probe() if probe is not None else {}
    if caps.get("architecture") == "x86_64":
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# whether this CPU has native 16-bit GEMMs, asked once at import (a constant to torch.compile)
_CPU_FAST = {
    torch.bfloat16: _native_bf16(),
    torch.float16: bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
}


def _cpu_has_fast(dtype: torch.dtype) -> bool:
    return _CPU_FAST.get(dtype, True)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax statistics and accumulators use: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def zero_past_lengths(
    block: torch.Tensor, kv_lens: torch.Tensor, start: int, static: bool = False
) -> torch.Tensor:
    """`block` [B, t, ·] (context rows start..start+t) with the rows at or past each row's length zeroed.

    Hidden keys get probability 0, but 0 × NaN is NaN: whatever a slot held before (a released
    request, a rejected draft, a poisoned page) must not reach the weighted sum. Copies only when
    some row is shorter than the block; `static` always masks (no value read back to the host).
    """
    stop = start + block.shape[1]
    if not static and not bool((kv_lens < stop).any()):
        return block
    keep = (
        torch.arange(start, stop, device=block.device)[None, :] < kv_lens.to(block.device)[:, None]
    )  # [B, t]
    return torch.where(keep[..., None], block, torch.zeros((), dtype=block.dtype, device=block.device))


def compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype projections and query/value folds run in: the storage dtype, or fp32 on a CPU without
    native 16-bit GEMMs.

    Without AVX512-BF16/AMX, torch's bf16 GEMM on CPU runs a slow generic kernel (under 1 GFLOP/s
    measured on a 2-core AVX2 EPYC); converting a block to fp32 and using the fp32 GEMM is far faster.
    """
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu" and not _cpu_has_fast(dtype):
        return torch.float32
    return dtype


def core_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype the torch attention core (scores, weighted sum) multiplies in: fp32 for a 16-bit
    cache on a CPU, the storage dtype elsewhere.

    torch's 16-bit CPU GEMMs return 16-bit results: scores rounded to 2^-9 of their size before the
    softmax (an lse off by ~1e-3 at DeepSeek-V3 widths). The fused core (`mlakit.ops.cpu_core`) keeps
    bf16 products with fp32 scores; the torch path does the same in fp32.
    """
    if dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu":
        return torch.float32
    return dtype


def context_mask(
    kv_lens: torch.Tensor,
    new: int,
    q_start: int,
    q_stop: int,
    k_start: int,
    k_stop: int,
    device,
    key_mask: torch.Tensor | None = None,
    static: bool = False,
) -> torch.Tensor | None:
    """Bool [B, q, k], True where key k is hidden from query q; None when nothing is hidden.

    Query i of row b sits at position kv_lens[b] - new + i and sees keys 0 .. that position, except
    keys where `key_mask` [B, T] is False (left padding). `static`: always a mask, never a value read
    back to decide (a step's plan fixes the shapes).
    """
    if not static and key_mask is None and new == 1 and bool((kv_lens >= k_stop).all()):
        return None
    lens = kv_lens.to(device)
    if new == 1 and key_mask is None:
        # one query per row, at position kv_lens - 1: a key is hidden past it (5 ops, not 9)
        return (torch.arange(k_start, k_stop, device=device) > (lens - 1)[:, None])[:, None, :]
    query_pos = lens[:, None] - new + torch.arange(q_start, q_stop, device=device)  # [B, q]
    keys = torch.arange(k_start, k_stop, device=device)
    hidden = keys[None, None, :] > query_pos[:, :, None]
    if key_mask is not None:
        hidden = hidden | ~key_mask[:, None, k_start:k_stop].to(device=device, dtype=torch.bool)
    return hidden


def softmax_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim in fp32, and its log-sum-exp; in place when autograd is off.

    Rows with every key hidden (all -inf) give zero probabilities and lse -inf.
    """
    scores = scores.to(acc_dtype(scores.dtype))
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    if torch.is_grad_enabled() and scores.requires_grad:
        probs = torch.exp(scores - peak)
        denom = probs.sum(dim=-1, keepdim=True)
        probs = probs / denom.clamp_min(torch.finfo(scores.dtype).tiny)
    else:
        probs = scores.sub_(peak).exp_()
        denom = probs.sum(dim=-1, keepdim=True)
        probs.div_(denom.clamp_min(torch.finfo(scores.dtype).tiny))
    lse = (peak + torch.log(denom)).squeeze(-1)
    return probs, lse


def query_chunk(rows_per_query: int, keys: int, new: int) -> int:
    """Queries per chunk so that the scores of one chunk stay within SCORE_BUDGET elements."""
    per_query = max(1, rows_per_query * keys)
    return max(1, min(new, SCORE_BUDGET // per_query))

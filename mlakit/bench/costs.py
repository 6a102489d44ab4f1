"""Work per row from mlakit.cost: multiply-adds and bytes of a step, its roofline time, the rates.

Every MLA count is mlakit.cost's, per layer and per sequence, under the causal count (a step of S
new tokens attends within itself too). For a batch of B sequences the matmul work is B times a
sequence's while the weights are read once: bytes(B) = B·bytes(n, t) − (B−1)·bytes(0, 0), the
constant term of each (affine) byte count being its weights.
"""

from __future__ import annotations

from mlakit.config import MLAConfig
from mlakit.cost import (
    MachineProfile,
    compute_dtype,
    keys_seen,
    path_bytes,
    path_terms,
    shared_bytes,
    shared_macs,
    term_times,
)
from mlakit.cost.cache_size import VALUE_BYTES
from mlakit.cost.roofline import FLOPS_PER_MAC
from mlakit.cost.sparse import SPARSE_MODES, indexer_bytes, sparse_absorb_bytes, sparse_path_terms

COUNT = "causal"


def _batched(per_seq: dict, weights: dict, batch: int) -> dict:
    return {k: batch * v - (batch - 1) * weights[k] for k, v in per_seq.items()}


def core_terms(cfg: MLAConfig, path: str, batch: int, new: int, cached: int, dtype: str):
    """(multiply-adds, bytes) per term of one path's attention core for the batch (a sparse path:
    its attention over the selection plus the indexer's terms, `cfg` the DSA config)."""
    if path in SPARSE_MODES:
        return _sparse_core_terms(cfg, path, batch, new, cached, dtype)
    macs = {k: batch * v for k, v in path_terms(cfg, path, new, cached, COUNT).items()}
    nbytes = path_bytes(cfg, path, new, cached, COUNT, dtype)
    return macs, _batched(nbytes, path_bytes(cfg, path, 0, 0, COUNT, dtype), batch)


def _sparse_bytes(cfg: MLAConfig, path: str, new: int, cached: int, dtype: str) -> dict:
    if path == "sparse-absorb":
        attn = sparse_absorb_bytes(cfg, new, cached, COUNT, dtype)
    else:  # the dense masked form reads what dense materialize reads
        attn = path_bytes(cfg.dense(), "materialize", new, cached, COUNT, dtype)
    return {**attn, **indexer_bytes(cfg, new, cached, COUNT, dtype)}


def _sparse_core_terms(cfg: MLAConfig, path: str, batch: int, new: int, cached: int, dtype: str):
    macs = {k: batch * v for k, v in sparse_path_terms(cfg, path, new, cached, COUNT).items()}
    nbytes = _sparse_bytes(cfg, path, new, cached, dtype)
    return macs, _batched(nbytes, _sparse_bytes(cfg, path, 0, 0, dtype), batch)


def projection_terms(cfg: MLAConfig, batch: int, new: int, dtype: str):
    """(multiply-adds, bytes) per projection (q, kv down, o_proj) for the batch."""
    macs = {k: batch * v for k, v in shared_macs(cfg, new).items()}
    return macs, _batched(shared_bytes(cfg, new, dtype), shared_bytes(cfg, 0, dtype), batch)


def kv_terms(cfg: MLAConfig, kv_heads: int, batch: int, new: int, cached: int, dtype: str):
    """(multiply-adds, bytes) of an MHA/GQA/MQA step at head width v_head_dim (mlakit.bench.kv)."""
    d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.v_head_dim
    e = VALUE_BYTES[compute_dtype(dtype)]
    pairs = keys_seen(new, cached, COUNT)
    kv_width = kv_heads * dh
    macs = {
        "q_proj": batch * new * d * h * dh,  # hidden · W_q
        "kv_proj": batch * new * d * 2 * kv_width,  # hidden · [W_k | W_v]
        "scores": batch * pairs * h * dh,  # q · k
        "weighted_sum": batch * pairs * h * dh,  # probs · v
        "o_proj": batch * new * h * dh * d,  # output · W_o
    }
    nbytes = {
        "q_proj": (d * h * dh + batch * new * (d + h * dh)) * e,  # W_q, hidden in, q out
        "kv_proj": (d * 2 * kv_width + batch * new * 2 * kv_width) * e,  # W_k, W_v, new K/V written
        "scores": batch * (cached + new) * kv_width * e,  # cached keys
        "weighted_sum": batch * (cached + new) * kv_width * e,  # cached values
        "o_proj": (h * dh * d + batch * new * (h * dh + d)) * e,  # W_o, in, out
    }
    return macs, nbytes


def row_terms(cfg: MLAConfig, row: dict, dtype: str, path: str | None, kv_heads: int | None):
    """(macs, bytes) per term of a row's whole step; None when the backend's work is not modelled."""
    b, n, t = row["batch"], row["new"], row["cached"]
    if kv_heads is not None:
        return kv_terms(cfg, kv_heads, b, n, t, dtype)
    macs, nbytes = projection_terms(cfg, b, n, dtype)
    if path is None:
        return macs, nbytes
    core_macs, core_bytes = core_terms(cfg, path, b, n, t, dtype)
    return {**macs, **core_macs}, {**nbytes, **core_bytes}


def rates(ms: float, macs: dict, nbytes: dict, machine: MachineProfile | None, dtype: str, prefix="") -> dict:
    """FLOPs, bytes, achieved rates and % of the machine's peaks of work done in `ms` milliseconds."""
    seconds = ms / 1e3
    flops = FLOPS_PER_MAC * sum(macs.values())
    moved = sum(nbytes.values())
    out = {
        prefix + "flops": flops,
        prefix + "bytes": moved,
        prefix + "flop_per_s": flops / seconds,
        prefix + "bytes_per_s": moved / seconds,
    }
    if machine is not None:
        out[prefix + "pct_peak_flops"] = 100 * out[prefix + "flop_per_s"] / machine.matmul_flops(dtype)
        out[prefix + "pct_peak_bandwidth"] = 100 * out[prefix + "bytes_per_s"] / machine.memory_bandwidth
        times = term_times(macs, nbytes, machine, dtype)
        out[prefix + "roofline_ms"] = 1e3 * sum(t["time_s"] for t in times.values())
    return out

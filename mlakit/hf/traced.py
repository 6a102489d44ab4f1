"""What a patched layer runs while torch.compile or torch.export traces it: no value read back to the host.

The eager call turns transformers' 4D mask into row lengths and a key-padding mask (checking that it is
one) and lets the ops size their work from the lengths. A traced call cannot read a mask or a length:
it attends over every key the cache view holds (a StaticCache's `max_cache_len`, a DynamicCache's
current length: static shapes) and applies transformers' mask as it is, so every mask transformers
builds is served exactly as its own attention serves it. The path (absorb or materialize) is picked
from the static sizes when the graph is traced, not per call.
"""

from __future__ import annotations

import torch

from mlakit.config import MLAConfig
from mlakit.cost import crossover
from mlakit.ops.absorb import fold_queries, unfold_values
from mlakit.ops.common import compute_dtype, softmax_lse
from mlakit.ops.materialize import expand
from mlakit.ops.sparse import gather_rows


def is_traced() -> bool:
    """True under torch.compile (dynamo) and torch.export."""
    return torch.compiler.is_compiling()


# memo of `_crossover` (a dict, not functools.cache: dynamo warns on every lru_cache wrapper it meets)
_CROSSOVERS: dict[tuple, float] = {}


@torch.compiler.assume_constant_result
def _crossover(widths: tuple[int, ...], cached: int | None) -> float:
    """New tokens from which materialize wins (inf: never); `cached` None: the long-context limit.

    Evaluated once per traced shape (dynamo calls it instead of tracing the cost model)."""
    key = (widths, cached)
    if key not in _CROSSOVERS:
        _CROSSOVERS[key] = _crossover_of(widths, cached)
    return _CROSSOVERS[key]


def _crossover_of(widths: tuple[int, ...], cached: int | None) -> float:
    heads, latent, nope, rope, value = widths
    cfg = MLAConfig(
        hidden_size=heads,
        num_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=latent,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=value,
    )
    point = crossover(cfg, cached if cached is not None else 1 << 20).exact
    return float("inf") if point is None else float(point)


def traced_mode(cfg: MLAConfig, new, cached: int | None) -> str:
    """`choose`'s answer without tracing the cost model: `cached` a plain int (None: the long-context
    crossover, which it barely moves from). A symbolic `new` (dynamic shapes) is compared with the
    crossover symbolically: the graph is guarded on the side of the crossover it was traced for."""
    widths = (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    return "absorb" if new < _crossover(widths, cached) else "materialize"


def causal_mask(batch: int, new: int, keys: int, kv_len, device) -> torch.Tensor:
    """Bool [B,1,S,T], True where query i (position kv_len - new + i) may see key j; `kv_len` an int or
    a 0-dim tensor (a StaticCache's count after this step's write)."""
    query_pos = kv_len - new + torch.arange(new, device=device)  # [S]
    allowed = torch.arange(keys, device=device)[None, :] <= query_pos[:, None]  # [S, T]
    return allowed.expand(batch, 1, new, keys)


def _masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores with transformers' mask applied as its attention applies it: a bool mask keeps True, a
    float mask is added."""
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(scores.dtype)


def absorb_masked(
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale: float, mask: torch.Tensor, need_weights: bool = False
):
    """Absorb over all T keys: q_nope [B,S,H,dn], q_pe [B,S,H,dr], c_kv [B,T,L], k_pe [B,T,dr],
    mask [b,1,S,T] → out [B,S,H,dv]; with need_weights, (out, probs [B,H,S,T] in q's dtype: the
    weights transformers' eager attention returns)."""
    batch, new, heads, _ = q_nope.shape
    keys = c_kv.shape[1]
    cd = compute_dtype(c_kv.dtype, c_kv.device)
    c, kp = c_kv.to(cd), k_pe.to(cd)
    q_lat = fold_queries(q_nope.to(cd), w_uk.to(cd))  # [B, S, H, L]
    q_l = q_lat.reshape(batch, new * heads, -1) * scale
    q_r = q_pe.to(cd).reshape(batch, new * heads, -1) * scale
    scores = torch.baddbmm(torch.bmm(q_r, kp.transpose(1, 2)), q_l, c.transpose(1, 2))  # [B, S·H, T]
    scores = scores.float().view(batch, new, heads, keys)
    probs, _ = softmax_lse(_masked(scores, mask[:, 0, :, None, :]))  # [B, S, H, T]
    o_lat = torch.bmm(probs.view(batch, new * heads, keys).to(cd), c)  # [B, S·H, L]
    out = unfold_values(o_lat.view(batch, new, heads, -1), w_uv.to(cd)).to(q_nope.dtype)
    return (out, probs.transpose(1, 2).to(q_nope.dtype)) if need_weights else out


def materialize_masked(
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale: float, mask: torch.Tensor, need_weights: bool = False
):
    """Materialize over all T keys (K/V expanded at once, as transformers' own attention holds them);
    same shapes and return as `absorb_masked`."""
    cd = compute_dtype(c_kv.dtype, c_kv.device)
    k, v = expand(c_kv.to(cd), k_pe.to(cd), w_uk.to(cd), w_uv.to(cd))  # [B,H,T,dn+dr], [B,H,T,dv]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2).to(cd)  # [B, H, S, dn+dr]
    scores = torch.matmul(q, k.transpose(2, 3)).float() * scale  # [B, H, S, T]
    probs, _ = softmax_lse(_masked(scores, mask))
    out = torch.matmul(probs.to(cd), v).transpose(1, 2).to(q_nope.dtype)  # [B, S, H, dv]
    return (out, probs.to(q_nope.dtype)) if need_weights else out


def sparse_absorb_masked(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale: float, mask, indices) -> torch.Tensor:
    """Absorb over each query's selected keys only: indices [B,S,k] (distinct positions < T), mask
    [b,1,S,T] read at those positions (bool: keep True; float: added) → out [B,S,H,dv]. The same
    attention as `absorb_masked` under transformers' DSA mask (unselected keys hidden), from k
    gathered latents per query instead of all T."""
    batch, new, heads, _ = q_nope.shape
    k = indices.shape[-1]
    cd = compute_dtype(c_kv.dtype, c_kv.device)
    c_sel = gather_rows(c_kv, indices).to(cd).reshape(batch * new, k, -1)  # [B·S, k, L]
    k_sel = gather_rows(k_pe, indices).to(cd).reshape(batch * new, k, -1)  # [B·S, k, dr]
    q_lat = fold_queries(q_nope.to(cd), w_uk.to(cd))  # [B, S, H, L]
    q_l = q_lat.reshape(batch * new, heads, -1) * scale
    q_r = q_pe.to(cd).reshape(batch * new, heads, -1) * scale
    scores = torch.baddbmm(torch.bmm(q_r, k_sel.transpose(1, 2)), q_l, c_sel.transpose(1, 2))  # [B·S, H, k]
    seen = mask[:, 0].expand(batch, new, mask.shape[-1]).gather(-1, indices)  # [B, S, k]
    scores = _masked(scores.float(), seen.reshape(batch * new, 1, k))
    probs, _ = softmax_lse(scores)
    o_lat = torch.bmm(probs.to(cd), c_sel)  # [B·S, H, L]
    return unfold_values(o_lat.view(batch, new, heads, -1), w_uv.to(cd)).to(q_nope.dtype)

"""DeepSeek Sparse Attention: lightning-indexer scores, top-k selection, attention over the selection.

- `index_scores`: I[t,s] = (H_I·d_I)^-½ Σ_j w[t,j]·ReLU(q_I[t,j]·k_I[s]) over each query's visible
  keys (-inf elsewhere), fp32, read key block by key block;
- `select_topk`: the k highest per query, deterministic under ties, NaN first (docs/sparse.md);
- `index_topk`: both, a block of queries at a time (memory bounded by the score budget);
- `sparse_absorb`: MLA's absorbed attention over the gathered selected latents (576 wide for V3,
  shared by every head; never expanded per head), with the ops' signature plus `indices`;
- `sparse_materialize`: the dense masked form (every visible latent expanded, unselected keys hidden),
  cheaper only for a fresh prefill shorter than its crossover (mlakit.cost.sparse).

`indices` [B,S,k] (long) names context positions; entries < 0, at or past a row's length, after
the query's own position, or hidden by `key_mask` are ignored. A query's indices must be distinct.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlakit.ops.absorb import fold_queries, unfold_values
from mlakit.ops.common import acc_dtype, compute_dtype, query_chunk, softmax_lse
from mlakit.ops.materialize import DEFAULT_WORKSPACE_TOKENS, expand
from mlakit.ops.merge import merge

# cached indexer keys scored per block (4096 × 128 fp32 = 2 MB)
INDEX_KEY_BLOCK = 4096
# score budgets one query block of `index_topk` may take at its peak, measured (tests/test_sparse_ops.py):
# the fp32 scores, their hidden mask, index_scores' dot products and the selection's masks, int32 running
# count and fp32 ranks held ~11x the block's scores; blocks of budget / 8 keep the whole peak ~1.5 budgets
TOPK_WORKING_SET = 8
# gathered latent values per chunk of queries (64 MB in fp32)
GATHER_BUDGET = 1 << 24

# gather(rows [B,s,k] long, clamped >= 0) -> (c_kv [B,s,k,L], k_pe [B,s,k,dr]) of those positions
Gather = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def query_positions(kv_lens: torch.Tensor, new: int, device) -> torch.Tensor:
    """[B, S]: query i of row b sits at kv_lens[b] - new + i."""
    return kv_lens.to(device)[:, None] - new + torch.arange(new, device=device)


def index_scores(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    k_idx: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    key_mask: torch.Tensor | None = None,
    max_keys: int | None = None,
) -> torch.Tensor:
    """q_idx [B,S,H_I,d_I], weights [B,S,H_I], k_idx [B,T,d_I] → scores [B,S,T'] fp32, -inf where a key
    is not visible to the query (causal, past the row's length, or key_mask False). T' = max_keys (a
    plan's bucket: no host read) or max(kv_lens)."""
    batch, new, heads, dim = q_idx.shape
    keys = int(kv_lens.max()) if max_keys is None else max_keys
    cd = compute_dtype(k_idx.dtype, k_idx.device)
    acc = acc_dtype(cd)
    # queries as the right operand [B, d_I, S·H_I]: keys·queries runs BLAS's plain (fast) layout
    q_t = q_idx.to(cd).permute(0, 3, 1, 2).reshape(batch, dim, new * heads)
    w = weights.to(acc) * (heads * dim) ** -0.5  # [B, S, H_I]
    out = torch.empty(batch, new, keys, dtype=acc, device=q_idx.device)
    block = min(keys, INDEX_KEY_BLOCK)
    step = query_chunk(batch * heads, block, new)  # bounds the [B, t, s·H_I] dot products
    # one reused conversion buffer: a fresh tensor per block costs page faults (see ops/absorb.py)
    buf = None if k_idx.dtype == cd else torch.empty(batch, block, dim, dtype=cd, device=k_idx.device)
    for k0 in range(0, keys, block):
        k1 = min(keys, k0 + block)
        k_blk = k_idx[:, k0:k1] if buf is None else buf[:, : k1 - k0].copy_(k_idx[:, k0:k1])
        for s0 in range(0, new, step):
            s1 = min(new, s0 + step)
            dots = torch.bmm(k_blk, q_t[:, :, s0 * heads : s1 * heads]).relu_()  # [B, t, s·H_I]
            dots = dots.to(acc).view(batch, k1 - k0, s1 - s0, heads)
            out[:, s0:s1, k0:k1] = torch.einsum("btsh,bsh->bst", dots, w[:, s0:s1])
    hidden = _hidden_keys(kv_lens, new, keys, q_idx.device, key_mask)  # [B, S, T']
    return out.masked_fill_(hidden, float("-inf"))


def _hidden_keys(kv_lens, new: int, keys: int, device, key_mask=None) -> torch.Tensor:
    pos = query_positions(kv_lens, new, device)
    hidden = torch.arange(keys, device=device)[None, None, :] > pos[:, :, None]  # [B, S, T]
    if key_mask is not None:
        hidden = hidden | ~key_mask[:, None, :keys].to(device=device, dtype=torch.bool)
    return hidden


def index_topk(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    k_idx: torch.Tensor,
    kv_lens: torch.Tensor,
    k: int,
    *,
    key_mask: torch.Tensor | None = None,
    max_keys: int | None = None,
) -> torch.Tensor:
    """`select_topk(index_scores(...), k)` a block of queries at a time: the scores of one block stay
    within the attention's SCORE_BUDGET elements, so memory is bounded by the budget, not by S × T (a
    128K-token prefill would otherwise hold a [S, T] fp32 matrix: 64 GB). Same indices [B,S,min(k,T)]."""
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"k (index_topk) must be a positive integer, got {k!r}")
    batch, new = q_idx.shape[:2]
    keys = int(kv_lens.max()) if max_keys is None else max_keys
    # a block holds its fp32 scores and the selection's working set beside them (TOPK_WORKING_SET)
    step = query_chunk(batch * TOPK_WORKING_SET, keys, new)
    if step >= new:
        scores = index_scores(q_idx, weights, k_idx, kv_lens, key_mask=key_mask, max_keys=keys)
        return _select_topk(scores, k)
    out = torch.empty(batch, new, min(k, keys), dtype=torch.long, device=q_idx.device)
    for s0 in range(0, new, step):
        s1 = min(new, s0 + step)
        # the block's queries are the last of a context (new - s1) tokens shorter
        lens = kv_lens - (new - s1)
        scores = index_scores(
            q_idx[:, s0:s1], weights[:, s0:s1], k_idx, lens, key_mask=key_mask, max_keys=keys
        )
        out[:, s0:s1] = _select_topk(scores, k)
        del scores
    return out


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B,S,T] → indices [B,S,min(k,T)] (long, ascending; a hidden position picked to fill k reads -1).

    Tie rule: the keys above the k-th highest score are all kept, and of the keys equal to it the
    lowest positions fill the remaining places. So the selected set is a function of the scores alone.
    A NaN score ranks above every number (+inf): a key poisoned by a NaN is selected, so the NaN reaches
    the attention output, as it does in dense MLA (docs/sparse.md).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"k (index_topk) must be a positive integer, got {k!r}")
    return _select_topk(scores.clone(), k)


def _select_topk(ranked: torch.Tensor, k: int) -> torch.Tensor:
    """`select_topk` on scores it may overwrite: beside them it holds about 7 bytes per score at once
    (two bool masks, an int32 running count) and then one more score-sized fp32 array."""
    keys = ranked.shape[-1]
    k = min(k, keys)
    ranked = ranked.nan_to_num_(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))  # -inf kept
    kth = ranked.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # [B, S, 1]
    above = ranked > kth
    need = k - above.sum(dim=-1, keepdim=True)
    tie = ranked == kth
    keep = tie.cumsum(dim=-1, dtype=torch.int32) <= need
    keep = keep.logical_and_(tie).logical_or_(above)  # exactly k per query
    del tie, above
    # the kept positions, ascending: the k largest of keys - position (distinct, exact in fp32)
    rank = torch.arange(keys, 0, -1, device=ranked.device, dtype=torch.float32)
    idx = torch.where(keep, rank, 0).topk(k, dim=-1).indices  # no host read, no data-dependent shape
    return idx.masked_fill(torch.isneginf(ranked.gather(-1, idx)), -1)


def selection_hidden(
    indices: torch.Tensor, kv_lens: torch.Tensor, new: int, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool [B,S,k], True where an index names no key the query may see."""
    pos = query_positions(kv_lens, new, indices.device)  # [B, S]
    hidden = (indices < 0) | (indices > pos[:, :, None])
    if key_mask is not None:
        seen = key_mask.to(device=indices.device, dtype=torch.bool)
        hidden = hidden | ~seen.gather(1, indices.clamp(0, seen.shape[1] - 1).flatten(1)).view_as(indices)
    return hidden


def check_indices(indices: torch.Tensor, q_nope: torch.Tensor) -> None:
    batch, new = q_nope.shape[:2]
    shaped = isinstance(indices, torch.Tensor) and indices.dim() == 3
    if not shaped or tuple(indices.shape[:2]) != (batch, new):
        shape = tuple(getattr(indices, "shape", ()))
        raise ValueError(f"indices must be [B={batch}, S={new}, k], got shape {shape}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"indices must be integers, got dtype {indices.dtype}")


def sparse_absorb(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    *,
    indices: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorb (see `mlakit.ops`) over only the selected keys of each query."""
    check_indices(indices, q_nope)

    def gather(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_rows(c_kv, rows), gather_rows(k_pe, rows)

    return sparse_absorb_gathered(q_nope, q_pe, gather, kv_lens, w_uk, w_uv, scale, indices, key_mask)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B,T,W] (any strides), rows [B,s,k] (0 <= rows < T) → [B,s,k,W]."""
    batch, new, k = rows.shape
    rows = rows.to(x.device).reshape(batch, new * k)
    if batch == 1 or x.stride(0) == x.shape[1] * x.stride(1):
        # one index_select over the rows seen as one table (5x faster than advanced indexing)
        flat = (rows + torch.arange(batch, device=x.device)[:, None] * x.shape[1]).flatten()
        table = x[0] if batch == 1 else x.reshape(batch * x.shape[1], -1)
        return table.index_select(0, flat).view(batch, new, k, -1)
    return x[torch.arange(batch, device=x.device)[:, None], rows].view(batch, new, k, -1)


def sparse_absorb_gathered(
    q_nope, q_pe, gather: Gather, kv_lens, w_uk, w_uv, scale, indices, key_mask=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse absorb with the context given as a gather of positions (a cache view or pages)."""
    batch, new, heads, _ = q_nope.shape
    hidden = selection_hidden(indices, kv_lens, new, key_mask)  # [B, S, k]
    rows = indices.clamp_min(0)
    cd = compute_dtype(q_nope.dtype, q_nope.device)
    q_lat = fold_queries(q_nope.to(cd), w_uk.to(cd))  # [B, S, H, L]
    width = w_uk.shape[-1] + q_pe.shape[-1]
    step = max(1, min(new, GATHER_BUDGET // max(1, batch * indices.shape[-1] * width)))
    outs, lses = [], []
    for s0 in range(0, new, step):
        s1 = min(new, s0 + step)
        c_sel, k_sel = gather(rows[:, s0:s1])  # [B, s, k, L], [B, s, k, dr]
        o, lse = _selected_attention(
            q_lat[:, s0:s1], q_pe[:, s0:s1].to(cd), c_sel.to(cd), k_sel.to(cd), hidden[:, s0:s1], scale
        )
        outs.append(o)
        lses.append(lse)
    o_lat = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=1) if len(lses) > 1 else lses[0]
    return unfold_values(o_lat.to(cd), w_uv.to(cd)).to(q_nope.dtype), lse


def _selected_attention(q_lat, q_pe, c_sel, k_sel, hidden, scale):
    """Each query against its own k gathered latents: (o_lat [B,s,H,L] fp32, lse [B,s,H]). c_sel and
    k_sel are overwritten (fresh gathers)."""
    batch, new, heads, latent = q_lat.shape
    k = c_sel.shape[2]
    # NaN-safe: a hidden row gets probability 0, but 0 · NaN is NaN (in place: gathers are fresh tensors)
    c_sel, k_sel = c_sel.masked_fill_(hidden[..., None], 0), k_sel.masked_fill_(hidden[..., None], 0)
    c = c_sel.reshape(batch * new, k, latent)
    kp = k_sel.reshape(batch * new, k, -1)
    q_l = q_lat.reshape(batch * new, heads, latent) * scale
    q_r = q_pe.reshape(batch * new, heads, -1) * scale
    scores = torch.baddbmm(torch.bmm(q_r, kp.transpose(1, 2)), q_l, c.transpose(1, 2))  # [B·s, H, k]
    scores = scores.to(acc_dtype(scores.dtype)).masked_fill_(hidden.view(batch * new, 1, k), float("-inf"))
    probs, lse = softmax_lse(scores)
    o_lat = torch.bmm(probs.to(c.dtype), c).to(probs.dtype)  # [B·s, H, L]
    return o_lat.view(batch, new, heads, latent), lse.view(batch, new, heads)


def sparse_materialize(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    *,
    indices: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
    max_keys: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every visible latent expanded to per-head K/V (`workspace_tokens` keys at a time), the
    unselected keys hidden per query: the same function as `sparse_absorb`. `max_keys`: a plan's
    bucket (else max(kv_lens), a host read)."""
    check_indices(indices, q_nope)
    if workspace_tokens <= 0:
        raise ValueError(f"workspace_tokens must be > 0, got {workspace_tokens}")
    batch, new = q_nope.shape[:2]
    keys = int(kv_lens.max()) if max_keys is None else max_keys
    hidden = selection_hidden(indices, kv_lens, new, key_mask)
    cd = compute_dtype(c_kv.dtype, c_kv.device)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2).to(cd)  # [B, H, S, dn+dr]
    out = lse = None
    for k0 in range(0, keys, workspace_tokens):
        k1 = min(keys, k0 + workspace_tokens)
        seen = _selected_block(indices, hidden, k0, k1)  # [B, S, t]: never the whole [B, S, T]
        unseen = ~seen.any(dim=1)[..., None]  # [B, t, 1]: NaN-safe, as in absorb
        c, kp = (x[:, k0:k1].to(cd).masked_fill(unseen, 0) for x in (c_kv, k_pe))
        k, v = expand(c, kp, w_uk.to(cd), w_uv.to(cd))  # [B, H, t, dn+dr], [B, H, t, dv]
        part, part_lse = _masked_attention(q, k, v, ~seen, scale)
        out, lse = (part, part_lse) if out is None else merge([out, part], [lse, part_lse])
    return out.to(q_nope.dtype), lse


def _selected_block(indices: torch.Tensor, hidden: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    """Bool [B, S, k1 - k0]: which keys k0..k1-1 each query selected (ignored entries land in a spare
    column, dropped)."""
    batch, new, _ = indices.shape
    width = k1 - k0
    out = torch.zeros(batch, new, width + 1, dtype=torch.bool, device=indices.device)
    inside = ~hidden & (indices >= k0) & (indices < k1)
    out.scatter_(-1, torch.where(inside, indices - k0, width), True)
    return out[..., :width]


def _masked_attention(q, k, v, hidden, scale):
    """q [B,H,S,·] against k, v [B,H,t,·] with hidden [B,S,t]: (out [B,S,H,dv] fp32, lse [B,S,H])."""
    batch, heads, new, _ = q.shape
    outs, lses = [], []
    step = query_chunk(batch * heads, k.shape[2], new)
    for s0 in range(0, new, step):
        s1 = min(new, s0 + step)
        scores = torch.matmul(q[:, :, s0:s1], k.transpose(2, 3)).to(acc_dtype(q.dtype)).mul_(scale)
        probs, lse = softmax_lse(scores.masked_fill_(hidden[:, None, s0:s1], float("-inf")))
        outs.append(torch.matmul(probs.to(v.dtype), v).to(probs.dtype).transpose(1, 2))  # [B, s, H, dv]
        lses.append(lse.transpose(1, 2))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)

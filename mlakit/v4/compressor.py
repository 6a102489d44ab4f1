"""The compressors (CSA / HCA) and CSA's lightning indexer, with transformers' parameter names.

A compressor projects every token to kv and gate (coff·d wide: CSA's two series Ca | Cb), pools each
completed group of m tokens into one entry with a softmax over the gate plus a per-slot position bias,
normalizes it and rotates its tail at the entry's position w·m. CSA's entry w pools 2m tokens: the Ca
half of group w−1 and the Cb half of group w (overlapping windows of stride m).
"""

from __future__ import annotations

import torch
from torch import nn

from mlakit.ops.sparse import select_topk
from mlakit.v4.plan import CompressPlan
from mlakit.v4.rope import cos_sin, rotate_tail


class RMSNorm(nn.Module):
    """x / rms(x) · weight in fp32 (fp64 for fp64), cast back to x's dtype."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = x.to(work)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(work) * y).to(x.dtype)


class Compressor(nn.Module):
    def __init__(self, hidden: int, width: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.width, self.ratio, self.coff = width, ratio, 2 if overlap else 1
        self.kv_proj = nn.Linear(hidden, self.coff * width, bias=False)
        self.gate_proj = nn.Linear(hidden, self.coff * width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, self.coff * width))
        self.kv_norm = RMSNorm(width, eps)

    def update(self, hidden: torch.Tensor, cp: CompressPlan, st: dict, prefix: str, freqs) -> None:
        """Pool the entries this step completes into the store and carry the new tokens' projections."""
        b, s, _ = hidden.shape
        kv = self.kv_proj(hidden)  # [B,S,coff·d]
        work = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        gate = self.gate_proj(hidden).to(work) + self.position_bias.to(work)[cp.bias_idx]  # [B,S,coff·d]
        ring_kv, ring_gate, store = st[prefix + "ring_kv"], st[prefix + "ring_gate"], st[prefix + "store"]
        if cp.num_entries:
            src_kv = torch.cat([ring_kv[cp.ring_rows], kv.to(ring_kv.dtype)], dim=1)
            src_gate = torch.cat([ring_gate[cp.ring_rows], gate], dim=1)
            entries = self._pool(src_kv, src_gate, cp, freqs)  # [B,E,d]
            store.index_copy_(0, cp.entry_write, entries.reshape(-1, self.width).to(store.dtype))
        ring_kv.index_copy_(0, cp.ring_write, kv.reshape(b * s, -1).to(ring_kv.dtype))
        ring_gate.index_copy_(0, cp.ring_write, gate.reshape(b * s, -1))

    def _pool(self, src_kv, src_gate, cp: CompressPlan, freqs) -> torch.Tensor:
        b, m, d = src_kv.shape[0], self.ratio, self.width
        idx = cp.src[..., None]
        kv = src_kv.gather(1, idx.expand(-1, -1, src_kv.shape[-1])).view(b, -1, self.coff * m, self.coff * d)
        gate = src_gate.gather(1, idx.expand(-1, -1, src_gate.shape[-1])).view(
            b, -1, self.coff * m, self.coff * d
        )
        if self.coff == 2:
            # slots 0..m−1: group w−1's Ca half; slots m..2m−1: group w's Cb half
            kv = torch.cat([kv[:, :, :m, :d], kv[:, :, m:, d:]], dim=2)
            gate = torch.cat([gate[:, :, :m, :d], gate[:, :, m:, d:]], dim=2)
        gate = gate.masked_fill(~cp.src_valid[..., None], float("-inf"))
        weights = gate.softmax(dim=2).to(kv.dtype)
        pooled = self.kv_norm((kv * weights).sum(dim=2))  # [B,E,d]
        cos, sin = cos_sin(
            freqs, cp.entry_pos, torch.float64 if pooled.dtype == torch.float64 else torch.float32
        )
        return rotate_tail(pooled, cos, sin)


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """CSA's lightning indexer: a compressor of its own at index_head_dim, and queries from the q latent.

    score(t, w) = Σ_h weight_h(t)·H_I^-1/2 · relu(q_h(t) · k_w)·d_I^-1/2 over the entries t sees; the
    top `index_topk` are attended to (all of them while there are no more than index_topk)."""

    def __init__(
        self, hidden: int, q_lora_rank: int, heads: int, width: int, ratio: int, topk: int, eps: float
    ):
        super().__init__(hidden, width, ratio, True, eps)
        self.heads, self.topk = heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, heads * width, bias=False)
        self.scorer = IndexerScorer(hidden, heads)

    def scores(self, hidden, q_residual, keys, cos, sin, visible) -> torch.Tensor:
        """[B,S,N] indexer scores, −inf where the query does not see the entry."""
        b, s, _ = hidden.shape
        work = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        q = rotate_tail(
            self.q_b_proj(q_residual).view(b, s, self.heads, self.width), cos[:, :, None], sin[:, :, None]
        )
        dots = torch.einsum("bshd,bnd->bshn", q.to(work), keys.to(work)).relu() * self.width**-0.5
        weights = self.scorer.weights_proj(hidden).to(work) * self.heads**-0.5  # [B,S,H_I]
        scores = torch.einsum("bshn,bsh->bsn", dots, weights)
        return scores.masked_fill(~visible, float("-inf"))

    def forward(
        self, hidden, q_residual, keys, cos, sin, visible
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(indices [B,S,k], valid [B,S,k]) of the selected entries, or (None, visible [B,S,N]) when a
        query may select every entry it sees (N <= index_topk: no scoring needed)."""
        n = keys.shape[1]
        if n <= self.topk:
            return None, visible
        scores = self.scores(hidden, q_residual, keys, cos, sin, visible)
        idx = select_topk(scores, self.topk)  # DSA's tie rule: equal scores, lowest positions first
        return idx.clamp(min=0), idx >= 0

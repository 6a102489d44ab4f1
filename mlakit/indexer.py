"""Indexer: DeepSeek Sparse Attention's lightning indexer, with transformers' submodule names.

`wq_b` reads MLA's normalized query latent; `wk` + `k_norm` (a LayerNorm with bias, eps 1e-6) give
one d_I-wide key per token shared by every indexer head (what the cache keeps); `weights_proj` gives
each query's per-head weights, in fp32. The first qk_rope_head_dim dims of every indexer head are
rotated with MLA's frequencies and positions, in the model's own layout (half-split for DeepSeek-V3.2,
interleaved for GLM-5); the output is in half-split order (see mlakit.rope), for queries and keys alike.
The scores and the selection are `mlakit.ops.sparse`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from mlakit.config import MLAConfig
from mlakit.linear import Linear
from mlakit.rope import apply_rope

# transformers' DeepseekV32Indexer / GlmMoeDsaIndexer build k_norm with this eps
K_NORM_EPS = 1e-6


class Indexer(nn.Module):
    """`forward(hidden [B,S,D], q_resid [B,S,q_lora], cos, sin [B,S,dr/2])` →
    (q_idx [B,S,H_I,d_I], weights [B,S,H_I] fp32, k_idx [B,S,d_I])."""

    def __init__(self, cfg: MLAConfig, *, device=None, dtype=None):
        super().__init__()
        if not cfg.is_sparse:
            raise ValueError("cfg has no indexer (index_topk is None): an Indexer needs a DSA config")
        self.cfg = cfg
        f = {"device": device, "dtype": dtype}
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, heads * dim, bias=False, **f)
        self.wk = Linear(cfg.hidden_size, dim, bias=False, **f)
        self.k_norm = nn.LayerNorm(dim, eps=K_NORM_EPS, **f)
        # fp32 whatever the layer dtype (transformers keeps indexer.weights_proj in fp32 too)
        self.weights_proj = nn.Linear(cfg.hidden_size, heads, bias=False, device=device, dtype=torch.float32)

    def forward(
        self, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.queries(q_resid, cos, sin), self.weights(hidden), self.keys(hidden, cos, sin)

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, new, _ = q_resid.shape
        q = self.wq_b(q_resid).view(batch, new, self.cfg.index_n_heads, self.cfg.index_head_dim)
        return self.rotate(q, cos[:, :, None], sin[:, :, None])  # [B, S, H_I, d_I]

    def keys(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.rotate(self.k_norm(self.wk(hidden)), cos, sin)  # [B, S, d_I]

    def weights(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.weights_proj(hidden.to(torch.float32))  # [B, S, H_I]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope on the first qk_rope_head_dim dims (layout [pe | nope], the reverse of MLA's)."""
        dr = self.cfg.qk_rope_head_dim
        pe = apply_rope(x[..., :dr], cos, sin, self.cfg.indexer_rope_interleave)
        return torch.cat([pe, x[..., dr:]], dim=-1)

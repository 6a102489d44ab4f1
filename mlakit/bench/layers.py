"""The MLA layer the bench times, and the straightforward einsum absorb baseline.

`BenchLayer` is `MLAAttention` whose attention op can be swapped for one call (`using(op)`): the
einsum baseline, the reference and the test's deliberately wrong op then run inside the very same
projections, cache write and o_proj as mlakit's own paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from mlakit.attention import MLAAttention

Op = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class BenchLayer(MLAAttention):
    op: Op | None = None

    @contextmanager
    def using(self, op: Op) -> Iterator[BenchLayer]:
        """Run `op` (the signature of `mlakit.ops`) instead of the chosen path inside this block."""
        self.op = op
        try:
            yield self
        finally:
            self.op = None

    def _attend_group(self, plan, g, layer, q_nope, q_pe, index_q=None):
        if self.op is None:
            return super()._attend_group(plan, g, layer, q_nope, q_pe, index_q)
        w_uk, w_uv = self.up_weights()
        c_kv, k_pe = plan.context.keys(layer, g)
        return self.op(q_nope, q_pe, c_kv, k_pe, g.kv_lens, w_uk, w_uv, self.scale)[0]


def einsum_absorb(q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, scale):
    """Absorb as reference inference code writes it: one einsum per product, the full score tensor,
    softmax in fp32 and cast back. The baseline an optimized absorb has to beat. Returns (out, None)."""
    batch, new = q_nope.shape[:2]
    keys = int(kv_lens.max())
    # everything in the weights' dtype: the compute dtype the layer hands its ops (fp32 for bf16 on a
    # CPU without bf16 GEMMs), so the baseline differs from mlakit's absorb in method, not in kernels
    cd, out_dtype = w_uk.dtype, q_nope.dtype
    q_nope, q_pe = q_nope.to(cd), q_pe.to(cd)
    c_kv, k_pe = c_kv[:, :keys].to(cd), k_pe[:, :keys].to(cd)
    q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)
    scores = torch.einsum("bshc,btc->bsht", q_lat, c_kv) + torch.einsum("bshr,btr->bsht", q_pe, k_pe)
    scores = scores * scale  # [B, S, H, T]
    if new > 1 or bool((kv_lens < keys).any()):
        query_pos = kv_lens[:, None] - new + torch.arange(new)  # [B, S]
        hidden = torch.arange(keys)[None, None, :] > query_pos[:, :, None]  # [B, S, T]
        scores = scores.masked_fill(hidden.to(scores.device)[:, :, None, :], float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q_nope)
    o_lat = torch.einsum("bsht,btc->bshc", probs, c_kv)
    return torch.einsum("bshc,hdc->bshd", o_lat, w_uv).to(out_dtype), None

"""An attention layer of the engine's commonest step with the general path's per-call decisions taken
once: every row a decode row (one absorb group over the paged bf16 cache, read in place by the fused
CPU core) and the layer's kv_b_proj packed for the folds. The layer's own projections
(`project_unrotated`), then the ops the general path (`MLAAttention._compute` through `absorb_chunked`)
ends in, on the same tensors in the same order, so the same bits (tests/test_engine_loop.py), without
that path's choices a few Python calls deep: which core, which fold, whether a tensor needs converting.
The decoder loop (mlakit/engine/loop.py) asks `absorb_in_place` first and runs the general path where it
says None.
"""

from __future__ import annotations

import torch

from mlakit.attention import MLAAttention, project_unrotated
from mlakit.linear import call
from mlakit.ops import cpu_core
from mlakit.rope import apply_tables


def plan_fits(plan) -> bool:
    """Whether every row of the plan decodes in one absorb group over pages the fused core reads in
    place, with rope from tables (a host fact of the plan, the same for every layer)."""
    groups = plan.groups
    if len(groups) != 1 or groups[0].path != "absorb" or plan.rotation is not None:
        return False
    ctx = plan.context
    return (
        getattr(ctx, "layer_pages", None) is not None
        and getattr(ctx, "layout", None) is not None
        and ctx.layout.quant is None
        and ctx.device.type == "cpu"
        and groups[0].new == 1
    )


def absorb_in_place(mla: MLAAttention, x: torch.Tensor, plan) -> torch.Tensor | None:
    """The layer's output [N, D] for the packed decode rows x [N, D] of a plan `plan_fits` took, or None
    where the layer or x is not of that form (the caller runs the general path)."""
    packs = mla.up_packs()
    if (
        packs is None
        or mla.indexer is not None
        or mla.absorb_backend not in ("auto", "torch")
        or x.dtype != torch.bfloat16
        or x.dim() != 2
    ):
        return None
    g, layer = plan.groups[0], mla.layer_idx
    ctx = plan.context
    latent, rope = ctx._fields(layer)
    lens = g.kv_lens
    if (
        latent.dtype != torch.bfloat16  # the bf16 core's op below (an fp32 cache has a core of its own)
        or cpu_core.fits(x, latent, rope) is not None
        or not cpu_core.available(latent.dtype)
        or lens.dtype != torch.long
        or not lens.is_contiguous()
    ):
        return None
    plan.claim(layer, mla)  # as MLAAttention.run does, before anything is written
    q_nope, q_pe, c_kv, k_pe = project_unrotated(mla, mla.cfg, x)  # [N, H, dn], [N, H, dr], [N, L], [N, dr]
    q_pe = apply_tables(q_pe, plan.rope_q)
    ctx.write(plan, layer, c_kv, apply_tables(k_pe, plan.rope_k))
    q_lat = packs.fold.mm(q_nope)  # [N, H, L]
    rows = g.read_rows[:, : g.key_len]
    splits = cpu_core.default_splits(x.shape[0], rows.shape[1])
    op = torch.ops.mlakit_cpu.latent_decode
    o_lat, _ = op(q_lat, q_pe, latent, rope, rows, lens, 1, 0, mla.scale, splits)  # [N, H, L] fp32
    out = packs.unfold.mm(o_lat.to(torch.bfloat16))  # [N, H, dv]
    return call(mla._modules["o_proj"], out.reshape(x.shape[0], -1))

"""An attention layer of the engine's commonest step in a dozen op calls: every row a decode row (one
absorb group over the paged bf16 cache, read in place by the fused CPU core), the layer's projections
on mlakit's packed bf16 weights, its norms on the one-pass op. The same ops as the layer's general path
(`MLAAttention._compute` through `absorb_chunked`) on the same tensors in the same order, so the same
bits (tests/test_engine_loop.py), without that path's per-call decisions, each a few Python calls deep:
which core, which rope form, which fold, which product, whether a tensor needs converting. The decoder
loop (mlakit/engine/loop.py) asks `absorb_in_place` first and runs the general path where it says None.
"""

from __future__ import annotations

import torch

from mlakit.attention import MLAAttention, RMSNorm, _fused_norm
from mlakit.engine.packed import PackedLinear
from mlakit.ops import cpu_core
from mlakit.ops.vnni import VnniWeight
from mlakit.rope import apply_tables

PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
NORMS = ("q_a_layernorm", "kv_a_layernorm")


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
    mods = mla._modules
    weights = [_vnni(mods.get(name)) for name in PROJECTIONS]
    norms = [mods.get(name) for name in NORMS]
    packs = mla.up_packs()
    if (
        None in weights
        or packs is None
        or mla.indexer is not None
        or mla.absorb_backend not in ("auto", "torch")
        or x.dtype != torch.bfloat16
        or x.dim() != 2
        or x.stride(-1) != 1
        or not all(type(n) is RMSNorm and _fused_norm(x, n.weight) for n in norms)
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
    q_a, q_b, kv_a, o_proj = weights
    cfg, n = mla.cfg, x.shape[0]
    dn, width = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    ops = torch.ops.mlakit_cpu
    q = _mm(_norm(_mm(x, q_a), norms[0]), q_b).view(n, cfg.num_heads, -1)  # [N, H, dn + dr]
    kv = _mm(x, kv_a)  # [N, L + dr]
    q_pe = apply_tables(q[..., dn:], plan.rope_q)
    k_pe = apply_tables(kv[:, width:], plan.rope_k)
    ctx.write(plan, layer, _norm(kv[:, :width], norms[1]), k_pe)
    q_lat = packs.fold.mm(q[..., :dn])  # [N, H, L]
    rows = g.read_rows[:, : g.key_len]
    splits = cpu_core.default_splits(n, rows.shape[1])
    o_lat, _ = ops.latent_decode(q_lat, q_pe, latent, rope, rows, lens, 1, 0, mla.scale, splits)
    out = packs.unfold.mm(o_lat.to(torch.bfloat16))  # [N, H, dv]
    return _mm(out.view(n, -1), o_proj)


def _vnni(m) -> VnniWeight | None:
    """The packed weight of a bias-free PackedLinear in mlakit's layout, no fp32 route; else None."""
    if type(m) is not PackedLinear or m.bias is not None or m.upcast is not None:
        return None
    w = m.packed
    return w if type(w) is VnniWeight else None


def _mm(x: torch.Tensor, w: VnniWeight) -> torch.Tensor:
    if x.stride(-1) != 1 or x.stride(0) % 2 or w.in_features % 2:
        return w.mm(x)
    return torch.ops.mlakit_cpu.vnni_linear(x, w.packed, w.out_features, None)


def _norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return torch.ops.mlakit_cpu.rms_norm(x if x.stride(-1) == 1 else x.contiguous(), norm.weight, norm.eps)

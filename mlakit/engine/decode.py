"""An attention layer of the engine's commonest step with the general path's per-call decisions taken
once: every row a decode row (one absorb group over the paged bf16 cache, read in place by the fused
CPU core) and the layer's kv_b_proj packed for the folds. The layer's own projections
(`project_unrotated`), then the ops the general path (`MLAAttention._compute` through `absorb_chunked`)
ends in, on the same tensors in the same order, so the same bits (tests/test_engine_loop.py), without
that path's choices a few Python calls deep: which core, which fold, whether a tensor needs converting.
The decoder loop (mlakit/engine/loop.py) asks `absorb_in_place` first and runs the general path where it
says None.

`fused_layer` goes one step further for layers whose projections are all packed bf16 weights and whose
norms are mlakit's RMSNorm (the engine's own bf16 models on a CPU with AVX512-BF16 and no AMX): the
input norm, the attention and the residual add and the MLP's norm as one call of csrc/decode_layer.cpp
(the same kernels again, called from C++: no Python frame or tensor wrapper between the ~25 ops of a
layer), asked before `absorb_in_place`; and `fused_moe` runs the MoE block after it (its router's small
ops and the experts) and the residual add as another.
"""

from __future__ import annotations

import torch

from mlakit.attention import MLAAttention, RMSNorm, project_unrotated
from mlakit.engine.moe import GroupedMoE, short_route
from mlakit.engine.packed import PackedLinear
from mlakit.linear import call
from mlakit.ops import cpu_core
from mlakit.ops.vnni import VnniWeight
from mlakit.rope import apply_tables

# the projections and norms the fused layer runs (their forwards, hooks and all, are bypassed)
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


def _in_place(mla: MLAAttention, x: torch.Tensor, plan) -> tuple | None:
    """(kv_b_proj's packs, the layer's latent and rope pools) where its decode attention over the rows
    x [N, D] of a plan `plan_fits` took runs on the bf16 core reading the pages in place: kv_b_proj
    packed for the folds, no DSA indexer, the torch absorb backend, bf16 rows and cache; None else."""
    packs = mla.up_packs()
    if (
        packs is None
        or mla.indexer is not None
        or mla.absorb_backend not in ("auto", "torch")
        or x.dtype != torch.bfloat16
        or x.dim() != 2
    ):
        return None
    latent, rope = plan.context._fields(mla.layer_idx)
    if (
        latent.dtype != torch.bfloat16  # the bf16 core's op (an fp32 cache has a core of its own)
        or cpu_core.fits(x, latent, rope) is not None
        or not cpu_core.available(latent.dtype)
    ):
        return None
    return packs, latent, rope


def absorb_in_place(mla: MLAAttention, x: torch.Tensor, plan) -> torch.Tensor | None:
    """The layer's output [N, D] for the packed decode rows x [N, D] of a plan `plan_fits` took, or None
    where the layer or x is not of that form (the caller runs the general path)."""
    found = _in_place(mla, x, plan)
    g, layer, ctx = plan.groups[0], mla.layer_idx, plan.context
    lens = g.kv_lens
    if found is None or lens.dtype != torch.long or not lens.is_contiguous():
        return None
    packs, latent, rope = found
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


def step_args(plan, rows: int) -> tuple | None:
    """What every fused layer of a step `plan_fits` took shares: the rope tables as [N, dr] rows, the
    rows to write, each sequence's rows to read, kv_lens and the core's splits; None where the step is
    not of `fused_layer`'s form (its layers then run op by op)."""
    if torch.is_grad_enabled() or not cpu_core.available(torch.bfloat16):
        return None  # (mlakit's RMSNorm keeps torch's arithmetic where autograd may record)
    tq, tk, g = plan.rope_q, plan.rope_k, plan.groups[0]
    if tq is None or tk is None or tq.layout not in ("interleave", "half") or tk.layout != tq.layout:
        return None
    dr = tq.cos.shape[-1]
    tables = (tq.cos, tq.sin, tk.cos, tk.sin)
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tables):
        return None
    if tq.cos.shape != (rows, 1, dr) or tq.sin.shape != (rows, 1, dr) or tk.cos.shape != (rows, dr):
        return None
    if tk.sin.shape != (rows, dr) or dr % 32:
        return None
    slots, lens = plan.slot_mapping, g.kv_lens
    for t in (slots, lens):
        if t.dtype != torch.long or not t.is_contiguous() or t.shape != (rows,):
            return None
    read = g.read_rows[:, : g.key_len]
    if read.dtype != torch.long or read.stride(1) != 1:
        return None
    splits = cpu_core.default_splits(rows, read.shape[1])
    cos_q, sin_q = tq.cos.view(rows, dr), tq.sin.view(rows, dr)
    return cos_q, sin_q, tk.cos, tk.sin, tq.layout == "interleave", read, lens, splits


def fused_layer(mla: MLAAttention, norm_in, norm_post, h: torch.Tensor, plan, step: tuple):
    """(h + attention(norm_in(h)), norm_post(that)) for the decode rows h [N, D] of a plan `plan_fits`
    took (`step`: its `step_args`), in one call of csrc/decode_layer.cpp: the same kernels in the same
    order as `absorb_in_place` and the norms' and residual's own ops, so the same bits
    (tests/test_engine_loop.py). None where the layer or its norms are not of that op's form: packed
    bf16 projections without bias, mlakit's RMSNorm (bf16 weights) everywhere, no hooks on any of them,
    kv_b_proj packed for the folds."""
    cfg, mods = mla.cfg, mla._modules
    found = _in_place(mla, h, plan)
    if found is None or cfg.q_lora_rank is None or not h.is_contiguous() or h.shape[0] == 0:
        return None
    packs = found[0]  # (the pools come to `run` from the cache, after its checks)
    n, d = h.shape
    h_, dn, dr, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    ql, width = cfg.q_lora_rank, cfg.kv_lora_rank
    if d % 2 or ql % 2 or dn % 2 or dv % 2 or width % 32 or dr % 32:
        return None
    linears = [mods.get(name) for name in PROJECTIONS]
    for m in linears:
        if (
            type(m) is not PackedLinear
            or m.bias is not None
            or not isinstance(m.packed, VnniWeight)
            or (m.upcast is not None and n >= m.upcast)
            or m._forward_pre_hooks
            or m._forward_hooks
        ):
            return None
    norms = [norm_in, *(mods.get(name) for name in NORMS), norm_post]
    for m in norms:
        hooked = m is None or m._forward_pre_hooks or m._forward_hooks
        if hooked or type(m) is not RMSNorm or m.weight.dtype != torch.bfloat16:
            return None
    ctx, layer = plan.context, mla.layer_idx
    cos_q, sin_q, cos_k, sin_k, interleave, read, lens, splits = step
    q_a, q_b, kv_a, o_proj = (m.packed.packed for m in linears)
    w_in, w_qa, w_kva, w_post = (m.weight for m in norms)
    dims = (h_, dn, dr, dv, ql, width)
    op = torch.ops.mlakit_cpu.mla_decode_layer
    plan.claim(layer, mla)  # as MLAAttention.run does, before anything is written

    def run(latent, rope, slots):
        return op(
            h, w_in, norm_in.eps, q_a, w_qa, norms[1].eps, q_b, kv_a, w_kva, norms[2].eps,
            cos_q, sin_q, cos_k, sin_k, interleave, latent, rope, slots, packs.fold.packed,
            packs.unfold.packed, read, lens, mla.scale, splits, o_proj, w_post, norm_post.eps, dims,
        )  # fmt: skip

    return ctx.write_in_place(plan, layer, run)


def fused_moe(mlp, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """h + mlp(x) for decode rows in one call of csrc/decode_layer.cpp's `moe_decode_block`, where `mlp` is
    a GroupedMoE whose experts run as one `moe_experts` call (`GroupedMoE._fused`) and whose router
    `route` takes through `_short_route`: the same ops in the same order, so the same bits
    (tests/test_engine_loop.py). None else (hooks on the block included: the caller calls it)."""
    if type(mlp) is not GroupedMoE or mlp._forward_pre_hooks or mlp._forward_hooks:
        return None
    packed, gate = mlp.packed, mlp.gate
    if x.dim() != 2 or not x.is_contiguous() or not mlp._fused(packed, x) or not short_route(gate):
        return None
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None or gate.weight.shape[-1] != x.shape[-1] or gate.weight.device.type != "cpu":
        return None
    stacks = packed["stacks"]
    return torch.ops.mlakit_cpu.moe_decode_block(
        h, x, gate.weight, bias, gate.top_k, bool(gate.norm_topk_prob), float(gate.routed_scaling_factor),
        stacks[0], stacks[1], packed["shared_gate_up"].packed, packed["shared_down"].packed,
        mlp.experts.down_proj.shape[-1], mlp.shared_experts.down_proj.in_features,
    )  # fmt: skip

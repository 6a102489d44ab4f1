"""MLAAttention: projections → cache write at the plan's rows → the plan's path over the latent → o_proj."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import nn

from mlakit.cache.checks import int_list
from mlakit.cache.contiguous import LatentCache, Slots
from mlakit.cache.paged import PagedLatentCache
from mlakit.cache.plan import RowGroup, StepPlan, local_plan
from mlakit.cache.quant import hadamard
from mlakit.cache.step import pack_rows
from mlakit.config import MLAConfig
from mlakit.dispatch import check_mode
from mlakit.indexer import Indexer
from mlakit.linear import Linear, call
from mlakit.ops import absorb, cpu_core, materialize
from mlakit.ops.common import compute_dtype
from mlakit.ops.materialize import DEFAULT_WORKSPACE_TOKENS
from mlakit.ops.paged import absorb_chunked
from mlakit.ops.sparse import (
    index_topk,
    sparse_absorb_gathered,
    sparse_materialize,
)
from mlakit.ops.vnni import UpPacks, vnni_packs
from mlakit.rope import RotaryTable, apply_tables

ABSORB_BACKENDS = ("auto", "triton", "torch")


class RMSNorm(nn.Module):
    """transformers' RMSNorm: normalize in fp32, cast back, then scale."""

    def __init__(self, width: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_norm(x, self.weight):
            # the same arithmetic in one pass per row (csrc/rows.cpp; the squares summed in another order)
            rows = x.reshape(-1, x.shape[-1])
            return torch.ops.mlakit_cpu.rms_norm(
                rows if rows.stride(-1) == 1 else rows.contiguous(), self.weight, self.eps
            ).view(x.shape)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32  # promote, never demote
        xf = x if x.dtype is work else x.to(work)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (xf if x.dtype is work else xf.to(x.dtype))


def _fused_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the one-pass RMSNorm takes x: bf16 x and weight on a CPU where the bf16 core runs, no
    autograd, not traced."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not torch.compiler.is_compiling()
        and cpu_core.available(torch.bfloat16)
    )


def project_unrotated(
    m: nn.Module, cfg: MLAConfig, hidden_states: torch.Tensor, q_resid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections of a module with transformers' MLA submodule names, before rope:
    q_nope [B,S,H,dn], q_pe [B,S,H,dr], c_kv [B,S,L] (normalized), k_pe [B,S,dr] (any leading shape:
    packed tokens [N, D] give [N,H,dn], ...). `q_resid`: the normalized query latent
    q_a_layernorm(q_a_proj(x)) when the caller has it already (DSA)."""
    mods = m._modules  # straight from the dict: Module.__getattr__ costs ~1 us a lookup
    if cfg.q_lora_rank is None:
        q = call(mods["q_proj"], hidden_states)
    else:
        if q_resid is None:
            q_resid = call(mods["q_a_layernorm"], call(mods["q_a_proj"], hidden_states))
        q = call(mods["q_b_proj"], q_resid)
    q = q.view(*hidden_states.shape[:-1], cfg.num_heads, -1)
    dn, width = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    latent = call(mods["kv_a_proj_with_mqa"], hidden_states)
    return q[..., :dn], q[..., dn:], call(mods["kv_a_layernorm"], latent[..., :width]), latent[..., width:]


class MLAAttention(nn.Module):
    """Multi-head Latent Attention with transformers' parameter names.

    `forward(hidden_states, plan)` runs one layer of a planned step (see `mlakit.cache.plan`): the
    step's tokens packed, [N, D] in the plan's order (what a serving engine passes), or the caller's
    rectangle [B, S, D]; the output has the same shape. `forward(hidden_states [B,S,D], cache=None, *,
    mode="auto", slots=None, new_tokens=None)` is a thin function over a one-step plan: it plans, runs
    and commits one step of this layer alone. `cache` is a `LatentCache` or a `PagedLatentCache`; the
    layer reads and writes its layer `layer_idx` through the plan's context (the cache, or the step's
    own latents without one). What ran is reported by the plan (`plan.row_modes`, `plan.backend`).
    """

    def __init__(self, cfg: MLAConfig, *, layer_idx: int = 0, device=None, dtype=None):
        super().__init__()
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be an integer >= 0, got {layer_idx!r}")
        self.cfg = cfg
        self.layer_idx = layer_idx
        f = {"device": device, "dtype": dtype}
        h, bias = cfg.num_heads, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, h * cfg.qk_head_dim, bias=False, **f)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias, **f)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, **f)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False, **f)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.latent_dim, bias=bias, **f)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, **f)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, **f
        )
        self.o_proj = Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=bias, **f)
        # DSA (DeepSeek-V3.2, GLM-5): the lightning indexer, transformers' names (indexer.wq_b, ...)
        self.indexer = Indexer(cfg, **f) if cfg.is_sparse else None
        self.rope = RotaryTable(cfg)
        self.scale = cfg.softmax_scale
        self.workspace_tokens = DEFAULT_WORKSPACE_TOKENS
        # absorb over a paged cache: "auto" (the Triton kernel on CUDA with Triton installed, else the
        # torch path), "torch" (force the reference path) or "triton" (force the kernel); what ran is
        # recorded on the step's plan (`plan.backend`)
        self.absorb_backend = "auto"
        self._derived: torch.Tensor | None = None  # the reused buffer up_weights converts into
        # a measured crossover profile (mlakit.calibration) "auto" follows when it matches; None: analytic
        self.profile = None

    @property
    def dtype(self) -> torch.dtype:
        return self._kv_b_weight().dtype

    @property
    def device(self) -> torch.device:
        return self._kv_b_weight().device

    def _kv_b_weight(self) -> torch.Tensor:
        # straight from the module dicts: nn.Module.__getattr__ costs ~1 us a lookup, and a decode call
        # asks for dtype and device several times
        m = self._modules["kv_b_proj"]
        w = m._parameters.get("weight") if type(m) is Linear else None
        return m.weight if w is None else w

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H,dn,L], w_uv [H,dv,L]) of kv_b_proj in the dtype matmuls run in.

        Views of the weight when that is its own dtype; otherwise (bf16 weights on a CPU without
        native bf16 GEMMs) converted anew on every call, into a buffer kept between calls (a fresh
        64 MiB tensor per DeepSeek-V3 layer costs page faults: ~50 ms against ~10 ms for the copy).
        Nothing derived is reused unconverted, so nothing can go stale: a `.data` write,
        `load_state_dict` or a model built under `torch.inference_mode()` are all seen at once, and
        under torch.compile the conversion traces into the graph (docs/mla.md has the cost).
        """
        cfg = self.cfg
        m = self._modules["kv_b_proj"]
        w = m._parameters.get("weight") if type(m) is Linear else None
        w = m.weight if w is None else w
        cd = compute_dtype(w.dtype, w.device)
        records = torch.is_grad_enabled() and w.requires_grad
        if cd is w.dtype and not records and not torch.compiler.is_compiling():
            # views of the weight itself (its storage: in-place writes are seen), made again when the
            # parameter, its storage or the inference mode changes
            key = (id(w), w.data_ptr(), w._version if not w.is_inference() else None)
            kept = self.__dict__.get("_up_views")
            if kept is None or kept[0] != key or kept[1] != torch.is_inference_mode_enabled():
                kept = self._up_views = (key, torch.is_inference_mode_enabled(), _up_split(cfg, w))
            return kept[2]
        per_head = w.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        if cd != w.dtype:
            if torch.compiler.is_compiling() or (torch.is_grad_enabled() and w.requires_grad):
                per_head = per_head.to(cd)
            else:
                per_head = self._converted(per_head, cd)
        return per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim :]

    def pack_up(self) -> bool:
        """Keep packed copies of w_uk and w_uv for the absorbed path's folds (`mlakit.ops.vnni.UpPacks`:
        bf16 weights on a CPU with AVX512-BF16 without AMX; +1x kv_b_proj's memory); False where none is
        made. Used while kv_b_proj's weight is the one packed (same tensor, storage and version); the
        engine, which owns the weights, calls it once."""
        w = self._kv_b_weight()
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not vnni_packs():
            self.__dict__.pop("_up_packs", None)
            return False
        with torch.no_grad():
            self.__dict__["_up_packs"] = (_weight_key(w), UpPacks(*self.up_weights()))
        return True

    def up_packs(self) -> UpPacks | None:
        """The packs of `pack_up` while they match kv_b_proj's weight, else None."""
        kept = self.__dict__.get("_up_packs")
        if kept is None or kept[0] != _weight_key(self._kv_b_weight()):
            return None
        return kept[1]

    def __getstate__(self) -> dict:
        # kept weight views share memory with the parameter only in this process
        state = dict(super().__getstate__())
        state.pop("_up_views", None)
        state.pop("_up_packs", None)
        return state

    def _converted(self, per_head: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
        """`per_head` copied into this layer's reused `cd` buffer (reallocated when its shape, device or
        inference-mode status no longer fits)."""
        buf = self._derived
        fits = (
            buf is not None
            and buf.shape == per_head.shape
            and buf.dtype == cd
            and buf.device == per_head.device
            and buf.is_inference() == torch.is_inference_mode_enabled()
        )
        if not fits:
            buf = self._derived = torch.empty(per_head.shape, dtype=cd, device=per_head.device)
        with torch.no_grad():
            return buf.copy_(per_head)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: StepPlan | LatentCache | PagedLatentCache | None = None,
        *,
        mode: str = "auto",
        slots: Slots = None,
        new_tokens: torch.Tensor | Sequence[int] | None = None,
        check_finite: bool = False,
    ) -> torch.Tensor:
        """`new_tokens` [B] (optional) makes a ragged batch: row b brings its first new_tokens[b]
        positions of `hidden_states` (the rest is padding, never read; its output is zero); one
        integer is the count of every row, as `cache.plan` reads it. With a cache, this call plans,
        runs and commits one layer: a cache of one layer only (several: plan / layers / commit).
        `check_finite=True` refuses NaN/inf at real positions (ValueError, cache unchanged; a host sync)."""
        if isinstance(cache, StepPlan):
            if mode != "auto" or slots is not None or new_tokens is not None:
                raise ValueError(
                    "mode, slots and new_tokens belong to the plan: pass them to cache.plan(...)"
                )
            return self.run(hidden_states, cache, check_finite=check_finite)
        return self.step(
            hidden_states, cache, mode=mode, slots=slots, new_tokens=new_tokens, check_finite=check_finite
        )[0]

    def step(
        self,
        hidden_states: torch.Tensor,
        cache: LatentCache | PagedLatentCache | None = None,
        *,
        mode: str = "auto",
        slots: Slots = None,
        new_tokens: torch.Tensor | Sequence[int] | None = None,
        check_finite: bool = False,
    ) -> tuple[torch.Tensor, StepPlan]:
        """The one-layer call `layer(hidden_states, cache, ...)`, returning (output, its plan): the plan
        made for this one step (committed; cache-less: a plan over the step's own latents) says what
        ran (`plan.row_modes`, `plan.mode`, `plan.backend`)."""
        check_mode(mode)
        self._check_hidden(hidden_states)
        batch, new, _ = hidden_states.shape
        counts = self._check_counts(new_tokens, batch, new)
        if cache is None:
            if slots is not None:
                raise ValueError("slots were given without a cache")
            plan = local_plan(
                self.cfg,
                self.rope,
                counts or [new] * batch,
                counts is None,
                new,
                mode,
                self.profile,
                self.device,
                self.dtype,
            )
            if check_finite:
                _check_finite(hidden_states, plan)
            return self._compute(hidden_states, plan, self.layer_idx), plan
        self._check_cache(cache)
        if cache.num_layers > 1:
            raise ValueError(
                f"layer(hidden_states, cache) commits after one layer, but this cache holds "
                f"{cache.num_layers} layers: plan = cache.plan(...), then hidden = layer(hidden, plan) "
                "for every layer, then cache.commit(plan)"
            )
        if check_finite:
            _check_finite(hidden_states, None if counts is None else _valid(counts, new, self.device))
        plan = cache.plan(
            new if counts is None else counts,
            slots,
            mode=mode,
            profile=self.profile,
            seq_len=new,
            batch=batch,
            bucket=False,  # one layer, eager: exactly the keys there are (no masked work)
        )
        try:
            out = self._compute(hidden_states, plan, self.layer_idx)
        except BaseException:
            cache.discard(plan)
            raise
        cache.commit(plan)
        return out, plan

    def run(self, hidden_states: torch.Tensor, plan: StepPlan, *, check_finite: bool = False) -> torch.Tensor:
        """One layer of a planned step: checks (host facts only), then `_compute`."""
        plan.check_open()
        self._check_hidden(hidden_states, packed=True)
        if hidden_states.dim() == 2 and hidden_states.shape[0] != plan.num_tokens:
            raise ValueError(
                f"hidden_states has shape {tuple(hidden_states.shape)}, the plan packs "
                f"[{plan.num_tokens}, {self.cfg.hidden_size}] (or the rectangle "
                f"[{plan.batch}, {plan.seq_len}, {self.cfg.hidden_size}])"
            )
        if hidden_states.dim() == 3 and tuple(hidden_states.shape[:2]) != (plan.batch, plan.seq_len):
            raise ValueError(
                f"hidden_states has shape {tuple(hidden_states.shape)}, the plan is for "
                f"[{plan.batch}, {plan.seq_len}, {self.cfg.hidden_size}] (or [{plan.num_tokens}, "
                f"{self.cfg.hidden_size}] packed)"
            )
        self._check_cache(plan.cache)
        if plan.rope_key != self.rope.key:
            raise ValueError(
                "plan's rope tables differ from the layer's: "
                f"{_rope_mismatch(plan.rope_key, self.rope.key)}; make the plan from a cache of the "
                "layer's config"
            )
        if check_finite:
            _check_finite(hidden_states, plan)
        # claimed last: a refusal above leaves the plan's owners as they were
        if plan.cache is not None and not torch.compiler.is_dynamo_compiling():
            plan.claim(self.layer_idx, self)
        return self._compute(hidden_states, plan, self.layer_idx)

    def engine_run(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """`run` for the engine's own steps (mlakit.engine.loop): packed tokens x [N, D] of a plan the
        engine made over its cache, for a layer of that cache's config, so `run`'s checks of the
        caller's tensors and plan are skipped; the layer still claims its index."""
        if plan.cache is not None:
            plan.claim(self.layer_idx, self)
        return self._compute(x, plan, self.layer_idx)

    def _compute(self, hidden_states: torch.Tensor, plan: StepPlan, layer: int) -> torch.Tensor:
        """Projections, rope, cache write, each row group's path, o_proj over the step's packed tokens;
        nothing read back to the host. A rectangle [B, S, D] is packed first and unpacked at the end."""
        rect = hidden_states.dim() == 3
        x = pack_rows(hidden_states, plan) if rect else hidden_states  # [N, D]
        q_resid = None if self.indexer is None else self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_pe, c_kv, k_pe = project_unrotated(self, self.cfg, x, q_resid)  # [N, H, .], [N, .]
        if plan.rotation is not None:  # decode rows only: one rotation matrix per token
            q_pe = _rotate(q_pe, plan.rotation)
            k_pe = _rotate(k_pe[:, None], plan.rotation)[:, 0]
        else:
            q_pe = apply_tables(q_pe, plan.rope_q)
            k_pe = apply_tables(k_pe, plan.rope_k)
        ctx = plan.context
        ctx.write(plan, layer, c_kv, k_pe)
        if self.indexer is not None:
            k_idx = self.indexer.keys(x[None], plan.cos[None], plan.sin[None])[0]
            ctx.write_index(plan, layer, k_idx)
        index_q = self._index_queries(plan, x, q_resid)
        outs = []
        for g in plan.groups:
            t0, t1 = g.tokens
            r, n = g.rows[1] - g.rows[0], g.new
            if t1 - t0 == q_nope.shape[0]:  # one group: the step's tensors as they are
                qn, qp, iq = q_nope.view(r, n, *q_nope.shape[1:]), q_pe.view(r, n, *q_pe.shape[1:]), index_q
                if iq is not None:
                    iq = tuple(t.view(r, n, *t.shape[1:]) for t in iq)
            else:
                qn, qp = _rows(q_nope, t0, t1, r, n), _rows(q_pe, t0, t1, r, n)
                iq = None if index_q is None else tuple(_rows(t, t0, t1, r, n) for t in index_q)
            o = self._attend_group(plan, g, layer, qn, qp, iq)  # [R, new, H, dv]
            outs.append(o.reshape(t1 - t0, -1))
        out = call(self._modules["o_proj"], outs[0] if len(outs) == 1 else torch.cat(outs))  # [N, D]
        if not rect:
            return out
        if plan.pack is None:
            return out.view(plan.batch, plan.seq_len, -1)
        full = out.new_zeros(plan.batch * plan.seq_len, out.shape[-1])
        return full.index_copy(0, plan.pack, out).view(plan.batch, plan.seq_len, -1)

    def _index_queries(self, plan, x, q_resid):
        """(q_idx [N,H_I,d_I], weights [N,H_I] fp32) of the packed tokens when a group of the plan is
        sparse; else None (the indexer only caches keys while every query sees <= k)."""
        if self.indexer is None or not any(g.path.startswith("sparse") for g in plan.groups):
            return None
        q_idx = self.indexer.queries(q_resid[None], plan.cos[None], plan.sin[None])[0]
        return q_idx, self.indexer.weights(x)

    def _attend_group(self, plan, g: RowGroup, layer, q_nope, q_pe, index_q=None) -> torch.Tensor:
        """One path over one row group's context, read through the plan's context (the cache or the
        step's own latents): absorb over its keys (views, a gather, or pages in place), or
        materialize over them; DSA past index_topk over the selected keys."""
        if g.path.startswith("sparse"):
            return self._attend_sparse(plan, g, layer, q_nope, q_pe, index_q)
        ctx = plan.context
        w_uk, w_uv = self.up_weights()
        if g.path == "absorb":
            paged = getattr(ctx, "layer_pages", None) is not None
            backend = _absorb_backend(self.absorb_backend, ctx.device) if paged else None
            if backend == "triton":
                from mlakit.kernels import absorb_paged

                r0, r1 = g.rows
                out, _ = absorb_paged(
                    q_nope,
                    q_pe,
                    ctx.layer_pages(layer),
                    plan.block_table[r0:r1],
                    g.kv_lens,
                    w_uk,
                    w_uv,
                    self.scale,
                    layout=ctx.layout,
                )
            else:
                out, _ = absorb_chunked(
                    q_nope,
                    q_pe,
                    ctx.key_reader(layer, g),
                    g.kv_lens,
                    w_uk,
                    w_uv,
                    self.scale,
                    max_keys=g.key_len,
                    pages=ctx.in_place(layer, g),
                    bias=g.bias,
                    packs=self.up_packs(),
                )
            if paged:
                plan.backend = backend if plan.backend in (None, backend) else "mixed"
            return out
        c_kv, k_pe = ctx.keys(layer, g)
        return self.attend(g.path, q_nope, q_pe, c_kv, k_pe, g.kv_lens, g.key_len)[0]

    def _attend_sparse(self, plan, g: RowGroup, layer, q_nope, q_pe, index_q) -> torch.Tensor:
        """DSA over one row group: index scores over its cached indexer keys, top-k per query, then
        absorb over the gathered selection (or the dense masked form, where the cost model says)."""
        ctx = plan.context
        k_ctx = ctx.index_keys(layer, g)
        if getattr(ctx, "index_rotation", False):
            # fp8 keys are kept Hadamard-rotated: (Hq)·(Hk) = q·k
            index_q = (hadamard(index_q[0]).to(index_q[0].dtype), index_q[1])
        picked = index_topk(*index_q, k_ctx, g.kv_lens, self.cfg.index_topk, max_keys=g.key_len)  # [R, S, k]
        w_uk, w_uv = self.up_weights()
        if g.path == "sparse-absorb":
            out, _ = sparse_absorb_gathered(
                q_nope,
                q_pe,
                lambda rows: ctx.selected(layer, g, rows),
                g.kv_lens,
                w_uk,
                w_uv,
                self.scale,
                picked,
            )
            return out
        c_kv, k_pe = ctx.keys(layer, g)
        out, _ = sparse_materialize(
            q_nope,
            q_pe,
            c_kv,
            k_pe,
            g.kv_lens,
            w_uk,
            w_uv,
            self.scale,
            indices=picked,
            workspace_tokens=self.workspace_tokens,
            max_keys=g.key_len,
        )
        return out

    def attend(self, run, q_nope, q_pe, c_kv, k_pe, kv_lens, max_keys=None):
        """Run one path over a context; returns (out [B,S,H,dv], lse [B,S,H] or None). `max_keys`: a
        plan's bucket (exactly that many keys, masked past kv_lens)."""
        w_uk, w_uv = self.up_weights()
        if run == "absorb":
            packs = self.up_packs()
            args = (q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, self.scale)
            return absorb(*args, max_keys=max_keys, packs=packs)
        return materialize(
            q_nope,
            q_pe,
            c_kv,
            k_pe,
            kv_lens,
            w_uk,
            w_uv,
            self.scale,
            workspace_tokens=self.workspace_tokens,
            need_lse=False,
            max_keys=max_keys,
        )

    def project(
        self, hidden_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [B,S,D], positions [B,S] → q_nope [B,S,H,dn], q_pe [B,S,H,dr] (rotated),
        c_kv [B,S,L] (normalized), k_pe [B,S,dr] (rotated)."""
        q_nope, q_pe, c_kv, k_pe = project_unrotated(self, self.cfg, hidden_states)
        cos, sin = self.rope.cos_sin(positions)  # [B, S, dr/2]
        q_pe = self.rope.apply(q_pe, cos[:, :, None], sin[:, :, None])
        k_pe = self.rope.apply(k_pe, cos, sin)
        return q_nope, q_pe, c_kv, k_pe

    def _check_hidden(self, x: torch.Tensor, packed: bool = False) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"hidden_states must be a tensor, got {type(x).__name__}")
        if x.dim() != 3 and not (packed and x.dim() == 2):
            want = "[tokens, hidden] (packed) or [batch, seq, hidden]" if packed else "[batch, seq, hidden]"
            raise ValueError(f"hidden_states must be {want}, got shape {tuple(x.shape)}")
        if x.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"hidden_states has width {x.shape[-1]}, layer expects {self.cfg.hidden_size}")
        if 0 in x.shape[:-1]:
            raise ValueError(f"hidden_states has shape {tuple(x.shape)}; batch and new tokens must be >= 1")
        if x.dtype != self.dtype:
            raise ValueError(f"hidden_states has dtype {x.dtype}, layer holds {self.dtype}")
        if x.device != self.device:
            raise ValueError(f"hidden_states is on {x.device}, layer is on {self.device}")

    def _check_counts(self, new_tokens, batch: int, new: int) -> list[int] | None:
        """Per-row new-token counts, or None when every row brings all S tokens."""
        if new_tokens is None:
            return None
        if (
            isinstance(new_tokens, torch.Tensor)
            and new_tokens.device.type != "meta"
            and (
                new_tokens.dtype.is_floating_point
                or new_tokens.dtype.is_complex
                or new_tokens.dtype == torch.bool
                or new_tokens.dim() != 1
            )
        ):
            shape = tuple(new_tokens.shape)
            raise ValueError(
                f"new_tokens must be {batch} integers (one per row), got {new_tokens.dtype} of shape {shape}"
            )
        try:
            counts = int_list(new_tokens, "new_tokens")
        except ValueError as err:
            raise ValueError(f"new_tokens must be {batch} integers (one per row): {err}") from None
        if isinstance(new_tokens, numbers.Integral):  # one count for every row, as cache.plan reads it
            counts = counts * batch
        if len(counts) != batch:
            raise ValueError(
                f"new_tokens must be {batch} integers (one per row), "
                f"got torch.int64 of shape ({len(counts)},)"
            )
        if any(not 1 <= c <= new for c in counts):
            raise ValueError(f"new_tokens {counts} outside 1..{new} (the padded width of hidden_states)")
        return None if all(c == new for c in counts) else counts

    def _check_cache(self, cache) -> None:
        if not isinstance(cache, (LatentCache, PagedLatentCache)):
            raise ValueError(
                f"cache must be a LatentCache, a PagedLatentCache or a StepPlan, got {type(cache).__name__}"
            )
        widths = width_mismatches(cache.cfg, self.cfg)
        if widths:
            raise ValueError(
                f"cache (or plan) was built for another config: {widths}; build the cache from the "
                "layer's config"
            )
        if cache.dtype != self.dtype:
            raise ValueError(f"cache holds dtype {cache.dtype}, layer computes in {self.dtype}")
        if cache.device != self.device:
            raise ValueError(f"cache is on {cache.device}, layer is on {self.device}")
        if (cache.cfg.index_head_dim if cache.cfg.is_sparse else None) != (
            self.cfg.index_head_dim if self.cfg.is_sparse else None
        ):
            raise ValueError(
                f"cache keeps indexer keys of width {cache.cfg.index_head_dim} (index_head_dim), layer "
                f"produces {self.cfg.index_head_dim} (None: no indexer); build the cache from the layer's "
                "config"
            )
        if self.layer_idx >= cache.num_layers:
            raise ValueError(
                f"layer_idx {self.layer_idx} out of range: the cache holds {cache.num_layers} layers"
            )


# the cached widths a layer and its cache must share: (field, what it is)
CACHED_WIDTHS = (("kv_lora_rank", "latent width"), ("qk_rope_head_dim", "rope width"))


def _weight_key(w: torch.Tensor) -> tuple:
    # inference tensors keep no version counter: their identity and storage only
    return (id(w), w.data_ptr(), None if w.is_inference() else w._version)


def width_mismatches(cache_cfg: MLAConfig, layer_cfg: MLAConfig) -> str:
    """'' when the cached widths agree, else each mismatch as "<field> (<what>): cache <n>, layer <m>"."""
    return ", ".join(
        f"{field} ({what}): cache {getattr(cache_cfg, field)}, layer {getattr(layer_cfg, field)}"
        for field, what in CACHED_WIDTHS
        if getattr(cache_cfg, field) != getattr(layer_cfg, field)
    )


def _rope_mismatch(plan_key: tuple, layer_key: tuple) -> str:
    """Which part of two rope keys (inv_freq, factor) differs, in words."""
    # (the widths agree here: `_check_cache` refused another qk_rope_head_dim first)
    (plan_freq, plan_factor), (layer_freq, layer_factor) = plan_key, layer_key
    if plan_freq != layer_freq:
        return "rope frequencies (rope_theta or rope_scaling) differ"
    return f"rope mscale factor {plan_factor}, layer {layer_factor} (rope_scaling)"


def _absorb_backend(choice: str, device: torch.device) -> str:
    """ "triton" or "torch" for `MLAAttention.absorb_backend`; "auto" never imports Triton off CUDA."""
    if choice not in ABSORB_BACKENDS:
        raise ValueError(f"absorb_backend must be one of {ABSORB_BACKENDS}, got {choice!r}")
    if choice == "auto" and device.type != "cuda":
        return "torch"
    from mlakit.kernels import pick_backend

    return pick_backend(device, choice)


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rope of x [B, n, dr] by per-row rotations [B, dr, dr] (rope.rotation_matrices), in the
    rotation's dtype (fp32 for 16-bit x, as `apply_tables` rotates), back in x's dtype."""
    if x.dtype == rotation.dtype:
        return torch.bmm(x, rotation)
    return torch.bmm(x.to(rotation.dtype), rotation).to(x.dtype)


def _up_split(cfg: MLAConfig, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H·(dn+dv), L] → (w_uk [H, dn, L], w_uv [H, dv, L]): views."""
    per_head = w.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim :]


def _rows(x: torch.Tensor, t0: int, t1: int, rows: int, new: int) -> torch.Tensor:
    """Packed tokens t0..t1 of x [N, ...] as a group's rectangle [rows, new, ...] (a view)."""
    return x[t0:t1].view(rows, new, *x.shape[1:])


def _check_finite(x: torch.Tensor, valid) -> None:
    """Refuse NaN/inf at real positions (`valid` [B,S] bool or a plan; None: every position)."""
    if isinstance(valid, StepPlan):
        valid = (
            None
            if x.dim() == 2 or valid.pack is None
            else _valid(valid.counts.tolist(), x.shape[1], x.device)
        )
    finite = torch.isfinite(x).all(dim=-1)  # [B, S] or [N]
    if valid is not None:
        finite = finite | ~valid
    if not bool(finite.all()):
        bad = (~finite).nonzero().tolist()
        raise ValueError(
            f"hidden_states holds NaN or inf at (row, token) {bad[:8]}; check_finite=True refuses them"
        )


def _valid(counts: list[int], new: int, device) -> torch.Tensor:
    """Bool [B, S]: position i of row b is one of its new tokens."""
    return (torch.arange(new)[None, :] < torch.tensor(counts)[:, None]).to(device)

"""MLAAttention: projections → cache write at the plan's rows → the plan's path over the latent → o_proj."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import nn

from mlakit.cache.checks import int_list
from mlakit.cache.contiguous import LatentCache, Slots
from mlakit.cache.paged import PagedLatentCache, rows_reader
from mlakit.cache.plan import RowGroup, StepPlan, local_plan
from mlakit.cache.quant import hadamard
from mlakit.config import MLAConfig
from mlakit.dispatch import check_mode
from mlakit.indexer import Indexer
from mlakit.linear import Linear
from mlakit.ops import absorb, materialize
from mlakit.ops.common import compute_dtype, core_dtype
from mlakit.ops.materialize import DEFAULT_WORKSPACE_TOKENS
from mlakit.ops.paged import absorb_chunked, page_rows
from mlakit.ops.sparse import (
    gather_rows,
    index_topk,
    sparse_absorb_gathered,
    sparse_materialize,
)
from mlakit.rope import RotaryTable, apply_tables

ABSORB_BACKENDS = ("auto", "triton", "torch")
# the projections the short decode form multiplies by directly (see MLAAttention._lean_weights)
_LEAN_PROJECTIONS = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_proj")
_LEAN_PROJECTIONS_Q_LORA = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj")
_LEAN_SHORT = {
    "kv_a_proj_with_mqa": "kv_a",
    "o_proj": "o",
    "q_proj": "q",
    "q_a_proj": "q_a",
    "q_b_proj": "q_b",
}


class RMSNorm(nn.Module):
    """transformers' RMSNorm: normalize in fp32, cast back, then scale."""

    def __init__(self, width: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)  # promote, never demote
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def project_unrotated(
    m: nn.Module, cfg: MLAConfig, hidden_states: torch.Tensor, q_resid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections of a module with transformers' MLA submodule names, before rope:
    q_nope [B,S,H,dn], q_pe [B,S,H,dr], c_kv [B,S,L] (normalized), k_pe [B,S,dr]. `q_resid`: the
    normalized query latent q_a_layernorm(q_a_proj(x)) when the caller has it already (DSA)."""
    batch, new, _ = hidden_states.shape
    if cfg.q_lora_rank is None:
        q = m.q_proj(hidden_states)
    else:
        q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(hidden_states)) if q_resid is None else q_resid)
    q = q.view(batch, new, cfg.num_heads, cfg.qk_head_dim)
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    latent = m.kv_a_proj_with_mqa(hidden_states)
    c_kv, k_pe = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    return q_nope, q_pe, m.kv_a_layernorm(c_kv), k_pe


class MLAAttention(nn.Module):
    """Multi-head Latent Attention with transformers' parameter names.

    `forward(hidden_states [B,S,D], plan) -> [B,S,D]` runs one layer of a planned step (see
    `mlakit.cache.plan`); `forward(hidden_states, cache=None, *, mode="auto", slots=None,
    new_tokens=None)` plans, runs and commits one step of this layer alone. `cache` is a
    `LatentCache` or a `PagedLatentCache`; the layer reads and writes its layer `layer_idx`.
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
        self.last_mode: str | None = None
        self.last_row_modes: list[str] = []
        # absorb over a paged cache: "auto" (the Triton kernel on CUDA with Triton installed, else the
        # torch path), "torch" (force the reference path) or "triton" (force the kernel); what ran is
        # recorded in `last_backend` and on the step's plan (`plan.backend`)
        self.absorb_backend = "auto"
        self.last_backend: str | None = None
        # a plan with a lean form (one-token absorb decode) runs `_compute_lean` (~22 aten ops instead of
        # ~80); False: always the general path (docs/cache.md says when that matters)
        self.short_decode = True
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
        w = self.kv_b_proj.weight
        per_head = w.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        cd = compute_dtype(w.dtype, w.device)
        if cd != w.dtype:
            if torch.compiler.is_compiling() or (torch.is_grad_enabled() and w.requires_grad):
                per_head = per_head.to(cd)
            else:
                per_head = self._converted(per_head, cd)
        return per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim :]

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
            )
            if check_finite:
                _check_finite(hidden_states, plan)
            out = self._compute(hidden_states, plan, None)
        else:
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
        self.last_mode = plan.mode
        self.last_row_modes = list(plan.row_modes)
        return out

    def run(self, hidden_states: torch.Tensor, plan: StepPlan, *, check_finite: bool = False) -> torch.Tensor:
        """One layer of a planned step: checks (host facts only), then `_compute`."""
        plan.check_open()
        self._check_hidden(hidden_states)
        if tuple(hidden_states.shape[:2]) != (plan.batch, plan.seq_len):
            raise ValueError(
                f"hidden_states has shape {tuple(hidden_states.shape)}, the plan is for "
                f"[{plan.batch}, {plan.seq_len}, {self.cfg.hidden_size}]"
            )
        self._check_cache(plan.cache)
        if plan.rope_key != self.rope.key:
            raise ValueError(
                "plan's rope tables differ from the layer's: "
                f"{_rope_mismatch(plan.rope_key, self.rope.key)}; make the plan from a cache of the "
                "layer's config"
            )
        if check_finite:
            _check_finite(hidden_states, plan.valid)
        # claimed last: a refusal above leaves the plan's owners as they were
        if plan.cache is not None and not torch.compiler.is_dynamo_compiling():
            plan.claim(self.layer_idx, self)
        return self._compute(hidden_states, plan, self.layer_idx)

    def _compute(self, hidden_states: torch.Tensor, plan: StepPlan, layer: int | None) -> torch.Tensor:
        """Projections, rope, cache write, the plan's paths, o_proj; nothing read back to the host."""
        if plan.lean is not None and self._lean_allowed(plan):
            return self._compute_lean(hidden_states, plan, layer)
        return self._compute_general(hidden_states, plan, layer)

    def _compute_general(self, hidden_states: torch.Tensor, plan: StepPlan, layer) -> torch.Tensor:
        batch, new, _ = hidden_states.shape
        q_resid = None if self.indexer is None else self.q_a_layernorm(self.q_a_proj(hidden_states))
        q_nope, q_pe, c_kv, k_pe = project_unrotated(self, self.cfg, hidden_states, q_resid)
        q_pe = apply_tables(q_pe, plan.rope_q)
        k_pe = apply_tables(k_pe, plan.rope_k)
        k_idx = None if self.indexer is None else self.indexer.keys(hidden_states, plan.cos, plan.sin)
        if plan.cache is None:
            # padding stays out of the context (its latent may be anything, even NaN)
            keep = plan.valid[..., None]
            local = (c_kv.where(keep, 0), k_pe.where(keep, 0))
            if k_idx is not None:
                local += (k_idx.where(keep, 0),)
        else:
            plan.cache.write(plan, layer, c_kv, k_pe)
            if k_idx is not None:
                plan.cache.write_index(plan, layer, k_idx)
            local = None
        index_q = self._index_queries(plan, hidden_states, q_resid)
        if plan.ragged:
            q_nope, q_pe = _take(q_nope, plan.q_index), _take(q_pe, plan.q_index)
        out = self._attend_groups(plan, layer, q_nope, q_pe, local, index_q)  # [B, S, H, dv]
        if plan.ragged:
            out = _take(out, plan.o_index)
        out = self.o_proj(out.reshape(batch, new, -1))
        if plan.ragged:
            out = out.where(plan.valid[..., None], 0)
        return out

    def _lean_allowed(self, plan: StepPlan) -> bool:
        """The short decode form runs eagerly, without autograd, in the storage dtype, over the torch
        absorb path (a paged cache on CUDA takes the fused kernel; torch.compile traces the general
        path, whose views and masks it fuses anyway)."""
        # (the plan has checked the rest: the cache's compute dtype is its storage dtype, which
        # `run` checked is the layer's, and DSA steps get no lean form)
        if torch.compiler.is_compiling() or not self.short_decode:
            return False
        # it multiplies in the storage dtype: a 16-bit cache on a CPU takes the fp32-score core instead
        if core_dtype(self.dtype, self.device) != self.dtype:
            return False
        return not isinstance(plan.cache, PagedLatentCache) or (
            _absorb_backend(self.absorb_backend, plan.cache.device) == "torch"
        )

    def _compute_lean(self, hidden_states: torch.Tensor, plan: StepPlan, layer: int) -> torch.Tensor:
        """One new token per row, absorb over one key block: the general path's arithmetic in ~22 aten
        ops (at the tiny shape of benchmarks/plan_overhead.py, against 80).

        What makes it short: 2-D activations through the projections; weight views (transposes, the
        per-head split of kv_b_proj) made once (`_lean_weights`); rope as one bmm with the plan's
        per-row rotation; the plan's additive mask as the input of the first score matmul; the
        context as views the cache keeps (rows past a slot's length are zero there, so a masked
        key's value is 0 · 0); projections, queries and values written by `out=` into workspaces laid
        out so that no split, transpose or copy is needed before the next matmul (under grad mode the
        query side runs plain ops instead: 28 ops). The results and gradients equal the general
        path's to fp32 round-off (tests/test_lean.py runs both)."""
        cfg, lean, cache = self.cfg, plan.lean, plan.cache
        w = self._lean_weights()
        if w is None:  # a projection is wrapped, hooked or replaced: run it through its module
            return self._compute_general(hidden_states, plan, layer)
        batch, heads = plan.batch, cfg.num_heads
        x = hidden_states.reshape(batch, -1)  # [B, D]: one new token per row (a view when it can be)
        # autograd records the call under grad mode (weights that require grad): `out=` is not
        # differentiable, so the query side then runs plain matmuls and a transpose or two more
        record = torch.is_grad_enabled() and (hidden_states.requires_grad or self._any_requires_grad())
        ws = self._lean_workspace(batch)
        with torch.no_grad():
            # the keys reach attention through the cache (the general path reads them from there
            # too): no gradient flows through this side in either path
            _mm(x, w["kv_a"], self.kv_a_proj_with_mqa.bias, out=ws["kv"])  # [B, L + dr]
            c_kv = self.kv_a_layernorm(ws["c_kv"])  # [B, 1, L]
            k_pe = _rotate(ws["k_pe"], lean.rotation)  # [B, 1, dr]
            cache.write(plan, layer, c_kv, k_pe)
        q_a = None if cfg.q_lora_rank is None else self.q_a_layernorm(_mm(x, w["q_a"], self.q_a_proj.bias))
        w_q = w["q"] if q_a is None else w["q_b"]
        if record:
            q = _mm(x if q_a is None else q_a, w_q, None).view(batch, heads, -1)
            q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        else:
            _mm(x if q_a is None else q_a, w_q, None, out=ws["q"])
            q_nope, q_pe = ws["q_nope"], ws["q_pe"]  # [B, H, dn], [B, H, dr]
        q_pe = _rotate(q_pe, lean.rotation)  # [B, H, dr]
        if record:
            q_lat = torch.bmm(q_nope.transpose(0, 1), w["uk"]).transpose(0, 1)  # [B, H, L]
        else:
            torch.bmm(q_nope.transpose(0, 1), w["uk"], out=ws["q_lat_hb"])
            q_lat = ws["q_lat"]  # [B, H, L]
        c, c_t, k_t = cache.lean_context(layer, plan, record)
        scores = torch.baddbmm(lean.bias, q_pe, k_t, alpha=self.scale)  # [B, H, T], -inf past kv_lens
        scores.baddbmm_(q_lat, c_t, alpha=self.scale)
        probs = torch.softmax(scores, dim=-1)
        if record:
            o_lat = torch.bmm(probs, c)  # [B, H, L]
            out_t = torch.bmm(w["uv"], o_lat.permute(1, 2, 0)).view(-1, batch)  # [H·dv, B]
            bias = self.o_proj.bias
            out_t = (
                torch.mm(self.o_proj.weight, out_t)
                if bias is None
                else torch.addmm(bias[:, None], self.o_proj.weight, out_t)
            )
            # [D, B] read as [B, 1, D]: a transposed view (no copy)
            return out_t.as_strided((batch, 1, out_t.shape[0]), (1, out_t.numel(), batch))
        torch.bmm(probs, c, out=ws["o_lat_bh"])  # o_lat [H, B, L]
        torch.bmm(ws["o_lat"], w["uv_t"], out=ws["out_hb"])  # out [B, H, dv]
        out = _mm(ws["out_flat"], w["o"], self.o_proj.bias)
        if isinstance(cache, PagedLatentCache):
            self.last_backend = "torch"
            plan.backend = "torch" if plan.backend in (None, "torch") else "mixed"
        return out.view(batch, 1, -1)

    def _lean_projections(self) -> tuple[str, ...]:
        return _LEAN_PROJECTIONS if self.cfg.q_lora_rank is None else _LEAN_PROJECTIONS_Q_LORA

    def _any_requires_grad(self) -> bool:
        """Whether a parameter of the query side requires grad (what makes autograd record the call)."""
        names = self._lean_projections() + (() if self.cfg.q_lora_rank is None else ("q_a_layernorm",))
        modules = self._modules
        return any(p is not None and p.requires_grad for n in names for p in modules[n]._parameters.values())

    def __getstate__(self) -> dict:
        # kept weight views and workspaces share memory with the parameters only in this process
        state = dict(super().__getstate__())
        for name in ("_lean_views", "_lean_ws"):
            state.pop(name, None)
        return state

    def _lean_weights(self) -> dict[str, torch.Tensor] | None:
        """Views of the weights the short decode form multiplies by (transposed, split per head), made
        once and kept while every weight is the same tensor: `.data` writes, `load_state_dict` into new
        storage or `.to()` give new data pointers, and the views are made again. None when a projection
        is not a plain mlakit Linear (replaced, wrapped, hooked): its module must run."""
        names = self._lean_projections()
        modules = self._modules
        key = [torch.is_inference_mode_enabled()]
        for name in names:
            m = modules[name]
            if type(m) is not Linear or m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
                return None
            w = m._parameters.get("weight")  # absent under torch.nn.utils.parametrize
            if w is None:
                return None
            key += (id(w), w.data_ptr(), w.shape, w.stride(), w.dtype)
        mod = nn.modules.module
        if mod._global_forward_hooks or mod._global_forward_pre_hooks:
            return None
        kept = self.__dict__.get("_lean_views")
        if kept is not None and kept[0] == key:
            return kept[1]
        cfg = self.cfg
        # made under grad mode: a view keeps its link to the weight (views save no tensors, so one
        # view node serves any number of backward passes); under no_grad the link is simply unused
        with torch.enable_grad():
            # slices, not split: autograd refuses a kept multi-output view once an optimizer step has
            # changed its base in place
            per_head = self.kv_b_proj.weight.view(cfg.num_heads, -1, cfg.kv_lora_rank)
            dn = cfg.qk_nope_head_dim
            w_uk, w_uv = per_head[:, :dn], per_head[:, dn:]
            views = {"uk": w_uk, "uv": w_uv, "uv_t": w_uv.transpose(1, 2)}
            for name in names:
                if name != "kv_b_proj":
                    views[_LEAN_SHORT[name]] = modules[name].weight.t()
        self._lean_views = (key, views)
        return views

    def _lean_workspace(self, batch: int) -> dict[str, torch.Tensor]:
        """Buffers the short decode form writes by `out=` and their views, reused between calls (never
        returned): q_lat [B, H, L] (filled head-major through "q_lat_hb"), o_lat [H, B, L] (filled
        row-major through "o_lat_bh"), out [B, H, dv] (through "out_hb", read as "out_flat" [B, H·dv])."""
        cfg = self.cfg
        key = (batch, self.dtype, self.device, torch.is_inference_mode_enabled())
        kept = self.__dict__.get("_lean_ws")
        if kept is None or kept[0] != key:
            f = {"dtype": self.dtype, "device": self.device}
            h, latent = cfg.num_heads, cfg.kv_lora_rank
            q_lat = torch.empty(batch, h, latent, **f)
            o_lat = torch.empty(h, batch, latent, **f)
            out = torch.empty(batch, h, cfg.v_head_dim, **f)
            kv = torch.empty(batch, 1, cfg.latent_dim, **f)
            q = torch.empty(batch, h, cfg.qk_head_dim, **f)
            q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
            bufs = {
                "kv": kv.view(batch, -1),
                "c_kv": kv[..., :latent],
                "k_pe": kv[..., latent:],
                "q": q.view(batch, -1),
                "q_nope": q_nope,
                "q_pe": q_pe,
                "q_lat": q_lat,
                "q_lat_hb": q_lat.transpose(0, 1),
                "o_lat": o_lat,
                "o_lat_bh": o_lat.transpose(0, 1),
                "out_hb": out.transpose(0, 1),
                "out_flat": out.view(batch, -1),
            }
            kept = self._lean_ws = (key, bufs)
        return kept[1]

    def _index_queries(self, plan, hidden_states, q_resid):
        """(q_idx [B,S,H_I,d_I], weights [B,S,H_I] fp32) in the ops' query order when a group of the
        plan is sparse; else None (the indexer only caches keys while every query sees <= k)."""
        if self.indexer is None or not any(g.path.startswith("sparse") for g in plan.groups):
            return None
        q_idx = self.indexer.queries(q_resid, plan.cos, plan.sin)
        w = self.indexer.weights(hidden_states)
        if plan.ragged:
            q_idx, w = _take(q_idx, plan.q_index), _take(w, plan.q_index)
        return q_idx, w

    def _attend_groups(self, plan, layer, q_nope, q_pe, local, index_q=None) -> torch.Tensor:
        if len(plan.groups) == 1:
            return self._attend_group(plan, plan.groups[0], layer, q_nope, q_pe, local, index_q)
        out = q_nope.new_zeros(*q_nope.shape[:3], self.cfg.v_head_dim)
        for g in plan.groups:
            iq = None if index_q is None else (index_q[0][g.rows], index_q[1][g.rows])
            o = self._attend_group(plan, g, layer, q_nope[g.rows], q_pe[g.rows], local, iq)
            out = out.index_copy(0, g.rows, o)
        return out

    def _attend_group(self, plan, g: RowGroup, layer, q_nope, q_pe, local, index_q=None) -> torch.Tensor:
        """One path over one row group's context (a view, a gather or pages read chunk by chunk)."""
        if g.path.startswith("sparse"):
            return self._attend_sparse(plan, g, layer, q_nope, q_pe, local, index_q)
        cache = plan.cache
        if isinstance(cache, PagedLatentCache):
            if g.path == "absorb":
                return self._absorb_pages(plan, g, layer, q_nope, q_pe)
            c_kv, k_pe = cache.gather(layer, g.read_rows)
        elif cache is None:
            c_kv, k_pe = local if g.rows is None else (local[0][g.rows], local[1][g.rows])
        else:
            c_kv, k_pe = cache.context(layer, g, g.key_len)
        return self.attend(g.path, q_nope, q_pe, c_kv, k_pe, g.kv_lens, g.key_len)[0]

    def _attend_sparse(self, plan, g: RowGroup, layer, q_nope, q_pe, local, index_q) -> torch.Tensor:
        """DSA over one row group: index scores over its cached indexer keys, top-k per query, then
        absorb over the gathered selection (or the dense masked form, where the cost model says)."""
        cache = plan.cache
        if cache is None:
            local = local if g.rows is None else tuple(t[g.rows] for t in local)
            k_ctx = local[2][:, : g.key_len]
        else:
            k_ctx = cache.index_keys(layer, g, g.key_len)
            if getattr(cache, "index_rotation", False):
                # fp8 keys are kept Hadamard-rotated: (Hq)·(Hk) = q·k
                index_q = (hadamard(index_q[0]).to(index_q[0].dtype), index_q[1])
        picked = index_topk(*index_q, k_ctx, g.kv_lens, self.cfg.index_topk, max_keys=g.key_len)  # [R, S, k]
        w_uk, w_uv = self.up_weights()
        if g.path == "sparse-absorb":
            if cache is None:

                def gather(rows):
                    return gather_rows(local[0], rows), gather_rows(local[1], rows)

            else:

                def gather(rows):
                    return cache.selected(layer, g, rows)

            out, _ = sparse_absorb_gathered(q_nope, q_pe, gather, g.kv_lens, w_uk, w_uv, self.scale, picked)
            return out
        if cache is None:
            c_kv, k_pe = local[0], local[1]
        elif isinstance(cache, PagedLatentCache):
            c_kv, k_pe = cache.gather(layer, g.read_rows)
        else:
            c_kv, k_pe = cache.context(layer, g, g.key_len)
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

    def _absorb_pages(self, plan, g: RowGroup, layer, q_nope, q_pe) -> torch.Tensor:
        """Absorb over one layer's pages: the fused kernel (block table, kv_lens on the device) or the
        torch path (rows read chunk by chunk); records which one ran on the layer and the plan."""
        cache = plan.cache
        w_uk, w_uv = self.up_weights()
        backend = _absorb_backend(self.absorb_backend, cache.device)
        if backend == "triton":
            from mlakit.kernels import absorb_paged

            table = plan.block_table if g.rows is None else plan.block_table.index_select(0, g.rows)
            pages = cache.layer_pages(layer)
            out, _ = absorb_paged(
                q_nope, q_pe, pages, table, g.kv_lens, w_uk, w_uv, self.scale, layout=cache.layout
            )
        else:
            read = rows_reader(cache, layer, g.read_rows)
            pages = page_rows(cache, layer, g.read_rows)
            out, _ = absorb_chunked(
                q_nope, q_pe, read, g.kv_lens, w_uk, w_uv, self.scale, max_keys=g.key_len, pages=pages
            )
        self.last_backend = backend
        plan.backend = backend if plan.backend in (None, backend) else "mixed"
        return out

    def attend(self, run, q_nope, q_pe, c_kv, k_pe, kv_lens, max_keys=None):
        """Run one path over a context; returns (out [B,S,H,dv], lse [B,S,H] or None). `max_keys`: a
        plan's bucket (exactly that many keys, masked past kv_lens)."""
        w_uk, w_uv = self.up_weights()
        if run == "absorb":
            return absorb(q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, self.scale, max_keys=max_keys)
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

    def _check_hidden(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"hidden_states must be a tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"hidden_states must be [batch, seq, hidden], got shape {tuple(x.shape)}")
        if x.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"hidden_states has width {x.shape[-1]}, layer expects {self.cfg.hidden_size}")
        if x.shape[0] == 0 or x.shape[1] == 0:
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


def _mm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, out=None) -> torch.Tensor:
    """x [N, in] · w_t [in, out] (+ bias): one aten op (into `out` when given)."""
    if bias is None:
        return torch.mm(x, w_t, out=out)
    return torch.addmm(bias, x, w_t, out=out)


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rope of x [B, n, dr] by per-row rotations [B, dr, dr] (rope.rotation_matrices), in the
    rotation's dtype (fp32 for 16-bit x, as `apply_tables` rotates), back in x's dtype."""
    if x.dtype == rotation.dtype:
        return torch.bmm(x, rotation)
    return torch.bmm(x.to(rotation.dtype), rotation).to(x.dtype)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, S, ...] → x[b, index[b, i]] [B, S, ...]: a gather along the token axis."""
    idx = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return torch.gather(x, 1, idx)


def _check_finite(x: torch.Tensor, valid) -> None:
    """Refuse NaN/inf at real positions (`valid` [B,S] bool or a plan; None: every position)."""
    valid = getattr(valid, "valid", valid)
    finite = torch.isfinite(x).all(dim=-1)  # [B, S]
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

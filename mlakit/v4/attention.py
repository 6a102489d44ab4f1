"""V4Attention: one DeepSeek-V4 attention layer (sliding window, CSA or HCA) over a V4Cache.

hidden [B,S,D]
  ├─ q: q_a_proj → q_a_norm (q_residual) → q_b_proj → per-head rms → rope tail   [B,S,H,hd]
  ├─ kv: kv_proj → kv_norm → rope tail: the one K = V entry of the token          [B,S,hd]
  ├─ CSA / HCA: the compressor pools the groups this step completes into entries  (plan.compress)
  └─ CSA: the indexer selects ≤ index_topk entries per query
softmax over [window keys | compressed keys] plus a per-head sink logit; o = P·K (K = V)
o's rope tail rotated back by −t; grouped low-rank output: o_a_proj per group, then o_b_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from mlakit.v4.cache import V4Cache
from mlakit.v4.compressor import Compressor, Indexer, RMSNorm
from mlakit.v4.config import CSA, SLIDING, V4Config
from mlakit.v4.plan import V4Plan
from mlakit.v4.rope import cos_sin, rotate_tail, v4_inv_freq


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, *, layer_idx: int = 0):
        super().__init__()
        if not isinstance(cfg, V4Config):
            raise ValueError(f"cfg must be a V4Config, got {type(cfg).__name__}")
        if (
            isinstance(layer_idx, bool)
            or not isinstance(layer_idx, int)
            or not 0 <= layer_idx < cfg.num_layers
        ):
            raise ValueError(f"layer_idx {layer_idx!r} out of range, expected 0..{cfg.num_layers - 1}")
        self.cfg, self.layer_idx = cfg, layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        d, h, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * hd, bias=False)
        self.kv_proj = nn.Linear(d, hd, bias=False)
        self.kv_norm = RMSNorm(hd, eps)
        self.o_a_proj = nn.Linear(h * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, d, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.compressor = None
        if self.layer_type != SLIDING:
            csa = self.layer_type == CSA
            self.compressor = Compressor(d, hd, cfg.ratio(self.layer_type), csa, eps)
            if csa:
                self.compressor.indexer = Indexer(
                    d,
                    cfg.q_lora_rank,
                    cfg.index_n_heads,
                    cfg.index_head_dim,
                    cfg.csa_ratio,
                    cfg.index_topk,
                    eps,
                )
        # fp32 frequencies kept out of the module's buffers: `.to(bf16)` must not round them
        self._freqs = {torch.device("cpu"): v4_inv_freq(cfg, self.layer_type)}
        for p in (self.q_a_proj, self.q_b_proj, self.kv_proj, self.o_a_proj, self.o_b_proj):
            nn.init.normal_(p.weight, std=0.02)

    @property
    def inv_freq(self) -> torch.Tensor:
        """The layer's rope frequencies [dr/2], fp32 on the CPU."""
        return self._freqs[torch.device("cpu")]

    def _freqs_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._freqs:
            self._freqs[device] = self.inv_freq.to(device)
        return self._freqs[device]

    def forward(
        self, hidden: torch.Tensor, plan: V4Plan | V4Cache | None = None, *, slots=None, new_tokens=None
    ) -> torch.Tensor:
        """hidden [B,S,D] → [B,S,D]. With a plan: the step's layer over the plan's cache. With a V4Cache:
        plan, this layer, commit (the one-layer call; a model plans once for all its layers). Without:
        the tokens alone (positions 0..). Right-padded rows through `new_tokens` (padding outputs are 0)."""
        self._check_hidden(hidden)
        if isinstance(plan, V4Cache):
            cache = plan
            if len(cache.layers) > 1:
                raise ValueError(
                    f"layer(hidden, cache) on a cache of {len(cache.layers)} layers {cache.layers} would "
                    "advance lengths for every layer after writing one: plan = cache.plan(...), "
                    "layer(hidden, plan) for each layer, then cache.commit(plan)"
                )
            b, s, _ = hidden.shape
            plan = cache.plan(s if new_tokens is None else new_tokens, slots, seq_len=s)
            try:
                out = self._run(hidden, plan)
            except BaseException:
                cache.discard(plan)
                raise
            cache.commit(plan)
            return out
        if slots is not None:
            raise ValueError("slots is for a call with a V4Cache; a plan already names its slots")
        if plan is None:
            b, s, _ = hidden.shape
            cache = V4Cache(self.cfg, b, s, dtype=hidden.dtype, device=hidden.device, layers=[self.layer_idx])
            plan = cache.plan(s if new_tokens is None else new_tokens, seq_len=s)
        elif new_tokens is not None:
            raise ValueError("new_tokens is for a call without a plan; the plan already holds the counts")
        return self._run(hidden, plan)

    def _run(self, hidden: torch.Tensor, plan: V4Plan) -> torch.Tensor:
        """One layer of a planned step: its checks (host facts only; a refusal changes nothing), the
        claim of its layer_idx and the save of the rows it overwrites, the layer, the record that it
        wrote (what commit checks)."""
        self._check_plan(hidden, plan)
        cache = plan.cache
        cache._begin_layer(plan, self.layer_idx, self)
        out = self._compute(hidden, plan, cache.state[self.layer_idx])
        plan.ran.add(self.layer_idx)
        return out

    def _check_hidden(self, hidden) -> None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise ValueError(f"hidden must be a tensor [B,S,D], got {getattr(hidden, 'shape', type(hidden))}")
        if hidden.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"hidden has width {hidden.shape[-1]}, layer expects {self.cfg.hidden_size}")

    def _check_plan(self, hidden, plan) -> None:
        if not isinstance(plan, V4Plan):
            raise ValueError(f"plan must be a V4Plan from V4Cache.plan(...), got {type(plan).__name__}")
        plan.check_open()
        cache = plan.cache
        if self.layer_idx not in cache.state:
            raise ValueError(f"the plan's cache holds no layer {self.layer_idx} (it holds {cache.layers})")
        if tuple(hidden.shape[:2]) != (plan.batch, plan.width):
            raise ValueError(
                f"hidden has rows x tokens {tuple(hidden.shape[:2])}, the plan {(plan.batch, plan.width)}"
            )
        if hidden.dtype != cache.dtype or hidden.device != cache.device:
            raise ValueError(
                f"hidden is {hidden.dtype} on {hidden.device}, "
                f"the cache holds {cache.dtype} on {cache.device}"
            )

    def _compute(self, hidden: torch.Tensor, plan: V4Plan, st: dict) -> torch.Tensor:
        b, s, _ = hidden.shape
        cfg = self.cfg
        freqs = self._freqs_on(hidden.device)
        work = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        cos, sin = cos_sin(freqs, plan.positions, work)  # [B,S,dr/2]
        q_residual = self.q_a_norm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_residual).view(b, s, cfg.num_heads, cfg.head_dim)
        q = q * torch.rsqrt(q.to(work).pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps).to(q.dtype)
        q = rotate_tail(q, cos[:, :, None], sin[:, :, None])
        kv = rotate_tail(self.kv_norm(self.kv_proj(hidden)), cos, sin)  # [B,S,hd]
        window = st["window"]
        keys_w = torch.cat([window[plan.win_rows], kv.to(window.dtype)], dim=1)  # [B,R_w+S,hd]
        window.index_copy_(0, plan.win_write, kv.reshape(b * s, -1).to(window.dtype))
        parts = [(keys_w, plan.win_visible, None)]
        if self.compressor is not None:
            parts.append(self._compressed(hidden, q_residual, plan, st, cos, sin, freqs))
        o = self._attend(q, parts)  # [B,S,H,hd]
        o = rotate_tail(o, cos[:, :, None], sin[:, :, None], inverse=True)
        grouped = o.reshape(b, s, cfg.o_groups, -1)
        w = self.o_a_proj.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
        return self.o_b_proj(torch.einsum("bsgi,gri->bsgr", grouped, w).flatten(2))

    def _compressed(self, hidden, q_residual, plan: V4Plan, st, cos, sin, freqs):
        """(keys, mask, None) over every entry for HCA (and CSA while all fit in index_topk), else the
        selected entries per query (keys [B,S,k,hd], valid [B,S,k], "per-query")."""
        cp = plan.compress[self.layer_type]
        self.compressor.update(hidden, cp, st, "", freqs)
        if self.layer_type != CSA:
            return st["store"][cp.store_rows], cp.visible, None  # [B,N,hd]: every entry
        indexer = self.compressor.indexer
        indexer.update(hidden, cp, st, "index_", freqs)
        idx, valid = indexer(hidden, q_residual, st["index_store"][cp.store_rows], cos, sin, cp.visible)
        if idx is None:
            return st["store"][cp.store_rows], valid, None
        # only the selected entries are read from the store
        b, s, k = idx.shape
        rows = cp.store_rows.gather(1, idx.reshape(b, s * k))  # [B, S·k]
        return st["store"][rows].view(b, s, k, -1), valid, "per-query"

    def _attend(self, q: torch.Tensor, parts) -> torch.Tensor:
        """Softmax over every part's keys plus the sink logit; K = V, so o = Σ p·k."""
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        scale = self.cfg.softmax_scale
        qw = q.to(work)
        logits = []
        for keys, mask, kind in parts:
            eq = "bshd,bskd->bshk" if kind else "bshd,bkd->bshk"
            lg = torch.einsum(eq, qw, keys.to(work)) * scale
            logits.append(lg.masked_fill(~mask[:, :, None, :], float("-inf")))
        allp = torch.cat(logits, dim=-1)  # [B,S,H,K]
        sink = self.sinks.to(work)[None, None, :, None]
        if not self.cfg.attention_sink:
            sink = torch.full_like(sink, float("-inf"))
        top = torch.maximum(allp.amax(-1, keepdim=True), sink).clamp(min=torch.finfo(work).min)
        p = (allp - top).exp()
        denom = p.sum(-1, keepdim=True) + (sink - top).exp()
        p = p / denom.clamp(min=torch.finfo(work).tiny)
        out, start = 0, 0
        for keys, _mask, kind in parts:
            n = keys.shape[-2]
            eq = "bshk,bskd->bshd" if kind else "bshk,bkd->bshd"
            out = out + torch.einsum(eq, p[..., start : start + n], keys.to(work))
            start += n
        return out.to(q.dtype)

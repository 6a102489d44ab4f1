"""MLAAttention: projections → cache write → choose a path → attention over the latent → o_proj."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mlakit.cache.contiguous import LatentCache, Slots
from mlakit.cache.paged import PagedLatentCache
from mlakit.config import MLAConfig
from mlakit.dispatch import check_mode, choose
from mlakit.linear import Linear
from mlakit.ops import absorb, materialize
from mlakit.ops.common import compute_dtype
from mlakit.ops.materialize import DEFAULT_WORKSPACE_TOKENS
from mlakit.ops.paged import absorb_chunked
from mlakit.rope import RotaryTable


class RMSNorm(nn.Module):
    """transformers' RMSNorm: normalize in fp32, cast back, then scale."""

    def __init__(self, width: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def project_unrotated(
    m: nn.Module, cfg: MLAConfig, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections of a module with transformers' MLA submodule names, before rope:
    q_nope [B,S,H,dn], q_pe [B,S,H,dr], c_kv [B,S,L] (normalized), k_pe [B,S,dr]."""
    batch, new, _ = hidden_states.shape
    if cfg.q_lora_rank is None:
        q = m.q_proj(hidden_states)
    else:
        q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(hidden_states)))
    q = q.view(batch, new, cfg.num_heads, cfg.qk_head_dim)
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    latent = m.kv_a_proj_with_mqa(hidden_states)
    c_kv, k_pe = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    return q_nope, q_pe, m.kv_a_layernorm(c_kv), k_pe


class MLAAttention(nn.Module):
    """Multi-head Latent Attention with transformers' parameter names.

    `forward(hidden_states [B,S,D], cache=None, *, mode="auto", slots=None, new_tokens=None) -> [B,S,D]`,
    `cache` a `LatentCache` or a `PagedLatentCache`.
    """

    def __init__(self, cfg: MLAConfig, *, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
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
        self.rope = RotaryTable(cfg)
        self.scale = cfg.softmax_scale
        self.workspace_tokens = DEFAULT_WORKSPACE_TOKENS
        self.last_mode: str | None = None
        self.last_row_modes: list[str] = []
        # a measured crossover profile (mlakit.calibration) "auto" follows when it matches; None: analytic
        self.profile = None
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self._derived_key: tuple | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_b_proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.kv_b_proj.weight.device

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H,dn,L], w_uv [H,dv,L]) from kv_b_proj, contiguous, in the dtype matmuls run in
        (fp32 for bf16 weights on a CPU without native bf16 GEMMs); cached while the weight is unchanged."""
        cfg = self.cfg
        w = self.kv_b_proj.weight
        per_head = w.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        if torch.is_grad_enabled() and w.requires_grad:
            return per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim :]
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if key != self._derived_key or self.w_uk is None:
            cd = compute_dtype(w.dtype, w.device)
            with torch.no_grad():
                self.w_uk = per_head[:, : cfg.qk_nope_head_dim].to(cd).contiguous()
                self.w_uv = per_head[:, cfg.qk_nope_head_dim :].to(cd).contiguous()
            self._derived_key = key
        return self.w_uk, self.w_uv

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: LatentCache | PagedLatentCache | None = None,
        *,
        mode: str = "auto",
        slots: Slots = None,
        new_tokens: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """`new_tokens` [B] (optional) makes a ragged batch: row b brings its first new_tokens[b]
        positions of `hidden_states` (the rest is padding, never read; its output is zero)."""
        check_mode(mode)
        self._check_hidden(hidden_states)
        batch, new, _ = hidden_states.shape
        counts = self._check_counts(new_tokens, batch, new)
        if cache is None:
            if slots is not None:
                raise ValueError("slots were given without a cache")
            slot_ids, start = None, torch.zeros(batch, dtype=torch.long)
        else:
            slot_ids = self._check_cache(cache, batch, new if counts is None else counts, slots)
            start = cache.lengths[slot_ids].clone()
        positions = (start[:, None] + torch.arange(new)).to(hidden_states.device)  # [B, S]
        q_nope, q_pe, c_kv, k_pe = self.project(hidden_states, positions)
        if counts is not None:
            out = self._ragged(mode, q_nope, q_pe, c_kv, k_pe, start, counts, cache, slot_ids)
            return self.o_proj(out.reshape(batch, new, -1)) * _valid(counts, new, out.device)[..., None]
        kv_lens = start + new
        run = choose(self.cfg, new, start.tolist(), profile=self.profile) if mode == "auto" else mode
        if cache is None:
            out, _ = self.attend(run, q_nope, q_pe, c_kv, k_pe, kv_lens)
        else:
            cache._write(c_kv, k_pe, slot_ids)
            out, _ = self.attend_cache(run, q_nope, q_pe, cache, slot_ids, kv_lens)
        self.last_mode = run
        self.last_row_modes = [run] * batch
        return self.o_proj(out.reshape(batch, new, -1))

    def _ragged(self, mode, q_nope, q_pe, c_kv, k_pe, start, counts, cache, slot_ids):
        """Rows of different new-token counts: write each row's tokens, then run each group of rows
        on the path "auto" picks for it (or `mode`). Returns out [B,S,H,dv], zero past each count."""
        batch, new = q_nope.shape[:2]
        kv_lens = start + counts
        if cache is None:
            # padding stays out of the context (its latent may be anything, even NaN)
            keep = _valid(counts, new, c_kv.device)[..., None]
            c_kv, k_pe = c_kv.where(keep, 0), k_pe.where(keep, 0)
        else:
            for n in counts.unique().tolist():
                rows = torch.nonzero(counts == n).flatten()
                dev_rows = rows.to(c_kv.device)
                cache._write(c_kv[dev_rows, :n], k_pe[dev_rows, :n], slot_ids[rows])
        runs = [
            mode if mode != "auto" else choose(self.cfg, c, s, profile=self.profile)
            for c, s in zip(counts.tolist(), start.tolist(), strict=True)
        ]
        out = q_nope.new_zeros(batch, new, q_nope.shape[2], self.cfg.v_head_dim)
        for run in sorted(set(runs)):
            rows = torch.tensor([b for b in range(batch) if runs[b] == run])
            self._attend_rows(run, rows, out, q_nope, q_pe, c_kv, k_pe, kv_lens, counts, cache, slot_ids)
        self.last_mode = runs[0] if len(set(runs)) == 1 else "mixed"
        self.last_row_modes = runs
        return out

    def _attend_rows(self, run, rows, out, q_nope, q_pe, c_kv, k_pe, kv_lens, counts, cache, slot_ids):
        """One path over some rows: each row's queries are moved to the end of a window of the group's
        largest count (the ops' queries are the last tokens of each context), then moved back to `out`."""
        lens, n = kv_lens[rows], counts[rows]
        width = int(n.max())
        # query i of the window is row token i - (width - n): the first ones repeat token 0 (discarded)
        src = (torch.arange(width)[None, :] - (width - n)[:, None]).clamp_min(0)  # [R, width]
        dev_rows, dev_src = rows.to(q_nope.device), src.to(q_nope.device)
        q_n = q_nope[dev_rows[:, None], dev_src]  # [R, width, H, dn]
        q_p = q_pe[dev_rows[:, None], dev_src]
        if cache is None:
            top = int(lens.max())
            o, _ = self.attend(run, q_n, q_p, c_kv[dev_rows, :top], k_pe[dev_rows, :top], lens)
        else:
            o, _ = self.attend_cache(run, q_n, q_p, cache, slot_ids[rows], lens)  # [R, width, H, dv]
        for j, (row, count) in enumerate(zip(rows.tolist(), n.tolist(), strict=True)):
            out[row, :count] = o[j, width - count :]

    def attend_cache(self, run, q_nope, q_pe, cache, slots, kv_lens):
        """Run one path over the cached context of `slots`. Absorb reads a paged cache's pages chunk by
        chunk (no gather of the whole context); otherwise the context is the cache's view."""
        if run == "absorb" and isinstance(cache, PagedLatentCache):
            w_uk, w_uv = self.up_weights()
            read = cache.reader(slots, int(kv_lens.max()))
            return absorb_chunked(q_nope, q_pe, read, kv_lens, w_uk, w_uv, self.scale)
        c_kv, k_pe = cache.view(slots, int(kv_lens.max()))
        return self.attend(run, q_nope, q_pe, c_kv, k_pe, kv_lens)

    def attend(self, run, q_nope, q_pe, c_kv, k_pe, kv_lens):
        """Run one path over a context; returns (out [B,S,H,dv], lse [B,S,H] or None)."""
        w_uk, w_uv = self.up_weights()
        if run == "absorb":
            return absorb(q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, self.scale)
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

    def _check_counts(self, new_tokens, batch: int, new: int) -> torch.Tensor | None:
        """Per-row new-token counts as a CPU LongTensor [B], or None when every row brings all S tokens."""
        if new_tokens is None:
            return None
        counts = torch.as_tensor(new_tokens).to("cpu")
        if counts.dtype.is_floating_point or counts.dtype == torch.bool or tuple(counts.shape) != (batch,):
            raise ValueError(
                f"new_tokens must be {batch} integers (one per row), "
                f"got {counts.dtype} of shape {tuple(counts.shape)}"
            )
        counts = counts.long()
        if bool(((counts < 1) | (counts > new)).any()):
            raise ValueError(
                f"new_tokens {counts.tolist()} outside 1..{new} (the padded width of hidden_states)"
            )
        return None if bool((counts == new).all()) else counts

    def _check_cache(self, cache, batch: int, new: int | torch.Tensor, slots: Slots) -> torch.Tensor:
        if cache.cfg.latent_dim != self.cfg.latent_dim or cache.cfg.kv_lora_rank != self.cfg.kv_lora_rank:
            raise ValueError(
                f"cache holds latents of width {cache.cfg.kv_lora_rank}+{cache.cfg.qk_rope_head_dim}, "
                f"layer produces {self.cfg.kv_lora_rank}+{self.cfg.qk_rope_head_dim}"
            )
        if cache.dtype != self.dtype:
            raise ValueError(f"cache holds dtype {cache.dtype}, layer computes in {self.dtype}")
        if cache.device != self.device:
            raise ValueError(f"cache is on {cache.device}, layer is on {self.device}")
        cache.check_lengths()
        slot_ids = cache.resolve_slots(slots, batch)
        cache.check_append(new, slot_ids)
        return slot_ids


def _valid(counts: torch.Tensor, new: int, device) -> torch.Tensor:
    """Bool [B, S]: position i of row b is one of its new tokens."""
    return (torch.arange(new)[None, :] < counts[:, None]).to(device)

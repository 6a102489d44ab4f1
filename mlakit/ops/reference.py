"""The oracle: fp32, one sequence at a time, keys and values built explicitly."""

from __future__ import annotations

import torch


def reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    *,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, new = q_nope.shape[:2]
    outs, lses = [], []
    for b in range(batch):
        t = int(kv_lens[b])
        latent = c_kv[b, :t].double()  # [T, L]
        rope_key = k_pe[b, :t].double()  # [T, dr]
        keys_nope = torch.einsum("tl,hdl->htd", latent, w_uk.double())  # [H, T, dn]
        values = torch.einsum("tl,hdl->htd", latent, w_uv.double())  # [H, T, dv]
        q_n = q_nope[b].double().transpose(0, 1)  # [H, S, dn]
        q_r = q_pe[b].double().transpose(0, 1)  # [H, S, dr]
        scores = (q_n @ keys_nope.transpose(1, 2) + q_r @ rope_key.T) * scale  # [H, S, T]
        # query i sits at position t - new + i and sees keys 0..t - new + i
        query_pos = torch.arange(t - new, t)[:, None]  # [S, 1]
        hidden = torch.arange(t)[None, :] > query_pos  # [S, T]
        if key_mask is not None:
            hidden = hidden | ~key_mask[b, :t].cpu().bool()[None, :]
        scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, S]
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a query that sees no key mixes nothing
        outs.append((probs @ values).transpose(0, 1))  # [S, H, dv]
        lses.append(lse.T)  # [S, H]
    out = torch.stack(outs).to(q_nope.dtype)
    lse = torch.stack(lses)
    return out, lse.to(torch.float64 if q_nope.dtype == torch.float64 else torch.float32)

"""fp64 reference of one V4 attention layer over one sequence, written to be read (the oracle).

No cache, no batching, one query at a time: what each query sees is spelled out (its window, the
compressed entries completed before it, for CSA the top-k of them by the indexer's score).
"""

from __future__ import annotations

import torch

from mlakit.v4.config import CSA, SLIDING


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 if weight is None else weight)


def _rope(x, pos: float, freqs, inverse=False):
    """Rotate the last 2·len(freqs) dims of x [..., D] by interleaved pairs at position `pos`."""
    dr = 2 * freqs.numel()
    angle = -pos * freqs if inverse else pos * freqs
    c, s = angle.cos(), angle.sin()
    out = x.clone()
    even, odd = x[..., -dr::2], x[..., -dr + 1 :: 2]
    out[..., -dr::2] = even * c - odd * s
    out[..., -dr + 1 :: 2] = odd * c + even * s
    return out


def _entries(x, p, prefix, m, overlap, width, eps, freqs):
    """Every entry the sequence completes: entry w pools group w (Cb half when overlapping) and, when
    overlapping, group w−1's Ca half; softmax over the pooled tokens per channel; norm; rope at w·m."""
    kv, gate = x @ p[prefix + "kv_proj.weight"].T, x @ p[prefix + "gate_proj.weight"].T
    bias = p[prefix + "position_bias"]
    out = []
    for w in range(x.shape[0] // m):
        toks = [(t, slice(width, None) if overlap else slice(None)) for t in range(w * m, (w + 1) * m)]
        if overlap and w > 0:
            toks = [(t, slice(0, width)) for t in range((w - 1) * m, w * m)] + toks
        vals = torch.stack([kv[t, half] for t, half in toks])
        logits = torch.stack([gate[t, half] + bias[t % m, half] for t, half in toks])
        pooled = (vals * logits.softmax(dim=0)).sum(dim=0)
        out.append(_rope(_rms(pooled, p[prefix + "kv_norm.weight"], eps), w * m, freqs))
    return out


def _index_score(x_t, q_res_t, key, p, cfg, t, freqs):
    pre = "compressor.indexer."
    q = (q_res_t @ p[pre + "q_b_proj.weight"].T).view(cfg.index_n_heads, cfg.index_head_dim)
    q = _rope(q, t, freqs)
    w = x_t @ p[pre + "scorer.weights_proj.weight"].T * cfg.index_n_heads**-0.5
    return float((w * (q @ key).relu() * cfg.index_head_dim**-0.5).sum())


def v4_reference(layer, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [S,D] → [S,D] in fp64, from the layer's weights."""
    cfg, kind = layer.cfg, layer.layer_type
    p = {k: v.detach().double().cpu() for k, v in layer.state_dict().items()}
    freqs = layer.inv_freq.double().cpu()
    x, eps = hidden.detach().double().cpu(), cfg.rms_norm_eps
    s, h, hd = x.shape[0], cfg.num_heads, cfg.head_dim
    q_res = _rms(x @ p["q_a_proj.weight"].T, p["q_a_norm.weight"], eps)
    q = _rms((q_res @ p["q_b_proj.weight"].T).view(s, h, hd), None, eps)
    kv = _rms(x @ p["kv_proj.weight"].T, p["kv_norm.weight"], eps)
    q = torch.stack([_rope(q[t], t, freqs) for t in range(s)])
    kv = torch.stack([_rope(kv[t], t, freqs) for t in range(s)])
    entries, index_keys, m = [], [], cfg.ratio(kind)
    if kind != SLIDING:
        entries = _entries(x, p, "compressor.", m, kind == CSA, hd, eps, freqs)
    if kind == CSA:
        index_keys = _entries(x, p, "compressor.indexer.", m, True, cfg.index_head_dim, eps, freqs)
    out = []
    for t in range(s):
        keys = [kv[j] for j in range(max(0, t - cfg.sliding_window + 1), t + 1)]
        seen = list(range((t + 1) // m)) if m else []
        if kind == CSA and len(seen) > cfg.index_topk:
            score = {w: _index_score(x[t], q_res[t], index_keys[w], p, cfg, t, freqs) for w in seen}
            seen = sorted(seen, key=lambda w: (-score[w], w))[: cfg.index_topk]
        keys = torch.stack(keys + [entries[w] for w in seen])  # [K, hd]: keys and values alike
        logits = q[t] @ keys.T * cfg.softmax_scale  # [H, K]
        sink = p["sinks"][:, None] if cfg.attention_sink else torch.full((h, 1), float("-inf"), dtype=x.dtype)
        probs = torch.cat([logits, sink], dim=1).softmax(dim=1)[:, :-1]
        out.append(_rope(probs @ keys, t, freqs, inverse=True))  # [H, hd]
    o = torch.stack(out).reshape(s, cfg.o_groups, -1)
    w_a = p["o_a_proj.weight"].view(cfg.o_groups, cfg.o_lora_rank, -1)
    return torch.einsum("sgi,gri->sgr", o, w_a).flatten(1) @ p["o_b_proj.weight"].T

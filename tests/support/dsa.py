"""DSA test helpers: tiny transformers DSA layers, their captured top-k, an fp64 index-score oracle and
the margin rule for comparing selections."""

from __future__ import annotations

import torch

from mlakit import MLAConfig
from support.common import randomize_

transformers = __import__("pytest").importorskip("transformers")
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32  # noqa: E402
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm5  # noqa: E402

FAMILIES = {
    "v32": (transformers.DeepseekV32Config, hf_v32.DeepseekV32Attention, hf_v32.DeepseekV32RotaryEmbedding),
    "glm5": (transformers.GlmMoeDsaConfig, hf_glm5.GlmMoeDsaAttention, hf_glm5.GlmMoeDsaRotaryEmbedding),
}
HIDDEN, HEADS, Q_LORA, LATENT, NOPE, ROPE, V = 64, 4, 24, 20, 12, 8, 10
INDEX_HEADS, INDEX_DIM = 8, 16


def hf_config(family: str, topk: int = 8, layers: int = 1, **extra):
    kwargs = dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=Q_LORA,
        kv_lora_rank=LATENT,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        num_hidden_layers=layers,
        index_n_heads=INDEX_HEADS,
        index_head_dim=INDEX_DIM,
        index_topk=topk,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=256,
    )
    kwargs.update(extra)
    config = FAMILIES[family][0](**kwargs)
    config._attn_implementation = "eager"
    return config


def hf_attention(family: str, topk: int = 8, seed: int = 0):
    """(config, their attention with seeded weights, their rotary module)."""
    config = hf_config(family, topk)
    _, attn_cls, rotary_cls = FAMILIES[family]
    attn = randomize_(attn_cls(config, layer_idx=0), seed).eval()
    return config, attn, rotary_cls(config)


def causal_mask(batch: int, new: int, past: int) -> torch.Tensor:
    """Additive [B, 1, new, past+new]: their indexer needs a mask at every step, decode included."""
    keys = torch.arange(past + new)
    hidden = keys[None, :] > (past + torch.arange(new))[:, None]
    mask = torch.zeros(new, past + new).masked_fill(hidden, torch.finfo(torch.float32).min)
    return mask[None, None].expand(batch, 1, new, past + new)


def run_hf(config, attn, rotary, chunks):
    """Their attention over the chunks with their DynamicCache: (out [B,N,D], top-k of each chunk, cache)."""
    cache = transformers.DynamicCache(config=config)
    captured = []
    indexer = attn.indexer
    original = indexer.forward

    def record(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.append(out.long())
        return out

    indexer.forward = record
    outs, past = [], 0
    try:
        with torch.no_grad():
            for x in chunks:
                batch, new, _ = x.shape
                positions = (past + torch.arange(new))[None].expand(batch, new)
                result = attn(
                    hidden_states=x,
                    position_embeddings=rotary(x, positions),
                    attention_mask=causal_mask(batch, new, past),
                    cache=cache,
                )
                outs.append(result[0])
                past += new
    finally:
        del indexer.forward
    return torch.cat(outs, dim=1), captured, cache


def oracle_scores(indexer, cfg: MLAConfig, hidden, q_resid, inv_freq, factor: float) -> torch.Tensor:
    """fp64 I[b,t,s] = (H_I d_I)^-½ Σ_j w[t,j] ReLU(q[t,j]·k[s]) for s <= t (else -inf), written from
    the formula: rope rotates the first dr dims of each head in place, as complex pairs of the layout."""
    p = {k: v.detach().double() for k, v in indexer.named_parameters()}
    x, qr = hidden.double(), q_resid.double()
    b, n, _ = x.shape
    h, d, dr = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = (qr @ p["wq_b.weight"].T).view(b, n, h, d)
    k = x @ p["wk.weight"].T
    k = torch.nn.functional.layer_norm(k, (d,), p["k_norm.weight"], p["k_norm.bias"], 1e-6)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq.double()  # [N, dr/2]
    layout = cfg.indexer_rope_interleave
    q = torch.cat([rotate_in_place(q[..., :dr], angles[:, None], factor, layout), q[..., dr:]], -1)
    k = torch.cat([rotate_in_place(k[..., :dr], angles, factor, layout), k[..., dr:]], -1)
    w = x @ p["weights_proj.weight"].T  # [B, N, H_I]
    dots = torch.einsum("bthd,bsd->bths", q, k).clamp_min(0)
    scores = torch.einsum("bth,bths->bts", w, dots) * (h * d) ** -0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf"))


def rotate_in_place(x, angles, factor: float, interleave: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    re, im = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    z = torch.complex(re, im) * torch.polar(torch.full_like(angles, factor), angles)
    if interleave:
        return torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    return torch.cat([z.real, z.imag], dim=-1)


def assert_same_selection(name: str, got: torch.Tensor, scores: torch.Tensor, k: int, margin: float = 1e-5):
    """got [B,S,k'] indices (any order, -1 or out-of-range entries ignored) against exact scores [B,S,T]:
    the same set where the k-th and (k+1)-th visible scores differ by > margin·scale, else differing
    only in tokens whose score is within the margin of the k-th."""
    batch, new, keys = scores.shape
    scale = scores[torch.isfinite(scores)].abs().max().item()
    checked = 0
    for b in range(batch):
        for t in range(new):
            row = scores[b, t]
            visible = torch.isfinite(row)
            kk = min(k, int(visible.sum()))
            order = row.argsort(descending=True)
            want = set(order[:kk].tolist())
            picks = [i for i in got[b, t].tolist() if 0 <= i < keys and visible[i]]
            assert len(picks) == len(set(picks)) == kk, f"{name} [{b},{t}]: {len(picks)} picks, expected {kk}"
            diff = want ^ set(picks)
            if not diff:
                checked += 1
                continue
            kth = row[order[kk - 1]].item()
            near = [i for i in diff if abs(row[i].item() - kth) <= margin * scale]
            assert len(near) == len(diff), f"{name} [{b},{t}]: differs in {sorted(diff)} beyond ties at {kth}"
    return checked

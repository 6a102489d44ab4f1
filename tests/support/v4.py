"""Shared by the V4 tests: a tiny DeepseekV4Config, transformers' layer beside mlakit's, and a driver
that runs transformers' attention with its own cache (eager, fp32)."""

from __future__ import annotations

import torch

from mlakit.v4 import V4Attention, V4Config

TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def hf_config(window=8, csa=4, hca=16, topk=3, layer_types=None, **kw):
    from transformers import DeepseekV4Config

    layer_types = layer_types or TYPES
    args = dict(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=24,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=32,
        index_head_dim=12,
        index_topk=topk,
        sliding_window=window,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        partial_rotary_factor=0.5,
        compress_rates={"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        vocab_size=64,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=2,
        max_position_embeddings=1024,
    )
    args.update(kw)
    c = DeepseekV4Config(**args)
    c._attn_implementation = "eager"
    return c


def pair(hf_cfg, layer_idx, seed=0, dtype=torch.float32):
    """(transformers' DeepseekV4Attention with random weights, mlakit's V4Attention loaded from it)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    torch.manual_seed(seed)
    ref = DeepseekV4Attention(hf_cfg, layer_idx).to(dtype)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            scale = 0.5 if name.endswith(("position_bias", "sinks")) else 0.2
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))
    ours = V4Attention(V4Config.from_hf(hf_cfg), layer_idx=layer_idx).to(dtype)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


class HFRunner:
    """transformers' layer driven the way DeepseekV4Model drives it, with a DynamicCache of its own."""

    def __init__(self, hf_cfg, ref):
        from transformers import DynamicCache
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

        self.cfg, self.ref = hf_cfg, ref
        self.rotary = DeepseekV4RotaryEmbedding(hf_cfg)
        self.cache = DynamicCache(config=hf_cfg)
        self.seen = 0
        self.selections = []
        if ref.compressor is not None and hasattr(ref.compressor, "indexer"):
            ref.compressor.indexer.register_forward_hook(lambda m, a, out: self.selections.append(out))

    def step(self, hidden: torch.Tensor, use_cache=True) -> torch.Tensor:
        b, s, _ = hidden.shape
        pos = (torch.arange(s) + self.seen)[None].expand(b, -1)
        emb = {k: self.rotary(hidden, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        # the cached window keys: at most window - 1 before the new ones
        cached = min(self.seen, self.cfg.sliding_window - 1) if use_cache else 0
        kpos = torch.arange(self.seen - cached, self.seen + s)
        t = pos[0][:, None]
        ok = (kpos[None] <= t) & (kpos[None] > t - self.cfg.sliding_window)
        mask = torch.zeros(s, kpos.numel(), dtype=hidden.dtype).masked_fill(~ok, float("-inf"))
        mask = mask[None, None].expand(b, 1, -1, -1)
        with torch.no_grad():
            out, _ = self.ref(hidden, emb, pos, mask, cache=self.cache if use_cache else None)
        self.seen += s
        return out


def v4_state(cache) -> list:
    """Every buffer of a V4Cache (each layer's rings and stores, spare rows included), then the host
    bookkeeping: lengths, high-water marks, tokens held, the slots and room."""
    bufs = [t.clone() for layer in sorted(cache.state) for _, t in sorted(cache.state[layer].items())]
    host = (
        cache.lengths.tolist(),
        list(cache.high),
        list(cache.written),
        cache.batch_size,
        cache.max_seq_len,
    )
    return [*bufs, host]


def assert_v4_same(cache, before: list, what: str = "a refused call") -> None:
    """Bit-identical buffers (compared as bytes: NaN equals itself) and host bookkeeping."""
    now = v4_state(cache)
    assert len(now) == len(before), f"{what} changed the cache's buffers"
    for i, (got, want) in enumerate(zip(now[:-1], before[:-1], strict=True)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{what} changed buffer {i}"
    assert now[-1] == before[-1], f"{what} changed the bookkeeping: {before[-1]} -> {now[-1]}"

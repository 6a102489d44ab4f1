"""Tiny DeepSeek-V3-shaped model folders for the vLLM tests and benchmark (saved here, never fetched).

kv_lora_rank 512 + rope 64 (576: the width vLLM's CPU_MLA kernel needs), nope and value 128 as in
DeepSeek-V3 (so the absorb/materialize crossover sits where V3's does), 4 heads, 2 layers (one dense,
one MoE), fp32 weights in safetensors, a sharp lm_head (top-2 margins wide: greedy ties unlikely).
"""

from __future__ import annotations

import json
import os

import torch

TINY_V3 = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    q_lora_rank=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    max_position_embeddings=2048,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)


def write_tiny_v3(folder: str, seed: int = 0, sharpen: float = 8.0, **overrides) -> str:
    """Save a tiny random DeepSeek-V3 (transformers' own class) to `folder`; returns the folder."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(TINY_V3, **overrides)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(folder, safe_serialization=True)
    # vLLM reads these two from config.json; transformers' DeepseekV3Config does not write them
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.update(topk_method=cfg["topk_method"], scoring_func=cfg["scoring_func"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    return folder


def prompts(count: int, lengths, seed: int = 1, shared: int = 0, vocab: int = 500) -> list[list[int]]:
    """`count` prompts of token ids of the given lengths (cycled), every one starting with the same
    `shared`-token prefix when it is longer than that."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, vocab, (shared,), generator=g).tolist()
    out = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()
        if shared and n > shared:
            ids[:shared] = prefix
        out.append(ids)
    return out

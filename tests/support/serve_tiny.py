"""A tiny fp32 DeepSeek-V3 model folder (config.json, safetensors, a byte-level tokenizer) for tests that
serve a real engine: `mlakit serve --model FOLDER --dtype fp32`."""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=512,
    bos_token_id=256,
    eos_token_id=257,
    tie_word_embeddings=False,
)


def byte_tokenizer():
    """A transformers fast tokenizer: one token per byte (byte-level BPE without merges), <bos>, <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<bos>": 256, "<eos>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")


def write_tiny_model(folder, seed: int = 0) -> str:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY)).float().eval()
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)

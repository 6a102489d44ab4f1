"""Patch a (tiny, random) transformers DeepSeek-V3 model with mlakit and generate.

    PYTHONPATH=. python examples/hf_generate.py

Prints the tokens generated before and after `mlakit.hf.patch` (identical) and which path each
layer ran for the last step. With a real checkpoint, only the model line changes:
`model = AutoModelForCausalLM.from_pretrained(...)`.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import mlakit.hf


def tiny_model() -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,  # layer 1 is MoE
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        pad_token_id=0,
        eos_token_id=None,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval()


def main() -> None:
    model = tiny_model()
    # two left-padded prompts, as a tokenizer with padding_side="left" would give
    input_ids = torch.tensor([[0, 0, 0, 17, 42, 99], [5, 6, 7, 8, 9, 10]])
    attention_mask = (input_ids != 0).long()
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=16, do_sample=False, pad_token_id=0)

    before = model.generate(input_ids, **kwargs)
    mlakit.hf.patch(model)
    after = model.generate(input_ids, **kwargs)
    modes = [layer.self_attn.last_mode for layer in model.model.layers]
    mlakit.hf.unpatch(model)

    print("unpatched:", before[:, input_ids.shape[1] :].tolist())
    print("patched:  ", after[:, input_ids.shape[1] :].tolist())
    print("identical:", torch.equal(before, after), "| last step ran:", modes)


if __name__ == "__main__":
    main()

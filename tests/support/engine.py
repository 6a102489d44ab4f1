"""Tiny fp32 models of every family the engine serves, prompts, and transformers' greedy reference."""

from __future__ import annotations

import copy

import torch
import transformers

from support.common import HF_MOE, HF_TINY

MOE = dict(HF_MOE, n_group=1, topk_group=1, first_k_dense_replace=1)
DSA = dict(MOE, index_n_heads=8, index_head_dim=16, index_topk=32)
FAMILIES = {
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", MOE),
    "deepseek-v3.2": ("DeepseekV32Config", "DeepseekV32ForCausalLM", DSA),
    "glm-moe-dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", DSA),
    "glm-4.7-flash": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", MOE),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", {}),
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", MOE),
}


def tiny_model(family: str, seed: int = 0, **extra):
    """A 2-layer fp32 model with random weights and a sharp lm_head (greedy ties are unlikely)."""
    config_cls, model_cls, kw = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**HF_TINY, **kw, "max_position_embeddings": 1024, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def prompts(count: int, lengths, seed: int = 1, shared: int = 0, vocab: int = 97) -> list[list[int]]:
    """`count` prompts of the given lengths (cycled); every other one starts with a common `shared`-token
    prefix (when it is long enough)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, vocab, (shared,), generator=g).tolist()
    out = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        ids = torch.randint(4, vocab, (n,), generator=g).tolist()
        if shared and i % 2 == 0 and n > shared:
            ids[:shared] = prefix
        out.append(ids)
    return out


def reference(model, prompt_ids: list[list[int]], new_tokens: int):
    """(tokens, log-probabilities of the chosen tokens) of transformers' greedy generate(), each prompt
    alone, on an unpatched copy of `model` (the engine takes its model over)."""
    ref = copy.deepcopy(model)
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            g = ref.generate(
                torch.tensor([ids]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = g.sequences[0, len(ids) :].tolist()
            lps = [float(lg[0].float().log_softmax(-1)[t]) for lg, t in zip(g.logits, tokens, strict=True)]
            outs.append((tokens, lps))
    return outs


def drain(eng) -> dict:
    """Step an LLMEngine until nothing is left, checking its page invariants after every step; the
    finished RequestOutputs by request id."""
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            eng.check()
            if out.finished:
                done[out.request_id] = out
    return done

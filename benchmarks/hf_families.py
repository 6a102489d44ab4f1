"""Decode speed of every family `mlakit.hf.patch` supports, unpatched vs patched, after a 3K prompt.

    PYTHONPATH=. python benchmarks/hf_families.py                  # 3,000-token context, every family
    PYTHONPATH=. python benchmarks/hf_families.py --quick --threads 2
    PYTHONPATH=. python benchmarks/hf_families.py --families deepseek-v3,longcat-flash --json out.json

Each family is built from its own transformers config class at one tiny width (hidden 512, 16 heads,
latent 256, nope 64, rope 32, v 64; MoE and hybrid parts shrunk; 2 decoder layers), filled by a
chunked prefill, then both backends decode the same tokens from that cache (cropped back to the
prompt before each run; a correctness gate compares one step's logits first). Every supported family's
unpatched attention re-expands the whole latent cache through kv_b_proj at each step, so each should
show the speed-up; a hybrid's linear-attention layers (Kimi Linear, Ling 3) cost the same both ways
(and on a CPU without flash-linear-attention their reference kernels dominate), so the time spent in
the MLA layers alone is printed too (forward hooks around them).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
import transformers
from hf_decode import DTYPES, machine_name, step

import mlakit.hf
from mlakit.hf.families import FAMILIES

WIDTHS = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    pad_token_id=0,
    eos_token_id=None,
)
MOE = dict(moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1)
HYBRID = dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])
GATE_REL = 5e-2  # bf16 logits round differently on the two paths, never by this much

# id → (attention class, config class, causal-LM class, overrides of WIDTHS)
BENCH = {
    "deepseek-v2-lite": ("DeepseekV2Attention", "DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(MOE, q_lora_rank=None, first_k_dense_replace=1)),
    "deepseek-v3": ("DeepseekV3Attention", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(MOE, n_group=1, topk_group=1, first_k_dense_replace=1)),
    "glm4-moe-lite": ("Glm4MoeLiteAttention", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
                      dict(MOE, n_group=1, topk_group=1)),
    "minicpm3": ("MiniCPM3Attention", "MiniCPM3Config", "MiniCPM3ForCausalLM", dict(scale_emb=1.0)),
    "youtu": ("YoutuAttention", "YoutuConfig", "YoutuForCausalLM", {}),
    "axk1": ("AXK1Attention", "AXK1Config", "AXK1ForCausalLM",
             dict(MOE, n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"])),
    "mistral4": ("Mistral4Attention", "Mistral4Config", "Mistral4ForCausalLM",
                 dict(MOE, first_k_dense_replace=1)),
    "longcat-flash": ("LongcatFlashMLA", "LongcatFlashConfig", "LongcatFlashForCausalLM",
                      dict(num_layers=1, ffn_hidden_size=1024, expert_ffn_hidden_size=128, n_routed_experts=8,
                           zero_expert_num=2, moe_topk=2, head_dim=32)),
    "kimi-linear": ("KimiLinearAttention", "KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(MOE, **HYBRID, q_lora_rank=None, num_local_experts=8, linear_head_dim=32,
                         linear_num_heads=16)),
    "bailing-hybrid": ("BailingHybridAttention", "BailingHybridConfig", "BailingHybridForCausalLM",
                       dict(MOE, **HYBRID, n_group=1, topk_group=1, first_k_dense_replace=1,
                            num_local_experts=8, head_dim=32, layer_group_size=2, num_mtp_layers=0)),
}  # fmt: skip


def build(name: str, dtype: torch.dtype, positions: int):
    _, config_cls, model_cls, extra = BENCH[name]
    config = getattr(transformers, config_cls)(**dict(WIDTHS, **extra), max_position_embeddings=positions)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).to(dtype).eval()


def prefill(model, context: int, chunk: int, seed: int) -> transformers.DynamicCache:
    """A cache holding `context` tokens, written by the patched model in chunks (the fast way)."""
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(
        1, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed)
    )
    mlakit.hf.patch(model)
    with torch.inference_mode():
        for start in range(0, context, chunk):
            model(ids[:, start : start + chunk], cache=cache, use_cache=True)
    mlakit.hf.unpatch(model)
    return cache


def mla_modules(model, attention: str) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in (attention, "PatchedMLAAttention")]


def median_step(model, prompt_cache, tokens: list[int], warmup: int, attention: str) -> tuple[float, float]:
    """Median seconds per decode step, and of its MLA layers alone, from a copy of the prompt's cache
    (a hybrid's linear-attention state cannot be cropped back, so every run starts from its own copy)."""
    cache = copy.deepcopy(prompt_cache)
    spent = [0.0]
    starts = {}

    def before(module, args, kwargs):
        starts[id(module)] = time.perf_counter()

    def after(module, args, kwargs, out):
        spent[0] += time.perf_counter() - starts[id(module)]

    hooks = []
    for m in mla_modules(model, attention):
        hooks.append(m.register_forward_pre_hook(before, with_kwargs=True))
        hooks.append(m.register_forward_hook(after, with_kwargs=True))
    times, attn = [], []
    for i, token in enumerate(tokens):
        spent[0] = 0.0
        t0 = time.perf_counter()
        step(model, cache, token)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            attn.append(spent[0])
    for h in hooks:
        h.remove()
    return statistics.median(times), statistics.median(attn)


def run_family(name: str, args) -> dict:
    model = build(name, DTYPES[args.dtype], args.context + args.steps + args.warmup + 1)
    cache = prefill(model, args.context, args.chunk, args.seed)
    tokens = torch.randint(1, 1024, (args.steps + args.warmup,), generator=torch.Generator().manual_seed(1))
    tokens = tokens.tolist()
    want = step(model, copy.deepcopy(cache), tokens[0])
    mlakit.hf.patch(model)
    got = step(model, copy.deepcopy(cache), tokens[0])
    mlakit.hf.unpatch(model)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    if not rel <= GATE_REL:
        raise SystemExit(f"{name}: gate failed, patched logits differ by {rel:.3g} (relative)")
    attention = BENCH[name][0]
    unpatched, unpatched_attn = median_step(model, cache, tokens, args.warmup, attention)
    mlakit.hf.patch(model)
    patched, patched_attn = median_step(model, cache, tokens, args.warmup, attention)
    return dict(
        family=name,
        attention=attention,
        context=args.context,
        mla_layers=len(mla_modules(model, attention)),
        unpatched_ms_per_token=1e3 * unpatched,
        patched_ms_per_token=1e3 * patched,
        speedup=unpatched / patched,
        unpatched_mla_ms_per_token=1e3 * unpatched_attn,
        patched_mla_ms_per_token=1e3 * patched_attn,
        mla_speedup=unpatched_attn / patched_attn,
        gate_rel_error=rel,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(BENCH), help="comma-separated ids (default: all)")
    p.add_argument("--context", type=int, default=3000, help="cached tokens before decoding (default 3000)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per backend (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk in tokens (default 1024)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--quick", action="store_true", help="3 timed steps, 1 warmup: a smoke run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows, machine and versions as JSON")
    args = p.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    unknown = [f for f in args.families if f not in BENCH]
    if unknown:
        p.error(f"--families: unknown {unknown}; expected some of {list(BENCH)}")
    if args.quick:
        args.steps, args.warmup = 3, 1
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.chunk < 1:
        p.error("context, steps and chunk must be >= 1, warmup >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    missing = sorted(set(mlakit.hf.SUPPORTED) - {v[0] for v in BENCH.values()})
    if missing:
        print(f"note: supported families without a benchmark entry: {missing}", file=sys.stderr)
    machine = machine_name()
    print(f"every supported family, {args.dtype}, hidden 512, 16 heads, latent 256, context {args.context}")
    print(f"on {machine}")
    print(
        f"{'family':<18} {'attention':<24} {'unpatched ms/tok':>17} {'patched ms/tok':>15} {'speedup':>8}"
        f" {'MLA layers ms/tok':>18} {'MLA speedup':>12}"
    )
    rows = []
    for name in args.families:
        assert FAMILIES[BENCH[name][0]].refused is None, name
        row = run_family(name, args)
        rows.append(row)
        print(
            f"{name:<18} {row['attention']:<24} {row['unpatched_ms_per_token']:>17.2f} "
            f"{row['patched_ms_per_token']:>15.2f} {row['speedup']:>7.1f}x "
            f"{row['unpatched_mla_ms_per_token']:>8.1f} →{row['patched_mla_ms_per_token']:>8.1f} "
            f"{row['mla_speedup']:>11.1f}x",
            flush=True,
        )
    if args.json:
        meta = dict(machine=machine, dtype=args.dtype, torch=torch.__version__, steps=args.steps)
        meta["transformers"] = transformers.__version__
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()

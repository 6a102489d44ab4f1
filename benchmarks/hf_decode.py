"""Decode speed of a tiny transformers DeepSeek-V3, unpatched vs `mlakit.hf.patch`, after a long prompt.

    PYTHONPATH=. python benchmarks/hf_decode.py                       # 3,000-token prompt
    PYTHONPATH=. python benchmarks/hf_decode.py --contexts 3000,8192,16384 --fill random

Unpatched transformers re-expands every cached latent through kv_b_proj at every step; patched, the
step attends over the latent itself (absorb). Each context is prefilled once (`--fill prefill`, in
chunks, by the patched model) or filled with random latents (`--fill random`: same cost per step,
no prefill wait); both backends then decode the same fixed tokens from that cache, cropped back to
the prompt before each run. A correctness gate compares one step's logits before any timing.
Prints the median seconds per decoded token; `--json PATH` writes the rows with the machine named.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

import mlakit.hf

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GATE_REL = 5e-2  # bf16 logits: both paths round differently, but never by this much


def build_model(dtype: torch.dtype, positions: int) -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=32,
        num_key_value_heads=32,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=positions,
        pad_token_id=0,
        eos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).to(dtype).eval()


def fill_cache(model, context: int, fill: str, chunk: int, seed: int) -> DynamicCache:
    """A cache holding `context` tokens: a real (patched, chunked) prefill or random latents."""
    cfg = model.config
    cache = DynamicCache(config=cfg)
    g = torch.Generator().manual_seed(seed)
    if fill == "random":
        dtype = model.dtype
        for layer in range(cfg.num_hidden_layers):
            c_kv = torch.randn(1, 1, context, cfg.kv_lora_rank, generator=g).to(dtype)
            k_pe = torch.randn(1, 1, context, cfg.qk_rope_head_dim, generator=g).to(dtype)
            cache.update(c_kv, k_pe, layer)
        return cache
    ids = torch.randint(1, cfg.vocab_size, (1, context), generator=g)
    mlakit.hf.patch(model)
    with torch.inference_mode():
        for start in range(0, context, chunk):
            model(ids[:, start : start + chunk], cache=cache, use_cache=True)
    mlakit.hf.unpatch(model)
    return cache


def reset(cache: DynamicCache, context: int) -> None:
    """Drop every token past the prompt (this transformers crops by a negative count to remove)."""
    extra = cache.get_seq_length() - context
    if extra > 0:
        cache.crop(-extra)


def step(model, cache, token: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1].float()


def decode_times(model, cache, context: int, tokens: list[int], warmup: int) -> list[float]:
    """Seconds of each decode step after `warmup` untimed ones, starting from `context` cached tokens."""
    reset(cache, context)
    times = []
    for i, token in enumerate(tokens):
        t0 = time.perf_counter()
        step(model, cache, token)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def gate(model, cache, context: int, tokens: list[int]) -> float:
    """Median relative difference of one step's logits, patched vs unpatched, over `tokens`.

    bf16 rounding can flip an MoE router's near-tie and so move one step's logits a lot; the median
    over three steps stays small unless the attention itself is wrong.
    """
    errors = []
    for token in tokens:
        reset(cache, context)
        want = step(model, cache, token)
        reset(cache, context)
        mlakit.hf.patch(model)
        got = step(model, cache, token)
        mlakit.hf.unpatch(model)
        errors.append(((got - want).abs().max() / want.abs().max()).item())
    rel = statistics.median(errors)
    if not rel <= GATE_REL:
        raise SystemExit(f"gate failed at context {context}: patched logits differ by {errors} (relative)")
    return rel


def run_context(model, context: int, args) -> dict:
    t0 = time.perf_counter()
    cache = fill_cache(model, context, args.fill, args.chunk, args.seed)
    fill_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(1, model.config.vocab_size, (args.steps + args.warmup,), generator=g).tolist()
    rel = gate(model, cache, context, tokens[:3])
    unpatched = statistics.median(decode_times(model, cache, context, tokens, args.warmup))
    mlakit.hf.patch(model)
    patched = statistics.median(decode_times(model, cache, context, tokens, args.warmup))
    mlakit.hf.unpatch(model)
    return dict(
        context=context,
        fill=args.fill,
        fill_s=round(fill_s, 2),
        unpatched_s_per_token=unpatched,
        patched_s_per_token=patched,
        speedup=unpatched / patched,
        gate_rel_error=rel,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="3000", help="comma-separated prompt lengths (default 3000)")
    p.add_argument("--fill", choices=("prefill", "random"), default="prefill", help="how the cache is filled")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per backend (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk in tokens (default 1024)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows, machine and versions as JSON")
    args = p.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",")]
    if min(args.contexts) < 1 or args.steps < 1 or args.warmup < 0 or args.chunk < 1:
        p.error("contexts, steps and chunk must be >= 1, warmup >= 0")
    return args


def machine_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(DTYPES[args.dtype], max(args.contexts) + args.steps + args.warmup + 1)
    machine = machine_name()
    print(f"tiny DeepSeek-V3 ({args.dtype}, hidden 512, 32 heads, latent 256, 2 layers) on {machine}")
    print(
        f"{'context':>8} {'fill':>8} {'unpatched ms/tok':>17} {'patched ms/tok':>15} "
        f"{'speedup':>8} {'gate':>9}"
    )
    rows = []
    for context in args.contexts:
        row = run_context(model, context, args)
        rows.append(row)
        print(
            f"{context:>8} {row['fill']:>8} {1e3 * row['unpatched_s_per_token']:>17.2f} "
            f"{1e3 * row['patched_s_per_token']:>15.2f} {row['speedup']:>7.1f}x {row['gate_rel_error']:>9.2e}"
        )
    if args.json:
        import transformers

        meta = dict(
            machine=machine,
            dtype=args.dtype,
            torch=torch.__version__,
            transformers=transformers.__version__,
            steps=args.steps,
        )
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()

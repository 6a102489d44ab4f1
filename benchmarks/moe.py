"""One MoE block of every served family at the demo model's widths: transformers' experts
implementations ("eager", "batched_mm", "grouped_mm": transformers 5.x's default when a model is built
without `experts_implementation`) against mlakit's GroupedMoE, printed, never asserted.

Each block is built from its family's config with mlakit.engine.demo.DEMO's MoE widths (hidden 1024,
8 routed experts of width 512, 2 per token, 1 shared expert), N(0, 0.02) weights; the router's
correction bias is drawn too so V3-style routing is not all ties. For every token count the hidden
states are random and every implementation runs the same input; the outputs are compared with the
"eager" one before any timing (max |diff| printed). "mlakit" is GroupedMoE on torch.mm, "packed"
the same with bf16 expert weights prepacked for oneDNN (GroupedMoE.pack), "released" a copy of the
block packed with its plain weights released (GroupedMoE.pack(release=True): what the engine's eager
CPU steps run; on CPUs with AVX512-BF16 and no AMX, mlakit's layout and the one-op `moe_experts`).
`batched_mm` gathers one
weight copy per (token, expert) pair and is skipped where that copy would pass `--batched-cap` GiB.
Times are the best of repeats taken round-robin over the implementations (at least 3, about
`--budget` seconds each): the machine may be shared, and the best run is the least disturbed.

    PYTHONPATH=. python benchmarks/moe.py [--tokens 1 8 32 128 2048] [--dtypes fp32 bf16]
        [--threads 1 2] [--families ...] [--impls eager batched_mm grouped_mm mlakit packed released]
        [--budget 0.6] [--json out.json]
    PYTHONPATH=. python benchmarks/moe.py --engine [--requests 32] [--prompt-len 128] [--out-len 32]

`--engine`: the demo model (bf16 where the CPU has native bf16) in the engine instead, one run per MoE:
GroupedMoE packed, GroupedMoE on torch.mm (what the runner installs), transformers' blocks (their
default experts implementation): output tokens/s and model seconds of the same greedy workload, and
how many requests' tokens equal the first run's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import time

import torch
import transformers

from mlakit.engine.demo import DEMO
from mlakit.engine.moe import GroupedMoE

# family -> (config class, MoE block module path, block class)
FAMILIES = {
    "deepseek-v2": ("DeepseekV2Config", "deepseek_v2.modeling_deepseek_v2", "DeepseekV2Moe"),
    "deepseek-v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
    "deepseek-v3.2": ("DeepseekV32Config", "deepseek_v32.modeling_deepseek_v32", "DeepseekV32MoE"),
    "glm-moe-dsa": ("GlmMoeDsaConfig", "glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaMoE"),
    "glm-4.7-flash": ("Glm4MoeLiteConfig", "glm4_moe_lite.modeling_glm4_moe_lite", "Glm4MoeLiteMoE"),
}
IMPLS = ["eager", "batched_mm", "grouped_mm", "mlakit", "packed", "released"]
OURS = ("mlakit", "packed", "released")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WIDTHS = (
    "hidden_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def isa() -> str:
    caps = torch._C._cpu._get_cpu_capability()
    if caps.get("amx_bf16"):
        return "AMX-BF16"
    if caps.get("avx512_bf16"):
        return "AVX512-BF16"
    return "AVX-512" if caps.get("avx512_f") else "AVX2"


def build_block(family: str, dtype: torch.dtype, seed: int = 0):
    """(transformers' MoE block of `family` at the demo widths, its config)."""
    import importlib

    config_cls, module, block_cls = FAMILIES[family]
    kw = {k: DEMO[k] for k in WIDTHS}
    config = getattr(transformers, config_cls)(**kw, n_group=1, topk_group=1, num_hidden_layers=2)
    config._experts_implementation = "eager"
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), block_cls)
    with torch.device("meta"):
        block = cls(config)
    block.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            t.normal_(0.0, 1e-3 if name.endswith("e_score_correction_bias") else 0.02, generator=g)
    return block.to(dtype).eval(), config


def timed(fns: dict, budget: float) -> dict:
    """Best seconds of each fn() over repeats taken round-robin (load drift hits all alike), about
    `budget` seconds per fn, 3 repeats at least."""
    first = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    reps = max(3, min(50, int(budget / max(max(first.values()), 1e-6))))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


def call(module, x, config=None, impl=None):
    """fn() running module(x), under transformers' experts implementation `impl` when given."""

    def fn():
        if impl is not None:
            config._experts_implementation = impl
        return module(x)

    return fn


def engine(args) -> None:
    import random

    from mlakit.engine import LLM, SamplingParams
    from mlakit.engine.moe import install_moe

    llm = LLM("demo", max_num_seqs=args.requests, max_num_batched_tokens=2048)
    eng = llm.llm_engine
    model = eng.runner.model
    print(
        f"# {cpu_name()} ({isa()}); demo model, {eng.runner.dtype}, {torch.get_num_threads()} threads; "
        f"{args.requests} requests of {args.prompt_len} tokens, {args.out_len} out, greedy; load average "
        + ", ".join(f"{v:.1f}" for v in os.getloadavg())
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 120000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    sp = SamplingParams(temperature=0, max_tokens=args.out_len, ignore_eos=True)
    first = None
    for name, impl, pack in [
        ("grouped, packed", "grouped", True),
        ("grouped, torch.mm", "grouped", False),
        ("transformers", "transformers", True),
        ("grouped, packed", "grouped", True),  # again: the first run's warm-up is in the first figure
    ]:
        install_moe(model, impl="transformers")
        install_moe(model, impl=impl, pack=pack)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm up
        eng.timings = dict.fromkeys(eng.timings, 0.0)
        t0 = time.perf_counter()
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        took = time.perf_counter() - t0
        first = first or outs
        same = sum(a == b for a, b in zip(outs, first, strict=True))
        print(
            f"{name:18s} {sum(map(len, outs)) / took:7.1f} output tok/s, {took:6.1f} s, model "
            f"{eng.timings['model']:6.1f} s; {same}/{len(outs)} requests token-identical to the first run",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 2048])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS)
    ap.add_argument("--budget", type=float, default=0.6, help="seconds of repeats per measurement")
    ap.add_argument("--batched-cap", type=float, default=1.0, help="GiB batched_mm may gather")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--engine", action="store_true", help="the demo model in the engine instead")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=32)
    args = ap.parse_args()
    if args.engine:
        torch.set_num_threads(args.threads[0])
        return engine(args)

    print(
        f"# {cpu_name()} ({isa()}), {os.cpu_count()} cores visible; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; load average "
        + ", ".join(f"{v:.1f}" for v in os.getloadavg())
    )
    print("# widths: " + ", ".join(f"{k}={DEMO[k]}" for k in WIDTHS))
    print("# ms per MoE block call (best of round-robin repeats), (max |diff| vs eager)")
    print(
        "# mlakit: GroupedMoE on torch.mm; packed: GroupedMoE with its bf16 experts prepacked for oneDNN; "
        "released: packed in place (the engine's CPU steps)"
    )
    print("# xS: fastest transformers implementation / fastest mlakit one; -: not run (fp32 / --batched-cap)")
    rows = []
    with torch.no_grad():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for dname in args.dtypes:
                dtype = DTYPES[dname]
                for family in args.families:
                    block, config = build_block(family, dtype)
                    grouped, packed = GroupedMoE(block), GroupedMoE(block)
                    has_packed = packed.pack()
                    released = GroupedMoE(copy.deepcopy(block))
                    has_released = released.pack(release=True)
                    width, inter = DEMO["hidden_size"], DEMO["moe_intermediate_size"]
                    per_pair = 3 * inter * width * block.experts.down_proj.element_size()
                    for n in args.tokens:
                        x = torch.randn(1, n, width, generator=torch.Generator().manual_seed(n)).to(dtype)
                        ref = call(block, x, config, "eager")()
                        row = dict(threads=threads, dtype=dname, family=family, tokens=n)
                        fns = {}
                        for impl in args.impls:
                            gathered = n * DEMO["num_experts_per_tok"] * per_pair
                            if impl == "batched_mm" and gathered > args.batched_cap * 2**30:
                                row[impl] = None  # one weight copy per (token, expert) pair
                                continue
                            if not {"packed": has_packed, "released": has_released}.get(impl, True):
                                row[impl] = None  # fp32, or no oneDNN: nothing to prepack
                                continue
                            ours = {"mlakit": grouped, "packed": packed, "released": released}
                            fns[impl] = call(ours[impl], x) if impl in ours else call(block, x, config, impl)
                            row[f"{impl}_diff"] = (fns[impl]().float() - ref.float()).abs().max().item()
                        row.update({k: v * 1e3 for k, v in timed(fns, args.budget).items()})
                        theirs = [row[i] for i in fns if i not in OURS]
                        mine = [row[i] for i in fns if i in OURS]
                        row["speedup"] = min(theirs) / min(mine) if theirs and mine else None
                        rows.append(row)
                        cells = "  ".join(
                            f"{i} {'  -' if row[i] is None else f'{row[i]:8.3f}'}"
                            + ("" if row[i] is None else f" ({row[f'{i}_diff']:.0e})")
                            for i in args.impls
                        )
                        sp = "" if row["speedup"] is None else f"  x{row['speedup']:.2f}"
                        print(f"t={threads} {dname} {family:14s} N={n:5d}  {cells}{sp}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_name(), isa=isa(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

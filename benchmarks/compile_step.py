"""A planned decode step, compiled vs eager, for every cache kind, printed, never asserted.

Tiny widths (hidden 64, 2 heads, latent 128: fp8's group, nope 8 / rope 4 / v 6), 4 layers, batch 4,
one new token per row over `--context` cached tokens. The step is the stack of four planned layer calls
(`layer(hidden, plan)` for each), the plan built once; eager and `torch.compile(fullgraph=True)`
(inductor unless `--backend`) run the same plan, and their outputs are compared before any timing.
`--profile KIND` prints torch.profiler's top ops of both for one kind.

    PYTHONPATH=. python benchmarks/compile_step.py [--context 64] [--threads 1] [--reps 30]
        [--kinds contiguous paged fp8 int8] [--backend inductor] [--profile fp8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.cache.paged import PagedLatentCache

CFG = MLAConfig(
    hidden_size=64,
    num_heads=2,
    q_lora_rank=32,
    kv_lora_rank=128,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    rope_interleave=True,
)
LAYERS, BATCH = 4, 4
KINDS = ["contiguous", "paged", "fp8", "int8"]


def layers() -> list[MLAAttention]:
    out = []
    for i in range(LAYERS):
        torch.manual_seed(10 + i)
        layer = MLAAttention(CFG, layer_idx=i).eval()
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() == 2:
                    p.normal_(0, p.shape[1] ** -0.5)
        out.append(layer)
    return out


def new_cache(kind: str, context: int):
    if kind == "contiguous":
        return LatentCache(CFG, BATCH, context + 64, num_layers=LAYERS)
    pages = BATCH * (-(-(context + 64) // 16)) + 8
    quant = None if kind == "paged" else kind
    cache = PagedLatentCache(CFG, pages, 16, max_batch=BATCH, num_layers=LAYERS, quant=quant)
    cache.blocks.shuffle(3)
    return cache


def run_stack(stack, hidden, plan):
    for layer in stack:
        hidden = layer(hidden, plan)
    return hidden


def prefilled(kind: str, stack, context: int):
    cache = new_cache(kind, context)
    with torch.no_grad():
        plan = cache.plan(context, batch=BATCH)
        run_stack(stack, torch.randn(BATCH, context, CFG.hidden_size), plan)
        cache.commit(plan)
    return cache


def timed(fn, reps: int) -> tuple[float, float]:
    """(min, median) ms over `reps` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[0], times[len(times) // 2]


def row(kind: str, context: int, reps: int, backend: str) -> dict:
    stack = layers()
    cache = prefilled(kind, stack, context)
    h = torch.randn(BATCH, 1, CFG.hidden_size)
    torch._dynamo.reset()
    compiled = torch.compile(run_stack, fullgraph=True, backend=backend)
    with torch.no_grad():
        plan = cache.plan(1, mode="absorb")  # not committed: every run writes the same rows
        want = run_stack(stack, h, plan)
        t0 = time.perf_counter()
        got = compiled(stack, h, plan)
        compile_s = time.perf_counter() - t0
        err = (got - want).abs().max().item() / want.abs().max().item()
        if err > 1e-4:
            raise SystemExit(f"{kind}: compiled step differs from eager by {err:.3g} (relative)")
        eager = timed(lambda: run_stack(stack, h, plan), reps)
        graph = timed(lambda: compiled(stack, h, plan), reps)
    return dict(
        kind=kind,
        context=context,
        eager_ms_min=eager[0],
        eager_ms_median=eager[1],
        compiled_ms_min=graph[0],
        compiled_ms_median=graph[1],
        compile_s=compile_s,
        rel_error=err,
    )


def profile(kind: str, context: int, backend: str, top: int = 12) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    stack = layers()
    cache = prefilled(kind, stack, context)
    h = torch.randn(BATCH, 1, CFG.hidden_size)
    compiled = torch.compile(run_stack, fullgraph=True, backend=backend)
    with torch.no_grad():
        plan = cache.plan(1, mode="absorb")
        for name, fn in (("eager", run_stack), ("compiled", compiled)):
            for _ in range(3):
                fn(stack, h, plan)
            with prof(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(10):
                    fn(stack, h, plan)
            print(f"--- {kind} {name}: 10 steps")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--profile", choices=KINDS)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        profile(args.profile, args.context, args.backend)
        return
    rows = [row(kind, args.context, args.reps, args.backend) for kind in args.kinds]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    machine = platform.processor() or platform.machine()
    print(f"{machine}, torch {torch.__version__}, {args.threads} thread(s), load {load}")
    print(f"{'kind':<11} {'eager ms (min/med)':>19} {'compiled ms (min/med)':>22} {'compile s':>10}")
    for r in rows:
        e = f"{r['eager_ms_min']:.3f}/{r['eager_ms_median']:.3f}"
        c = f"{r['compiled_ms_min']:.3f}/{r['compiled_ms_median']:.3f}"
        print(f"{r['kind']:<11} {e:>19} {c:>22} {r['compile_s']:>10.1f}")
    if args.json:
        meta = dict(machine=platform.processor(), torch=torch.__version__, threads=args.threads, load=load)
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

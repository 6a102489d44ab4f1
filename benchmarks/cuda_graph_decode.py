"""The planned decode step of an N-layer stack captured in one torch.cuda.CUDAGraph.

Per step: plan on the host (outside the graph), copy the plan's tensors into the static ones the graph
was captured with (`StepPlan.copy_from`), replay, `mark_replayed()` (the replay wrote every layer),
commit. Checks every replayed step against eager and prints per-step time eager vs graph. Without
CUDA it prints "skipped: no CUDA" and exits 0.

    PYTHONPATH=. python benchmarks/cuda_graph_decode.py [--layers 8] [--batch 8] [--context 1000]
"""

from __future__ import annotations

import argparse
import time

import torch

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.cache.paged import PagedLatentCache


def build(args, device):
    cfg = (
        MLAConfig.preset("deepseek-v3")
        if args.v3
        else MLAConfig(
            hidden_size=1024,
            num_heads=16,
            q_lora_rank=384,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        )
    )
    dtype = torch.bfloat16
    torch.manual_seed(0)
    layers = [MLAAttention(cfg, layer_idx=i, device=device, dtype=dtype).eval() for i in range(args.layers)]
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                if p.dim() == 2:
                    p.normal_(0, p.shape[1] ** -0.5)
    room = args.context + args.steps + 1
    if args.paged:
        blocks = args.batch * -(-room // 64)
        cache = PagedLatentCache(
            cfg, blocks, 64, max_batch=args.batch, num_layers=args.layers, dtype=dtype, device=device
        )
    else:
        cache = LatentCache(cfg, args.batch, room, num_layers=args.layers, dtype=dtype, device=device)
    plan = cache.plan(args.context, batch=args.batch)
    for i in range(args.layers):
        c = torch.randn(args.batch, args.context, cfg.kv_lora_rank, dtype=dtype, device=device)
        k = torch.randn(args.batch, args.context, cfg.qk_rope_head_dim, dtype=dtype, device=device)
        cache.write(plan, i, c, k)
    cache.commit(plan)
    return cfg, layers, cache


def run_stack(layers, h, plan):
    for layer in layers:
        h = layer(h, plan)
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--paged", action="store_true")
    ap.add_argument("--v3", action="store_true", help="DeepSeek-V3 widths (default: a 1024-wide model)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return
    device = torch.device("cuda")
    cfg, layers, cache = build(args, device)
    eager_cache = build(args, device)[2]
    h = torch.randn(args.batch, 1, cfg.hidden_size, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        static = cache.plan(1, mode="absorb")
        for _ in range(2):  # warm up on a side stream, as capture wants
            run_stack(layers, h, static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_stack(layers, h, static)
        cache.commit(static)
        first = eager_cache.plan(1, mode="absorb")  # the eager twin takes the captured step too
        run_stack(layers, h, first)
        eager_cache.commit(first)
        worst, t_graph, t_eager = 0.0, 0.0, 0.0
        for _ in range(args.steps):
            plan = cache.plan(1, mode="absorb")
            assert plan.key_len == static.key_len, "the context left the captured bucket"
            static.copy_from(plan)  # the graph reads the captured plan's tensors
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            static.mark_replayed()  # the replay wrote every layer's rows of `plan`'s step
            torch.cuda.synchronize()
            t_graph += time.perf_counter() - t0
            got = out.clone()
            cache.commit(plan)
            eplan = eager_cache.plan(1, mode="absorb")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            want = run_stack(layers, h, eplan)
            torch.cuda.synchronize()
            t_eager += time.perf_counter() - t0
            eager_cache.commit(eplan)
            worst = max(worst, ((got.float() - want.float()).abs().max() / want.float().abs().max()).item())
    n = args.steps
    print(
        f"{args.layers} layers, batch {args.batch}, context {args.context}+, "
        f"{'paged' if args.paged else 'contiguous'}"
    )
    print(
        f"eager {1e3 * t_eager / n:.3f} ms/step, CUDA graph {1e3 * t_graph / n:.3f} ms/step, "
        f"max rel diff {worst:.2e}"
    )
    if worst > 2e-2:
        raise SystemExit(f"graph replay differs from eager: {worst:.2e}")


if __name__ == "__main__":
    main()

"""Host cost of the page bookkeeping per decode step, printed, never asserted.

A paged cache at engine scale (tiny widths: the tensors are not what is timed), `--slots` slots
filled to `--context` tokens in pages of `--block-size`, then decode steps: `plan(1)` for every slot
(the pool hands out a page where a slot crosses a page boundary, under the undo journal), one layer's
`write`, `commit`. Prints µs per step (min and median over `--reps` runs of `--steps` steps) and the
same for the pool alone (`append(slot, 1)` for every slot under begin/end). Uses only the cache's
public protocol, so the same script times any version of the cache (run it with PYTHONPATH at each).

    PYTHONPATH=$PWD python benchmarks/block_pool.py [--slots 64] [--context 1000] [--block-size 16]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from mlakit import MLAConfig
from mlakit.cache.paged import PagedLatentCache

TINY = MLAConfig(
    hidden_size=64,
    num_heads=2,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)


def filled(args) -> PagedLatentCache:
    pages = args.slots * (-(-(args.context + args.steps * args.reps + 1) // args.block_size)) + 1
    cache = PagedLatentCache(TINY, pages, args.block_size, max_batch=args.slots)
    cache.blocks.shuffle(0)
    for s in range(args.slots):
        n = args.context
        cache.append(torch.zeros(1, n, 16), torch.zeros(1, n, 8), slots=[s])
    return cache


def decode_steps(cache, args) -> list[float]:
    c, k = torch.zeros(args.slots, 1, 16), torch.zeros(args.slots, 1, 8)
    out = []
    for _ in range(args.reps):
        t = time.perf_counter()
        for _ in range(args.steps):
            plan = cache.plan(1, mode="absorb")
            cache.write(plan, 0, c, k)
            cache.commit(plan)
        out.append((time.perf_counter() - t) / args.steps * 1e6)
    return out


def pool_steps(pool, args) -> list[float]:
    out = []
    for _ in range(args.reps):
        t = time.perf_counter()
        for _ in range(args.steps):
            pool.begin()
            for s in range(args.slots):
                pool.append(s, 1)
            pool.end()
        out.append((time.perf_counter() - t) / args.steps * 1e6)
    return out


def spread(us: list[float]) -> str:
    return f"min {min(us):.0f} µs, median {statistics.median(us):.0f} µs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)"
    )
    print(f"{args.slots} slots x {args.context} tokens, pages of {args.block_size}, ", end="")
    print(f"{args.steps} steps x {args.reps}")
    cache = filled(args)
    step = decode_steps(cache, args)
    print(f"decode step (plan + write + commit): {spread(step)}")
    if hasattr(cache.blocks, "begin"):
        fresh = filled(args)
        alone = pool_steps(fresh.blocks, args)
        print(f"pool alone (append 1 per slot):      {spread(alone)}")


if __name__ == "__main__":
    main()

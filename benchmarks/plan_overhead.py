"""Per-step bookkeeping before and after step plans, printed, never asserted.

1. The tiny shape (decode, batch 4, 1 new token, hidden 64 / 2 heads / latent 16, 64 cached,
   mode absorb): aten ops and wall time per layer call, the one-layer call (plans, runs and commits
   inside) vs a planned layer call, eager and compiled (under no_grad), and eager under grad mode,
   for both caches.
2. DeepSeek-V3 widths in bf16, a 4-layer stack, batch 8, 4K cached: time per decode step, one plan
   for the stack vs per-layer one-layer calls (`--quick`: 2 layers, batch 2, 1K cached).

    PYTHONPATH=. python benchmarks/plan_overhead.py [--quick] [--ops N] [--threads T] [--reps R]
        [--stack-reps R] [--json out.json]

`--ops N` prints the N most frequent aten ops of each counted call; ms/call is the minimum over
`--reps` timed runs (the least-disturbed one on a loaded machine; the median is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlakit import LatentCache, MLAAttention, MLAConfig
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


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.non_view = 0  # ops that are not views of their input (what computes or copies)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        self.non_view += not func.is_view
        return func(*args, **(kwargs or {}))


def new_cache(kind: str, cfg: MLAConfig, batch: int, context: int, layers: int, dtype):
    if kind == "contiguous":
        return LatentCache(cfg, batch, context + 64, num_layers=layers, dtype=dtype)
    blocks = batch * (-(-(context + 64) // 64))
    return PagedLatentCache(cfg, blocks, 64, max_batch=batch, num_layers=layers, dtype=dtype)


def seeded_layer(cfg: MLAConfig, idx: int, dtype) -> MLAAttention:
    torch.manual_seed(idx)
    layer = MLAAttention(cfg, layer_idx=idx, dtype=dtype).eval()
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    return layer


def fill(cache, layers, batch: int, context: int, dtype):
    """`context` cached tokens in every slot and layer (random latents, written through a plan)."""
    cfg = cache.cfg
    plan = cache.plan(context, batch=batch)
    for layer in range(cache.num_layers):
        c = torch.randn(batch, context, cfg.kv_lora_rank, dtype=dtype)
        k = torch.randn(batch, context, cfg.qk_rope_head_dim, dtype=dtype)
        cache.write(plan, layer, c, k)
    cache.commit(plan)


def timed(fn, reps: int, stat: str = "median") -> float:
    """Median (or minimum) seconds of `fn()` over `reps` runs (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0] if stat == "min" else times[len(times) // 2]


def tiny_rows(kind: str, reps: int) -> list[dict]:
    layer = seeded_layer(TINY, 0, torch.float32)
    cache = new_cache(kind, TINY, 4, 64, 1, torch.float32)
    fill(cache, [layer], 4, 64, torch.float32)
    h = torch.randn(4, 1, TINY.hidden_size)

    def one_layer_call():
        layer(h, cache, mode="absorb")
        cache.lengths[:] = 64

    rows = []
    with torch.no_grad():
        rows.append(measure(kind, "one-layer call", one_layer_call, reps, extra_ops=1))  # the reset
        plan = cache.plan(1, mode="absorb")
        rows.append(measure(kind, "planned", lambda: layer(h, plan), reps))
        compiled = torch.compile(lambda x, p: layer(x, p), fullgraph=True)
        # a TorchDispatchMode cannot run around a compiled frame: wall time only
        rows.append(measure(kind, "planned, compiled", lambda: compiled(h, plan), reps, count=False))
    with torch.enable_grad():  # how the original table was measured: autograd records the call
        rows.append(measure(kind, "planned, grad mode", lambda: layer(h, plan), reps))
    return rows


def measure(kind: str, name: str, fn, reps: int, extra_ops: int = 0, count: bool = True) -> dict:
    fn()
    counter = OpCounter()
    if count:
        with counter:
            fn()
    ops = sum(counter.ops.values()) - extra_ops if count else None
    times = [timed(fn, reps, "min"), timed(fn, reps)]
    return {
        "cache": kind,
        "call": name,
        "aten_ops": ops,
        "non_view_ops": counter.non_view if count else None,
        "ms": 1e3 * times[0],
        "median_ms": 1e3 * times[1],
        "ops": dict(counter.ops),
    }


def stack_step_times(cfg, layers_n: int, batch: int, context: int, reps: int) -> dict:
    dtype = torch.bfloat16
    layers = [seeded_layer(cfg, i, dtype) for i in range(layers_n)]
    shared = new_cache("contiguous", cfg, batch, context, layers_n, dtype)
    fill(shared, layers, batch, context, dtype)
    own = []
    for _ in layers:
        c = new_cache("contiguous", cfg, batch, context, 1, dtype)
        fill(c, None, batch, context, dtype)
        own.append(c)
    h0 = torch.randn(batch, 1, cfg.hidden_size, dtype=dtype)

    def planned():
        plan = shared.plan(1, batch=batch)
        h = h0
        for layer in layers:
            h = layer(h, plan)
        shared.discard(plan)  # the same context every repetition

    def per_layer():
        h = h0
        for layer, cache in zip(layers, own, strict=True):
            idx, layer.layer_idx = layer.layer_idx, 0
            h = layer(h, cache)
            layer.layer_idx = idx
            cache.lengths[:] = context

    with torch.no_grad():
        planned(), per_layer()  # warm-up
        times = {"planned": [], "per_layer": []}
        for _ in range(reps):  # alternated, so that a busy spell of a shared machine hits both
            for name, fn in (("planned", planned), ("per_layer", per_layer)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[f"{name}_ms"] = 1e3 * ts[len(ts) // 2]
        out[f"{name}_min_ms"] = 1e3 * ts[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="a smaller DeepSeek-V3 stack (2 layers, batch 2, 1K)"
    )
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--ops", type=int, default=0, help="print the N most frequent aten ops of each call")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (1 on a loaded machine)")
    ap.add_argument("--reps", type=int, default=50, help="timed runs per tiny call (default 50)")
    ap.add_argument("--stack-reps", type=int, default=5, help="DeepSeek-V3 steps of each kind (5)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = tiny_rows("contiguous", args.reps) + tiny_rows("paged", args.reps)
    print(f"{'cache':<11} {'call':<19} {'aten ops':>8} {'non-view':>8} {'min ms':>8} {'med ms':>8}")
    for r in rows:
        ops = "-" if r["aten_ops"] is None else r["aten_ops"]
        nv = "-" if r["non_view_ops"] is None else r["non_view_ops"]
        print(f"{r['cache']:<11} {r['call']:<19} {ops:>8} {nv:>8} {r['ms']:>8.3f} {r['median_ms']:>8.3f}")
        if args.ops and r["aten_ops"] is not None:
            top = Counter(r["ops"]).most_common(args.ops)
            print("    " + ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in top))
    layers_n, batch, context = (2, 2, 1024) if args.quick else (4, 8, 4096)
    v3 = MLAConfig.preset("deepseek-v3")
    step = stack_step_times(v3, layers_n, batch, context, 3 if args.quick else args.stack_reps)
    print(
        f"DeepSeek-V3 widths, bf16, {layers_n} layers, batch {batch}, {context} cached, per step "
        f"(median / min of {3 if args.quick else args.stack_reps}, alternated): planned "
        f"{step['planned_ms']:.0f} / {step['planned_min_ms']:.0f} ms, per-layer calls "
        f"{step['per_layer_ms']:.0f} / {step['per_layer_min_ms']:.0f} ms"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"tiny": rows, "stack": {"layers": layers_n, "batch": batch, "context": context, **step}}, f
            )


if __name__ == "__main__":
    main()

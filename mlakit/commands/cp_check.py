"""mlakit cp-check: a preset's layer run context-parallel on N local gloo processes against one process.

Every rank builds the same fp32 layer (seeded), prefills `--context` tokens in chunks and decodes;
rank 0 then runs the single-process layer on the same inputs. A full-width layer is large (DeepSeek-V3:
~190M parameters, ~0.75 GB in fp32, held by every rank), so the default context is short.
"""

from __future__ import annotations

import os
import time

from mlakit.commands import emit_json, plural
from mlakit.commands.args import check_memory, count_type, resolve_model
from mlakit.commands.memory import cp_check_bytes
from mlakit.commands.ranks import DEFAULT_BLOCK_SIZE
from mlakit.config import MLAConfig

MAX_WORLD_SIZE = 64
MAX_CONTEXT = 1 << 20  # tokens one check fills; every rank also holds the whole prompt


def register(sub) -> None:
    p = sub.add_parser(
        "cp-check",
        help="run a preset's layer context-parallel on N local gloo processes; compare with one process",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=2,
        help=f"local processes, 1..{MAX_WORLD_SIZE} and as memory allows (2)",
    )
    p.add_argument("--model", default="deepseek-v3", help="preset name, config.json or model folder")
    p.add_argument(
        "--context",
        type=count_type("context", 1, MAX_CONTEXT),
        default=256,
        help="prompt tokens, 1K = 1024 (256)",
    )
    p.add_argument(
        "--decode-steps",
        type=count_type("decode-steps", 0, 4096),
        default=4,
        help="decode steps after it (4)",
    )
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per placement block")
    p.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens per forward call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def check_args(args) -> MLAConfig:
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"--world-size must be in 1..{MAX_WORLD_SIZE}, got {args.world_size}")
    for name, low in (("context", 1), ("decode_steps", 0), ("block_size", 1), ("prefill_chunk", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if not 0 < args.timeout < 1e6:
        raise ValueError(f"--timeout must be > 0 seconds (and under 1e6), got {args.timeout}")
    cfg = resolve_model(args.model, "cp-check")
    need = cp_check_bytes(cfg, args.world_size, args.context, args.decode_steps, args.prefill_chunk)
    what = f"{plural(args.world_size, 'rank')} of a full {cfg.name} layer at context {args.context:,}"
    check_memory(need, what, "--world-size or --context")
    if args.world_size > (os.cpu_count() or 1) * 8:
        raise ValueError(
            f"--world-size {args.world_size} is over 8 processes per core ({os.cpu_count()} cores)"
        )
    return cfg


def inputs(cfg: MLAConfig, context: int, steps: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randn(1, context, cfg.hidden_size, generator=gen)
    return prompt, [torch.randn(1, 1, cfg.hidden_size, generator=gen) for _ in range(steps)]


def rank_check(model: str, context: int, steps: int, block_size: int, chunk: int, seed: int) -> dict:
    """One rank's part (runs in each spawned process): CP outputs, its cache; rank 0 adds the reference."""
    import torch

    from mlakit.attention import MLAAttention
    from mlakit.cache.contiguous import LatentCache
    from mlakit.distributed import ContextParallelMLA

    cfg = MLAConfig.resolve(model)
    torch.manual_seed(seed)
    layer = MLAAttention(cfg).eval()
    prompt, steps_in = inputs(cfg, context, steps, seed)
    cp = ContextParallelMLA(layer, block_size=block_size)
    cache = cp.new_cache(1, context + steps)
    with torch.inference_mode():
        t0 = time.perf_counter()
        got = [torch.cat([cp(prompt[:, a : a + chunk], cache) for a in range(0, context, chunk)], dim=1)]
        t1 = time.perf_counter()
        got += [cp(x, cache) for x in steps_in]
        t2 = time.perf_counter()
    rank = cp.placement.rank
    result = {"rank": rank, "cache_bytes": cache.held_bytes(), "tokens": int(cache.local.lengths.sum())}
    result["cp_prefill_ms"] = (t1 - t0) * 1e3
    result["cp_decode_ms_per_step"] = (t2 - t1) * 1e3 / max(1, steps)
    if rank == 0:
        ref_cache = LatentCache(cfg, 1, context + steps)
        with torch.inference_mode():
            want = [layer(prompt, ref_cache)] + [layer(x, ref_cache) for x in steps_in]
        result["max_rel_err"] = rel_err(got, want)
        result["single_rank_cache_bytes"] = int(ref_cache.lengths.sum()) * ref_cache.bytes_per_token
    return result


def rel_err(got: list, want: list) -> float:
    num = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    return num / max(max(float(w.abs().max()) for w in want), 1e-30)


def run(args) -> int:
    from mlakit.distributed import launch_local, per_rank_cache_bytes

    cfg = check_args(args)
    t0 = time.perf_counter()
    ranks = launch_local(
        rank_check,
        args.world_size,
        (args.model, args.context, args.decode_steps, args.block_size, args.prefill_chunk, args.seed),
        timeout_s=args.timeout,
        deadline_s=max(600.0, 4 * args.timeout),
    )
    total = args.context + args.decode_steps
    result = {
        "model": cfg.name,
        "dtype": "fp32",
        "world_size": args.world_size,
        "context": args.context,
        "decode_steps": args.decode_steps,
        "block_size": args.block_size,
        "prefill_chunk": args.prefill_chunk,
        "max_rel_err": ranks[0]["max_rel_err"],
        "per_rank_cache_bytes": [r["cache_bytes"] for r in ranks],
        "per_rank_tokens": [r["tokens"] for r in ranks],
        "predicted_per_rank_cache_bytes": per_rank_cache_bytes(
            cfg, total, 4, cp=args.world_size, block_size=args.block_size, layers=1
        ),
        "single_rank_cache_bytes": ranks[0]["single_rank_cache_bytes"],
        "cp_decode_ms_per_step": ranks[0]["cp_decode_ms_per_step"],
        "wall_s": time.perf_counter() - t0,
    }
    if args.json:
        emit_json(result)
        return 0
    print_text(result)
    return 0


def print_text(r: dict) -> None:
    print(
        f"{r['model']}: {r['world_size']} gloo ranks, context {r['context']} + {r['decode_steps']} decode "
        f"steps, blocks of {r['block_size']}, fp32, one layer"
    )
    print(f"max |cp - single| / max |single| = {r['max_rel_err']:.2e}")
    print(f"{'rank':>4} {'tokens':>7} {'cache bytes':>12}")
    for i, (tokens, size) in enumerate(zip(r["per_rank_tokens"], r["per_rank_cache_bytes"], strict=True)):
        print(f"{i:>4} {tokens:>7} {size:>12}")
    print(f"single process: {r['single_rank_cache_bytes']} bytes; wall {r['wall_s']:.1f} s")

"""Absorbed decode over a paged cache vs the contiguous cache (DeepSeek-V3 widths, 8K context, batch 8).

Times what differs between the two: reading the context (`cache.view`: a slice for the contiguous
cache; a gather of pages, plus dequantization for fp8/int8) and the absorb op on it. Variants run
interleaved, repeat after repeat, so that the load of a shared machine hits them alike; the median,
min and max are printed. Checks paged == contiguous before timing.

    PYTHONPATH=$PWD python benchmarks/paged_decode.py                  # bf16, the target's dtype
    PYTHONPATH=$PWD python benchmarks/paged_decode.py --dtype fp32 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from mlakit import LatentCache, MLAConfig
from mlakit.cache.paged import PagedLatentCache
from mlakit.ops import absorb
from mlakit.ops.paged import DEFAULT_CHUNK_TOKENS, absorb_chunked

WIDTHS = (26, 8, 11, 10, 9, 9, 9, 10, 10)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--quants", default="none,fp8,int8", help="paged formats to time, comma-separated")
    p.add_argument(
        "--chunk", type=int, default=DEFAULT_CHUNK_TOKENS, help="chunk_tokens of the chunked variant"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def make_inputs(cfg: MLAConfig, batch: int, context: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    h, dn, dr, dv, lat = (
        cfg.num_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    latent = rnd(batch, context, lat)  # ~ a normalized latent: unit RMS
    return {
        "q_nope": rnd(batch, 1, h, dn),
        "q_pe": rnd(batch, 1, h, dr),
        "c_kv": latent,
        "k_pe": rnd(batch, context, dr),
        "w_uk": rnd(h, dn, lat, scale=lat**-0.5),
        "w_uv": rnd(h, dv, lat, scale=lat**-0.5),
    }


def fill_paged(cfg, x, block_size, dtype, quant) -> PagedLatentCache:
    """Every slot's pages scattered over the pool: shuffled free list, slots appended in turns."""
    batch, context, _ = x["c_kv"].shape
    cache = PagedLatentCache(
        cfg, batch * -(-context // block_size), block_size, max_batch=batch, dtype=dtype, quant=quant
    )
    cache.blocks.shuffle(0)
    step = 4 * block_size
    for start in range(0, context, step):
        stop = min(context, start + step)
        cache.append(x["c_kv"][:, start:stop], x["k_pe"][:, start:stop])
    return cache


def decode_fns(cache, x, cfg, chunk_tokens: int) -> dict:
    """{"": view + absorb, " chunked": absorb over pages read chunk by chunk (paged only)}."""
    batch = x["q_nope"].shape[0]
    slots = torch.arange(batch)
    lens = cache.lengths[slots].clone()
    q, w = (x["q_nope"], x["q_pe"]), (x["w_uk"], x["w_uv"])

    def gathered():
        c_kv, k_pe = cache.view(slots, int(lens.max()))
        return absorb(*q, c_kv, k_pe, lens, *w, cfg.softmax_scale)[0]

    def chunked():
        read = cache.reader(slots, int(lens.max()))
        return absorb_chunked(*q, read, lens, *w, cfg.softmax_scale, chunk_tokens=chunk_tokens)[0]

    return {"": gathered} | ({" chunked": chunked} if isinstance(cache, PagedLatentCache) else {})


def check(fns: dict, dtype: str) -> dict[str, tuple[float, float]]:
    """(max |err| / max |want|, ||err|| / ||want||) of each variant against the contiguous one."""
    want = fns["contiguous"]().float()
    errors = {}
    for name, fn in fns.items():
        err = fn().float() - want
        errors[name] = ((err.abs().max() / want.abs().max()).item(), (err.norm() / want.norm()).item())
    # unquantized pages: the same numbers up to the summation order of the chunked merge
    exact = [e[0] for name, e in errors.items() if name.startswith(f"paged-{dtype}")]
    if max(exact, default=0.0) > (1e-5 if dtype == "fp32" else 2e-2):
        raise SystemExit(f"paged output differs from contiguous: relative errors {exact}")
    return errors


def time_interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Run every variant once per repeat, in turn (check() has already run each once: the warm-up)."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def summary(ts: list[float]) -> dict:
    med = statistics.median(ts)
    return {
        "median_ms": 1e3 * med,
        "min_ms": 1e3 * min(ts),
        "max_ms": 1e3 * max(ts),
        "noise": (max(ts) - min(ts)) / med,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = MLAConfig.resolve(args.model)
    dtype = DTYPES[args.dtype]
    quants = [None if q == "none" else q for q in args.quants.split(",")]
    x = make_inputs(cfg, args.batch, args.context, dtype)
    contiguous = LatentCache(cfg, args.batch, args.context, dtype=dtype)
    contiguous.append(x["c_kv"], x["k_pe"])
    caches = {"contiguous": contiguous} | {
        f"paged-{q or args.dtype}": fill_paged(cfg, x, args.block_size, dtype, q) for q in quants
    }
    fns = {
        f"{n}{kind}": fn for n, c in caches.items() for kind, fn in decode_fns(c, x, cfg, args.chunk).items()
    }
    errors = check(fns, args.dtype)
    slots = torch.arange(args.batch)
    views = {f"{n} view": (lambda c=c: c.view(slots, args.context)) for n, c in caches.items()}
    times = {name: summary(ts) for name, ts in time_interleaved(fns | views, args.repeats).items()}
    print_report(args, caches, fns, times, errors)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"args": vars(args), "machine": machine(), "times": times, "errors": errors}, f, indent=1
            )


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def print_report(args, caches, fns, times, errors) -> None:
    print(
        f"{args.model}: batch {args.batch}, context {args.context}, {args.dtype}, block {args.block_size}, "
        f"chunk {args.chunk}, {args.repeats} repeats, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    base = times["contiguous"]["median_ms"]
    head = (
        "variant",
        "B/token",
        "median ms",
        "vs contig",
        "min ms",
        "max ms",
        "view ms",
        "max rel",
        "norm rel",
    )
    print(
        "".join(f"{h:>{w}}" if i else f"{h:<26}" for i, (h, w) in enumerate(zip(head, WIDTHS, strict=True)))
    )
    for name in fns:
        cache = caches[name.split(" ")[0]]
        t, v = times[name], times[f"{name.split(' ')[0]} view"]
        print(
            f"{name:<26}{cache.bytes_per_token:>8}{t['median_ms']:>11.1f}{t['median_ms'] / base:>9.3f}x"
            f"{t['min_ms']:>9.1f}{t['max_ms']:>9.1f}{v['median_ms']:>9.1f}{errors[name][0]:>10.2e}{errors[name][1]:>10.2e}"
        )
    print("view: reading the whole context (contiguous: a slice; paged: gather + dequantize)")
    print("chunked: absorb over pages read --chunk tokens at a time (mlakit.ops.paged), no full gather")


if __name__ == "__main__":
    main()

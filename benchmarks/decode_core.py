"""Absorbed decode at DeepSeek-V3 widths: the attention core against the machine's measured peaks.

For each (batch, cached) case: time the whole absorbed decode step of one layer, time its four
projections alone on the same inputs, and call the difference the attention core. Its FLOPs are
counted term by term (mlakit.cost) and compared with the machine's matmul rates measured in the same
run; the whole step is compared with its roofline (projection weights read at the measured memory
rate, the core at the matmul rate). Peak RSS growth of the step is reported too.

    python benchmarks/decode_core.py [--dtype bf16] [--cases 1x32768,8x8192] [--repeats 7] [--threads N]

Peaks and steps are measured with the same threads in the same run. On a shared machine, OpenMP
threads that get preempted stall every parallel op for a scheduler slice: --threads 1 then gives the
honest per-core figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.cost import absorb_macs
from mlakit.ops.common import compute_dtype

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def timed(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def matmul_rate(dtype: torch.dtype, n: int, repeats: int) -> float:
    """FLOP/s of an n×n×n matmul in `dtype` (best of repeats)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / min(timed(lambda: a @ b, repeats))


def read_rate(repeats: int) -> float:
    """Bytes/s of a sum over 512 MB (memory read rate)."""
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    return x.numel() * 4 / min(timed(lambda: x.sum(), repeats))


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def projections(layer: MLAAttention, x: torch.Tensor) -> None:
    layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    latent = layer.kv_a_proj_with_mqa(x)
    o_in = torch.zeros(*x.shape[:2], layer.o_proj.in_features, dtype=x.dtype)
    layer.o_proj(o_in)
    return latent


def projection_bytes(layer: MLAAttention) -> int:
    mods = (layer.q_a_proj, layer.q_b_proj, layer.kv_a_proj_with_mqa, layer.o_proj)
    return sum(m.weight.numel() * m.weight.element_size() for m in mods)


def run_case(layer, cfg, dtype, batch, cached, repeats, rates):
    cache = LatentCache(cfg, batch, cached + 1, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    cache.append(
        torch.randn(batch, cached, cfg.kv_lora_rank, generator=g).to(dtype),
        torch.randn(batch, cached, cfg.qk_rope_head_dim, generator=g).to(dtype),
    )
    x = torch.randn(batch, 1, cfg.hidden_size, generator=g).to(dtype)

    def step():
        layer(x, cache, mode="absorb")
        cache.lengths -= 1

    with torch.inference_mode():
        step()  # derives the up-projection weights once, outside the peak measured below
        reset_peak_rss()
        rss0 = peak_rss()
        step_s = timed(step, repeats)
        rss_growth = peak_rss() - rss0
        proj_s = timed(lambda: projections(layer, x), repeats)
    step_med, proj_med = statistics.median(step_s), statistics.median(proj_s)
    core_s = max(step_med - proj_med, 1e-9)
    macs = absorb_macs(cfg, 1, cached + 1)
    core_flops = 2 * batch * sum(macs.values())
    rate = rates["matmul_flops_compute"]
    roof = projection_bytes(layer) / rates["read_bytes"] + core_flops / rate
    return {
        "batch": batch,
        "cached": cached,
        "step_ms": step_med * 1e3,
        "step_ms_min": min(step_s) * 1e3,
        "projections_ms": proj_med * 1e3,
        "core_ms": core_s * 1e3,
        "core_gflops": core_flops / 1e9,
        "core_gflop_per_s": core_flops / core_s / 1e9,
        "core_pct_of_dtype_matmul": 100 * core_flops / core_s / rates["matmul_flops_dtype"],
        "core_pct_of_compute_matmul": 100 * core_flops / core_s / rate,
        "step_pct_of_roofline": 100 * roof / step_med,
        "peak_rss_growth_mb": rss_growth / 2**20,
        "macs_terms": macs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--cases", default="1x32768,8x8192", help="batch x cached, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument(
        "--threads", type=int, help="torch threads (default: torch's); 1 is robust on a shared machine"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    cd = compute_dtype(dtype, "cpu")
    cfg = MLAConfig.preset("deepseek-v3")
    torch.manual_seed(0)
    layer = MLAAttention(cfg, dtype=dtype).eval()
    rates = {
        "matmul_flops_dtype": matmul_rate(dtype, 1024 if dtype != torch.float32 else 2048, 3),
        "matmul_flops_compute": matmul_rate(cd, 2048, 5),
        "read_bytes": read_rate(5),
    }
    cores, threads = os.cpu_count(), torch.get_num_threads()
    machine = f"{platform.processor() or platform.machine()}, {cores} cores, {threads} threads"
    print(f"mlakit decode core, DeepSeek-V3 widths, {args.dtype} storage, {cd} compute")
    print(f"torch {torch.__version__}")
    print(f"machine: {machine}")
    print(
        f"measured: {args.dtype} matmul {rates['matmul_flops_dtype'] / 1e9:.1f} GFLOP/s, "
        f"{cd} matmul {rates['matmul_flops_compute'] / 1e9:.1f} GFLOP/s, "
        f"read {rates['read_bytes'] / 1e9:.1f} GB/s"
    )
    rows = []
    for case in args.cases.split(","):
        batch, cached = (int(v) for v in case.lower().split("x"))
        r = run_case(layer, cfg, dtype, batch, cached, args.repeats, rates)
        rows.append(r)
        print(
            f"B{batch} T{cached}: step {r['step_ms']:.1f} ms (min {r['step_ms_min']:.1f}), projections "
            f"{r['projections_ms']:.1f} ms, core {r['core_ms']:.1f} ms = {r['core_gflop_per_s']:.1f} GFLOP/s "
            f"({r['core_pct_of_compute_matmul']:.0f}% of {cd} matmul, "
            f"{r['core_pct_of_dtype_matmul']:.0f}% of {args.dtype} matmul); "
            f"step at {r['step_pct_of_roofline']:.0f}% of roofline; "
            f"peak RSS +{r['peak_rss_growth_mb']:.0f} MB"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine, "rates": rates, "rows": rows, "torch": torch.__version__}, f, indent=2
            )


if __name__ == "__main__":
    main()

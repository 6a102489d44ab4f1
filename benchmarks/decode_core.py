"""Absorbed decode at DeepSeek-V3 widths: the attention core in its forms, the whole step and its
projections, against the machine's GEMM and read rates measured in the same run.

1. GEMM rates: square 2048 and 4096 matmuls in bf16 and fp32; the read rate (a sum over 512 MB).
2. The core (`mlakit.bench.cores`): new (what absorb runs: the fused CPU core where it can), the torch
   core, the old core (before the fused one) and the plain three-op form, as GFLOP/s and % of the GEMM
   rate of the dtype each multiplies in, with the speedups.
3. The whole absorbed decode step of one layer and its four projections alone, against the time to
   read their weights at the measured rate. Peak RSS growth of the step too.

    python benchmarks/decode_core.py [--dtype bf16] [--cases 1x32768,8x8192] [--repeats 7] [--threads 1]

Times: CPU time of the process (min of repeats) and wall time (median). On a shared machine use
--threads 1: the CPU time is then the honest per-core figure (a preempted process is not charged).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.bench import cores
from mlakit.bench.results import _cpu_name
from mlakit.ops.cpu_core import cpu_has_bf16, describe

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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


def step_case(layer, cfg, dtype, batch, cached, repeats, read_gbs) -> dict:
    """The whole decode step of one layer and its projections alone (CPU ms) vs the weights' read time."""
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
        step_t = cores.timed(step, repeats)
        rss_growth = peak_rss() - rss0
        proj_t = cores.timed(lambda: projections(layer, x), repeats)
    read_ms = projection_bytes(layer) / read_gbs / 1e6
    return {
        "batch": batch,
        "cached": cached,
        "step": step_t,
        "projections": proj_t,
        "weights_read_ms": read_ms,
        "projections_vs_read": proj_t["cpu_ms"] / read_ms,
        "peak_rss_growth_mb": rss_growth / 2**20,
    }


def machine_line(threads: int) -> str:
    caps = torch._C._cpu._get_cpu_capability()
    isa = (
        "AMX-BF16"
        if caps.get("amx_bf16")
        else "AVX512-BF16"
        if cpu_has_bf16()
        else ("AVX-512, no BF16" if caps.get("avx512_f") else "AVX2")
    )
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return f"{_cpu_name()} ({isa}), {os.cpu_count()} cores, {threads} threads; load average {load}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--cases", default="1x32768,8x8192", help="batch x cached, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--no-step", action="store_true", help="the core only (no layer step, no projections)")
    ap.add_argument(
        "--threads", type=int, help="torch threads (default: torch's); 1 is robust on a shared machine"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    core, note = describe(dtype, "cpu")
    machine = machine_line(torch.get_num_threads())
    print(f"mlakit decode core, DeepSeek-V3 widths, {args.dtype} storage; torch {torch.__version__}")
    print(f"machine: {machine}")
    print(f"decode core: {core}" + (f" ({note})" if note else ""))
    rates = cores.gemm_rates(args.repeats)
    read_gbs = cores.read_rate(args.repeats)
    print(
        "GEMM rates (GFLOP/s, CPU time): "
        + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in rates.items())
        + f"; read {read_gbs:.1f} GB/s"
    )
    doc = {"machine": machine, "core": core, "core_note": note, "gemm_gflop_per_s": rates}
    doc.update({"read_gb_per_s": read_gbs, "torch": torch.__version__, "core_rows": [], "step_rows": []})
    cases = [tuple(int(v) for v in c.lower().split("x")) for c in args.cases.split(",")]
    for batch, cached in cases:
        r = cores.core_case(batch, cached, rates, args.repeats, dtype)
        doc["core_rows"].append(r)
        print("core " + cores.case_line(r))
    if not args.no_step:
        cfg = MLAConfig.preset("deepseek-v3")
        torch.manual_seed(0)
        layer = MLAAttention(cfg, dtype=dtype).eval()
        for batch, cached in cases:
            r = step_case(layer, cfg, dtype, batch, cached, args.repeats, read_gbs)
            doc["step_rows"].append(r)
            print(
                f"step B{batch} T{cached}: {r['step']['cpu_ms']:.1f} ms CPU (wall median "
                f"{r['step']['wall_ms']:.1f}); projections {r['projections']['cpu_ms']:.1f} ms = "
                f"{r['projections_vs_read']:.2f}x their weights' read time ({r['weights_read_ms']:.1f} ms); "
                f"peak RSS +{r['peak_rss_growth_mb']:.0f} MB"
            )
    print(f"load average after: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()

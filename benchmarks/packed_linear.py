"""The engine's bf16 linears, GF/s per route at the demo model's widths, printed, never asserted.

Routes: `F.linear` (torch's bf16 GEMM: oneDNN reorders the weight at every call), `mlakit.Linear`
(its few-row fused product up to 4 rows), `packed` (the weight prepacked once: PackedLinear, what the
engine's eager steps run), `fp32` (packed weight unpacked and converted at the call, then MKL's fp32
GEMM: what PackedLinear does from `upcast_rows()` rows). Also prints what this CPU's probe answers.

    python benchmarks/packed_linear.py [--threads 1] [--rows 1,4,8,32,128,512,1024] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

import torch
import torch.nn.functional as F

from mlakit.engine import packed
from mlakit.engine.demo import DEMO
from mlakit.linear import Linear


def cpu_line() -> str:
    name = platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(x.split(":", 1)[1].strip() for x in out.splitlines() if "Model name" in x)
    except (OSError, StopIteration):
        pass
    caps = torch._C._cpu._get_cpu_capability()
    isa = "AMX-BF16" if caps.get("amx_bf16") else "AVX512-BF16" if caps.get("avx512_bf16") else "AVX2"
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    threads = torch.get_num_threads()
    return f"{name} ({isa}), {threads} threads, load average {load}, torch {torch.__version__}"


def best(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4,8,32,128,512,1024")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    if not packed.packs(torch.bfloat16, "cpu"):
        print("this CPU's oneDNN has no native bf16: the engine does not pack (mlakit computes bf16 in fp32)")
        return
    d, h = DEMO["hidden_size"], DEMO["num_attention_heads"]
    shapes = {
        "q_b": (h * (DEMO["qk_nope_head_dim"] + DEMO["qk_rope_head_dim"]), DEMO["q_lora_rank"]),
        "kv_a": (DEMO["kv_lora_rank"] + DEMO["qk_rope_head_dim"], d),
        "o": (d, h * DEMO["v_head_dim"]),
        "mlp gate_up": (2 * DEMO["intermediate_size"], d),
        "mlp down": (d, DEMO["intermediate_size"]),
        "lm_head": (DEMO["vocab_size"], d),
    }
    print(f"upcast_rows() on this CPU: {packed.upcast_rows()}")
    heads = " ".join(f"{c:>8s}" for c in ("F.linear", "Linear", "packed", "fp32"))
    print(f"{'weight':12s} {'out x in':>12s} {'rows':>5s}  {heads}")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (n, k) in shapes.items():
            lin = Linear(k, n, bias=False, dtype=torch.bfloat16)
            lin.weight.copy_(torch.randn(n, k, generator=g))
            p = packed.prepack(lin.weight)
            for m in map(int, args.rows.split(",")):
                if name == "lm_head" and m > 128:
                    continue  # the head sees the sampled rows only
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                reps = max(2, args.reps // 3) if name == "lm_head" else args.reps
                routes = (
                    lambda x, lin, p: F.linear(x, lin.weight),
                    lambda x, lin, p: lin(x),
                    lambda x, lin, p: packed.packed_mm(x, p),
                    lambda x, lin, p: packed._upcast_mm(x, p, None),
                )
                ts = [best(lambda f=f, x=x, lin=lin, p=p: f(x, lin, p), reps) for f in routes]
                gf = [2 * m * n * k / t / 1e9 for t in ts]
                print(f"{name:12s} {f'{n}x{k}':>12s} {m:5d}  " + " ".join(f"{v:8.1f}" for v in gf))


if __name__ == "__main__":
    main()

"""The absorbed decode core in its forms, timed against the machine's GEMM rates in the same run.

Forms, one signature (q_lat [B,1,H,L], q_pe [B,1,H,dr], c_kv [B,T,L], k_pe [B,T,dr], kv_lens, scale):
  new    what `absorb` runs ("auto": the fused CPU core where it can run, else the torch core);
  torch  the torch core as it is now (`latent_attention`: fp32 scores from a 16-bit cache on a CPU);
  old    the core before the fused one (`latent_attention` with its matmuls in the storage dtype
         where the CPU has native bf16: bf16 scores, per-block copies of the cache);
  plain  the plain three-op form: one bmm against the cached [c_kv | k_pe] rows in the storage dtype,
         an fp32 softmax, one bmm with c_kv.

Timing: each call's wall time (median) and the process's CPU time (min). With one thread the CPU
time is the honest per-core figure on a shared machine (a preempted process is not charged for the
time it waits); rates and percentages below use it. GEMM rates: square matmuls, best of `repeats`.
"""

from __future__ import annotations

import statistics
import time

import torch

from mlakit.ops.absorb import _blocked, latent_attention
from mlakit.ops.common import compute_dtype, core_dtype
from mlakit.ops.cpu_core import core_name, fused_latent, use_fused

FORMS = ("new", "torch", "old", "plain")


def timed(fn, repeats: int) -> dict:
    """{"wall_ms": median, "cpu_ms": min} of `repeats` calls after one warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * min(cpu)}


def gemm_rates(repeats: int = 5, sizes=(2048, 4096)) -> dict[str, float]:
    """GFLOP/s of n×n×n matmuls in bf16 and fp32 (CPU time, best of repeats): {"bf16_2048": ...}."""
    out = {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for n in sizes:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            t = timed(lambda a=a, b=b: a @ b, repeats if n <= 2048 else max(2, repeats // 2))
            out[f"{name}_{n}"] = 2 * n**3 / t["cpu_ms"] / 1e6
    return out


def read_rate(repeats: int = 5) -> float:
    """GB/s of a sum over 512 MB (CPU time, best of repeats)."""
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    return x.numel() * 4 / timed(lambda: x.sum(), repeats)["cpu_ms"] / 1e6


def inputs(batch: int, cached: int, heads=128, latent=512, rope=64, dtype=torch.bfloat16, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    cd = compute_dtype(dtype, "cpu")
    return {
        "q_lat": torch.randn(batch, 1, heads, latent, generator=g).to(cd),
        "q_pe": torch.randn(batch, 1, heads, rope, generator=g).to(cd),
        "c_kv": torch.randn(batch, cached, latent, generator=g).to(dtype),
        "k_pe": torch.randn(batch, cached, rope, generator=g).to(dtype),
        "kv_lens": torch.full((batch,), cached, dtype=torch.long),
        "scale": 1 / 192**0.5,
    }


def form(name: str, x: dict):
    """A no-argument call of one form on inputs `x` (None where it does not apply here)."""
    q_lat, q_pe, c_kv, k_pe, lens, scale = (
        x[k] for k in ("q_lat", "q_pe", "c_kv", "k_pe", "kv_lens", "scale")
    )
    if name == "new":
        if use_fused("auto", q_lat, c_kv, k_pe):
            return lambda: fused_latent(q_lat, q_pe, c_kv, k_pe, lens, scale)
        return form("torch", x)
    if name == "torch":
        return lambda: latent_attention(q_lat, q_pe, c_kv, k_pe, None, scale)
    if name == "old":
        cd = compute_dtype(c_kv.dtype, c_kv.device)
        batch, _, heads, latent = q_lat.shape
        q_l = q_lat.reshape(batch, heads, latent).to(cd) * scale
        q_r = q_pe.reshape(batch, heads, -1).to(cd) * scale
        return lambda: _blocked(q_l, q_r, c_kv, k_pe, None, cd)
    if name == "plain":
        kv = torch.cat([c_kv, k_pe], dim=-1)  # [B, T, L + dr]: the cache as one tensor
        q = torch.cat([q_lat, q_pe], dim=-1)[:, 0].to(c_kv.dtype)  # [B, H, L + dr]

        def plain():
            probs = torch.softmax(torch.bmm(q, kv.transpose(1, 2)).float() * scale, dim=-1)
            return torch.bmm(probs.to(c_kv.dtype), c_kv)

        return plain
    raise ValueError(f"form must be one of {FORMS}, got {name!r}")


def core_flops(batch: int, cached: int, heads=128, latent=512, rope=64) -> int:
    return 2 * batch * heads * cached * (latent + rope + latent)  # scores, then the weighted sum


def core_case(batch: int, cached: int, rates: dict, repeats: int, dtype=torch.bfloat16) -> dict:
    """Every form at one (batch, cached): ms, GFLOP/s and % of the compute dtype's GEMM rate."""
    x = inputs(batch, cached, dtype=dtype)
    flops = core_flops(batch, cached)
    row = {"batch": batch, "cached": cached, "gflop": flops / 1e9}
    for name in FORMS:
        t = timed(form(name, x), repeats)
        cd = _gemm_dtype(name, dtype)
        gflops = flops / t["cpu_ms"] / 1e6
        row[name] = {
            **t,
            "gflop_per_s": gflops,
            "gemm_dtype": cd,
            "pct_of_gemm": 100 * gflops / rates[f"{cd}_2048"],
        }
    row["new_vs_old"] = row["old"]["cpu_ms"] / row["new"]["cpu_ms"]
    row["new_vs_plain"] = row["plain"]["cpu_ms"] / row["new"]["cpu_ms"]
    row["new_vs_torch"] = row["torch"]["cpu_ms"] / row["new"]["cpu_ms"]
    return row


def _gemm_dtype(name: str, dtype: torch.dtype) -> str:
    """The GEMM rate a form is compared with: the dtype its products run in."""
    if name == "new" and core_name(dtype) == "fused-avx512bf16":
        return "bf16"
    if name == "torch" or name == "new":
        cd = core_dtype(dtype, "cpu")
    else:
        cd = compute_dtype(dtype, "cpu") if name == "old" else dtype
    return "bf16" if cd == torch.bfloat16 else "fp32"


def case_line(r: dict) -> str:
    parts = [
        f"{n} {r[n]['cpu_ms']:.1f} ms = {r[n]['gflop_per_s']:.0f} GFLOP/s "
        f"({r[n]['pct_of_gemm']:.0f}% of {r[n]['gemm_dtype']})"
        for n in FORMS
    ]
    return (
        f"B{r['batch']} T{r['cached']}: " + "; ".join(parts) + f"; new is {r['new_vs_old']:.2f}x old, "
        f"{r['new_vs_plain']:.2f}x plain, {r['new_vs_torch']:.2f}x torch"
    )

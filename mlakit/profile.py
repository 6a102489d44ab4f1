"""Measure this machine's roofline: peak matmul FLOP/s per dtype and memory read bandwidth (torch).

`python -m mlakit.profile [--device cpu|cuda] [--out FILE]` measures and saves a JSON profile that
`--machine FILE` (and `mlakit.cost.resolve_machine`) reads; `--machine local` measures once and keeps
the profile in the user's cache folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from dataclasses import replace

import torch

from mlakit.cost.roofline import FLOPS_PER_MAC, MachineProfile

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_matmul_flops(dtype: str, device: str = "cpu", size: int | None = None, repeats: int = 5) -> float:
    """Best FLOP/s of a square matmul: `size`, else 8192 on CUDA, else grown from 128 on CPU until
    one call takes 50 ms (bf16 runs without native support on many CPUs: a fixed size could take minutes)."""
    if size is None and not device.startswith("cuda"):
        size = 128
        while size < 4096 and _matmul_seconds(dtype, device, size, 1) < 0.05:
            size *= 2
    n = size or 8192
    return FLOPS_PER_MAC * n**3 / _matmul_seconds(dtype, device, n, repeats)


def _matmul_seconds(dtype: str, device: str, n: int, repeats: int) -> float:
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=_TORCH_DTYPES[dtype])
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=_TORCH_DTYPES[dtype])
    out = torch.empty(n, n, device=device, dtype=a.dtype)
    return _best_seconds(lambda: torch.matmul(a, b, out=out), device, repeats)


def measure_fp8_flops(device: str, size: int = 8192, repeats: int = 5) -> float | None:
    """fp8 (e4m3) matmul FLOP/s through torch._scaled_mm on CUDA; None where it is unavailable."""
    if not device.startswith("cuda") or not hasattr(torch, "_scaled_mm"):
        return None
    try:
        a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        seconds = _best_seconds(
            lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device, repeats
        )
    except (RuntimeError, TypeError):
        return None
    return FLOPS_PER_MAC * size**3 / seconds


def measure_read_bandwidth(device: str = "cpu", nbytes: int | None = None, repeats: int = 5) -> float:
    """Best bytes/s of summing a buffer far larger than the caches (256 MiB on CPU, 4 GiB on CUDA)."""
    size = nbytes or (4 << 30 if device.startswith("cuda") else 256 << 20)
    x = torch.ones(size // 4, dtype=torch.float32, device=device)
    seconds = _best_seconds(lambda: x.sum(), device, repeats)
    return x.numel() * 4 / seconds


def _best_seconds(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure_machine(device: str = "cpu", name: str | None = None) -> MachineProfile:
    """Peak fp32 and bf16 (and fp8 on CUDA) matmul rates and memory read bandwidth of `device`."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    peaks = {dt: measure_matmul_flops(dt, device) for dt in _TORCH_DTYPES}
    fp8 = measure_fp8_flops(device)
    if fp8 is not None:
        peaks["fp8"] = fp8
    label = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor()
    return MachineProfile(
        name=name or f"local-{device.split(':')[0]}",
        peak_flops=peaks,
        memory_bandwidth=measure_read_bandwidth(device),
        source="measured by mlakit.profile: best of 5 square matmuls, best of 5 sums of a large fp32 buffer",
        extra={
            "device": device,
            "device_name": label or platform.machine(),
            "host": socket.gethostname(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )


def effective_machine(machine: MachineProfile | None, device: str = "cpu") -> MachineProfile | None:
    """The peaks mlakit's matmuls can reach here: where bf16 is computed in fp32 (a CPU without
    native bf16 GEMMs, see mlakit.ops.common.compute_dtype), bf16 work runs at the fp32 peak."""
    from mlakit.ops.common import compute_dtype

    if machine is None or compute_dtype(torch.bfloat16, device) == torch.bfloat16:
        return machine
    if "bf16_native_flops" in machine.extra:
        return machine
    peaks = {**machine.peak_flops, "bf16": machine.peak_flops["fp32"]}
    extra = {**machine.extra, "bf16_native_flops": machine.peak_flops["bf16"]}
    return replace(machine, name=f"{machine.name} (bf16 computed in fp32)", peak_flops=peaks, extra=extra)


def default_profile_path(device: str = "cpu") -> str:
    """$MLAKIT_CACHE_DIR, else $XDG_CACHE_HOME/mlakit, else ~/.cache/mlakit; one file per host and device."""
    root = os.environ.get("MLAKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlakit"
    )
    return os.path.join(root, f"machine-{socket.gethostname()}-{device.split(':')[0]}.json")


def local_profile(device: str = "cpu", refresh: bool = False) -> MachineProfile:
    """This machine's profile: read from the cache folder, or measured (a few seconds) and saved there.
    It holds the native peaks; `effective_machine(profile)` gives the rates mlakit runs at."""
    path = default_profile_path(device)
    if os.path.isfile(path) and not refresh:
        return MachineProfile.load(path)
    profile = measure_machine(device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    profile.save(path)
    return profile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlakit.profile", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--out", help="write the profile here (default: the user's cache folder)")
    args = p.parse_args(argv)
    profile = measure_machine(args.device)
    path = args.out or default_profile_path(args.device)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    profile.save(path)
    json.dump(profile.to_dict(), sys.stdout, indent=2)
    print(f"\nsaved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

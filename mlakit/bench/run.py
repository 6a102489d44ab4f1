"""One bench run: build the layers, gate, sweep, add the work and rates, summarize, write the files."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from mlakit.bench import plots, results
from mlakit.bench.backends import resolve_backends
from mlakit.bench.context import DTYPES, BenchContext
from mlakit.bench.grid import DEFAULT_GRID, Grid
from mlakit.bench.summary import summarize
from mlakit.bench.sweep import run_sweep
from mlakit.bench.timing import DEFAULT_TIMING, Timing
from mlakit.calibration import CrossoverProfile, find_profile
from mlakit.config import MLAConfig
from mlakit.cost import MachineProfile
from mlakit.ops.common import compute_dtype


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    """bf16 where the device multiplies bf16 natively; fp32 elsewhere (a CPU without AVX512-BF16/AMX
    would time bf16 through fp32 conversions, and transformers through a generic bf16 kernel)."""
    return "bf16" if compute_dtype(torch.bfloat16, device) == torch.bfloat16 else "fp32"


@dataclass(frozen=True)
class BenchOptions:
    model: str | MLAConfig = "deepseek-v3"
    dtype: str | None = None  # None: default_dtype(device)
    device: str | None = None  # None: cuda when available, else cpu
    grid: Grid = DEFAULT_GRID
    backends: tuple[str, ...] | None = None  # None: every available backend
    timing: Timing = DEFAULT_TIMING
    out_dir: str | None = "mlakit-bench"  # None: write nothing
    # "measure": this machine's peaks measured in this run (mlakit.profile, a few seconds), so that
    # "% of peak" sees the same load as the timings; "local": the cached profile; a preset or a JSON
    # path; None: no peaks
    machine: MachineProfile | str | None = "measure"
    profile: CrossoverProfile | str | None = "saved"  # "saved": the calibrated one if any; None: analytic
    progress: bool = True
    plots: bool = True
    explorer: bool = True
    seed: int = 0
    threads: int | None = None  # torch intra-op threads for the run; None: torch's setting


def resolve_machine(machine, device: str) -> MachineProfile | None:
    if machine is None or isinstance(machine, MachineProfile):
        return machine
    if machine == "measure":
        from mlakit.profile import measure_machine

        return measure_machine(device)
    if machine == "local":
        from mlakit.profile import local_profile

        return local_profile(device)
    from mlakit.cost import resolve_machine as by_name

    return by_name(machine)


def effective_machine(machine: MachineProfile | None, device: str) -> MachineProfile | None:
    """The peaks mlakit's matmuls can reach here: where bf16 is computed in fp32 (a CPU without
    native bf16 GEMMs, see mlakit.ops.common.compute_dtype), bf16 work runs at the fp32 peak."""
    if machine is None or compute_dtype(torch.bfloat16, device) == torch.bfloat16:
        return machine
    peaks = {**machine.peak_flops, "bf16": machine.peak_flops["fp32"]}
    extra = {**machine.extra, "bf16_native_flops": machine.peak_flops["bf16"]}
    return replace(machine, name=f"{machine.name} (bf16 computed in fp32)", peak_flops=peaks, extra=extra)


def resolve_profile(profile, cfg: MLAConfig, dtype: str, device: str) -> CrossoverProfile | None:
    if profile is None or isinstance(profile, CrossoverProfile):
        return profile
    if profile == "saved":
        return find_profile(cfg, dtype, torch.device(device).type)
    return CrossoverProfile.load(profile)


def run_bench(opts: BenchOptions = BenchOptions()) -> dict:
    """The results document (see mlakit.bench.results); files go to opts.out_dir."""
    with torch_threads(opts.threads):
        return _run(opts)


@contextmanager
def torch_threads(threads: int | None):
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads must be a positive integer, got {threads!r}")
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _run(opts: BenchOptions) -> dict:
    device = opts.device or default_device()
    dtype = opts.dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    cfg = MLAConfig.resolve(opts.model)
    backends = resolve_backends(opts.backends)
    machine = effective_machine(resolve_machine(opts.machine, device), device)
    ctx = BenchContext(cfg, DTYPES[dtype], device, seed=opts.seed)
    ctx.layer.profile = resolve_profile(opts.profile, cfg, dtype, device)
    sweep = run_sweep(ctx, opts.grid, backends, opts.timing, show_progress=opts.progress)
    results.enrich(sweep.rows, ctx, machine)
    source = "analytic model" if ctx.layer.profile is None else "measured profile"
    summary = summarize(cfg, sweep.rows, dtype, machine, opts.grid.decode_new, source)
    doc = results.document(ctx, opts.grid, opts.timing, sweep, machine, summary)
    doc["notes"] = []
    if opts.out_dir is not None:
        doc["files"] = write_files(doc, opts)
    return doc


def write_files(doc: dict, opts: BenchOptions) -> dict:
    files = results.write(doc, opts.out_dir)
    if opts.plots:
        missing = plots.matplotlib_missing()
        if missing:
            doc["notes"].append(missing)
        else:
            files["plots"] = plots.write_plots(doc, opts.out_dir)
    if opts.explorer:
        from mlakit.explore.writer import write_explorer

        files["explorer"] = write_explorer(os.path.join(opts.out_dir, "explorer.html"), files["json"])
    return files

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
from mlakit.bench.machine_state import MachineState, advisories, measure_state
from mlakit.bench.summary import summarize
from mlakit.bench.sweep import run_sweep
from mlakit.bench.timing import DEFAULT_TIMING, Timing
from mlakit.calibration import CrossoverProfile, find_profile
from mlakit.config import MLAConfig
from mlakit.cost import MachineProfile
from mlakit.ops.common import compute_dtype
from mlakit.profile import effective_machine


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


def resolve_profile(profile, cfg: MLAConfig, dtype: str, device: str) -> CrossoverProfile | None:
    if profile is None or isinstance(profile, CrossoverProfile):
        return profile
    if profile == "saved":
        return find_profile(cfg, dtype, torch.device(device).type)
    return CrossoverProfile.load(profile)


def check_device(device: str) -> str:
    """'cpu', 'cuda' or 'cuda:i' that exists here; ValueError naming --device otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device must be cpu or cuda[:i], got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda[:i], got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: CUDA is not available here")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA devices here")
    return device


def run_bench(opts: BenchOptions = BenchOptions()) -> dict:
    """The results document (see mlakit.bench.results); files go to opts.out_dir.

    Before timing, the machine's state decides the thread count when `opts.threads` is None
    (mlakit.bench.machine_state); the document records the state and the reason."""
    _check_threads(opts.threads)
    device = check_device(opts.device or default_device())
    state = measure_state(opts.threads, torch.device(device).type)
    with torch_threads(state.threads):
        return _run(replace(opts, device=device), state)


def _check_threads(threads) -> None:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads must be a positive integer, got {threads!r}")


@contextmanager
def torch_threads(threads: int | None):
    _check_threads(threads)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _run(opts: BenchOptions, state: MachineState | None = None) -> dict:
    device = opts.device or default_device()
    dtype = opts.dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    cfg = MLAConfig.resolve(opts.model)
    backends = resolve_backends(opts.backends, sparse=cfg.is_sparse)
    machine = effective_machine(resolve_machine(opts.machine, device), device)
    ctx = BenchContext(cfg, DTYPES[dtype], device, seed=opts.seed)
    ctx.layer.profile = resolve_profile(opts.profile, cfg, dtype, device)
    sweep = run_sweep(ctx, opts.grid, backends, opts.timing, show_progress=opts.progress)
    if opts.machine == "measure" and machine is not None:
        # peaks again after the cells, the higher of the two kept: a rate measured at a quieter
        # moment than the peak would otherwise read above 100%
        machine = higher_peaks(machine, effective_machine(resolve_machine("measure", device), device))
    results.enrich(sweep.rows, ctx, machine)
    source = "analytic model" if ctx.layer.profile is None else "measured profile"
    summary = summarize(cfg, sweep.rows, dtype, machine, opts.grid.decode_new, source)
    doc = results.document(ctx, opts.grid, opts.timing, sweep, machine, summary)
    doc["notes"] = []
    if state is not None:
        doc["env"]["machine_state"] = state.to_dict()
        doc["notes"] = advisories(state)
    if opts.out_dir is not None:
        doc["files"] = write_files(doc, opts)
    return doc


def higher_peaks(a: MachineProfile, b: MachineProfile) -> MachineProfile:
    """Each peak the higher of two measurements of one machine (before and after the cells)."""
    peaks = {k: max(v, b.peak_flops.get(k, v)) for k, v in a.peak_flops.items()}
    extra = {**a.extra, "peaks_measured": "before and after the cells, the higher kept"}
    return replace(
        a, peak_flops=peaks, memory_bandwidth=max(a.memory_bandwidth, b.memory_bandwidth), extra=extra
    )


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

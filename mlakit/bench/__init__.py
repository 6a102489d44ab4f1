"""mlakit bench: time both MLA paths and the baselines on this machine, find the real crossover.

`run_bench(BenchOptions(...))` gates every backend of the registry (`BACKENDS`) against its oracle,
times one layer step per (backend, cell) of the grid, and returns (and writes) the results document;
`calibrate(CalibrateOptions(...))` measures the crossover profile `mode="auto"` follows.
"""

from mlakit.bench.backends import BACKENDS, Backend, Step
from mlakit.bench.calibrator import CalibrateOptions, calibrate
from mlakit.bench.grid import DEFAULT_GRID, QUICK_GRID, Cell, Grid
from mlakit.bench.run import BenchOptions, run_bench
from mlakit.bench.timing import DEFAULT_TIMING, QUICK_TIMING, Timing

__all__ = [
    "BACKENDS",
    "DEFAULT_GRID",
    "DEFAULT_TIMING",
    "QUICK_GRID",
    "QUICK_TIMING",
    "Backend",
    "BenchOptions",
    "CalibrateOptions",
    "Cell",
    "Grid",
    "Step",
    "Timing",
    "calibrate",
    "run_bench",
]

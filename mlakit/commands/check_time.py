"""How long `mlakit check` will take, said (or refused past --max-minutes) before the long work.

Two estimates, both the cost model's multiply-adds of the run (both paths' causal prefill and decode
steps, projections included; a DSA model's sparse paths and indexer) divided by a rate:

1. the machine-state probe GEMM's rate: a lower bound (attention's softmax, gathers and small heads run
   below a GEMM's rate), known before the layer is built, so a run far past the limit is refused at once;
2. the rate of a timed batch-1 prefill of `PROBE_TOKENS` tokens in each path on the layer itself (the
   cost model's multiply-adds of it over its seconds): 13 s said for 33 s run at 8K tokens of a tiny
   DSA layer on a loaded 2-core machine (docs/calibrate.md), the right order, not a stopwatch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from mlakit.commands import plural
from mlakit.commands.time_limit import check_time_limit, format_duration, over_limit

MAX_MINUTES = 5  # a check is a minute's look at both paths; past this it is refused (--max-minutes)
PROGRESS_SECONDS = 10  # from this estimate on, the estimate and each phase's end are said on stderr
PROBE_FROM_SECONDS = 1  # a run whose lower bound is under this is not worth a timed probe
PROBE_TOKENS = 512


def run_macs(cfg, batch: int, prefill: int, steps: int) -> int:
    """Multiply-adds of what check runs. The decode steps are counted at their middle context, exact
    for a dense layer, whose step cost grows linearly with the context."""
    total = 0
    for mode in ("absorb", "materialize"):
        total += _step_macs(cfg, mode, prefill, 0) + steps * _step_macs(cfg, mode, 1, prefill + steps // 2)
    return batch * total


def _step_macs(cfg, mode: str, new: int, cached: int) -> int:
    from mlakit.cost import path_macs, shared_macs, sparse_path_macs

    shared = sum(shared_macs(cfg, new).values())
    if cfg.is_sparse:
        return shared + sparse_path_macs(cfg, f"sparse-{mode}", new, cached, "causal")
    return shared + path_macs(cfg, mode, new, cached, "causal")


def gemm_rate(state) -> float:
    """Multiply-adds per second of the machine-state probe GEMM at the chosen threads."""
    from mlakit.bench.machine_state import PROBE_SIZE

    ms = state.probe_ms_1 if state.threads == 1 else state.probe_ms_all
    return PROBE_SIZE**3 / max(ms, 1e-6) * 1e3


def prefill_that_fits(cfg, args, rate: float) -> int:
    """The largest --prefill whose estimate stays under --max-minutes (1 if none does)."""
    low, high = 1, args.prefill
    while low < high:
        mid = (low + high + 1) // 2
        if run_macs(cfg, args.batch, mid, args.decode_steps) / rate <= args.max_minutes * 60:
            low = mid
        else:
            high = mid - 1
    return low


def check_duration(cfg, args, state, probe: Callable[[int], float] | None = None) -> float:
    """The run's estimated seconds: without `probe` the GEMM rate's lower bound; with it (seconds of
    a batch-1 prefill of n tokens in both paths), the layer's own rate. Refused past --max-minutes,
    naming the --prefill that fits; said on stderr from PROGRESS_SECONDS on (with `probe`)."""
    rate, how = gemm_rate(state), "at the probe GEMM's"
    seconds = run_macs(cfg, args.batch, args.prefill, args.decode_steps) / rate
    # a prefill of under two probes' length costs about what the probe would: no probe
    if probe is not None and seconds >= PROBE_FROM_SECONDS and args.prefill >= 2 * PROBE_TOKENS:
        tokens = PROBE_TOKENS
        rate, how = run_macs(cfg, 1, tokens, 0) / max(probe(tokens), 1e-9), f"at a {tokens}-token prefill's"
        seconds = run_macs(cfg, args.batch, args.prefill, args.decode_steps) / rate
    macs = run_macs(cfg, args.batch, args.prefill, args.decode_steps)
    how = f"{macs:.3g} multiply-adds {how} {rate / 1e9:.2f} G/s on {plural(state.threads, 'thread')}"
    steps = plural(args.decode_steps, "decode step")
    what = f"{cfg.name} at batch {args.batch}, prefill {args.prefill:,} + {steps}"
    if over_limit(seconds, args.max_minutes):
        fits = prefill_that_fits(cfg, args, rate)
        check_time_limit(seconds, args.max_minutes, what, how, f"--prefill (about {fits:,} fits) or --batch")
    if probe is not None and seconds >= PROGRESS_SECONDS:
        say(f"{what}: about {format_duration(seconds)} ({how})")
    return seconds


def say(line: str) -> None:
    print(f"mlakit check: {line}", file=sys.stderr, flush=True)

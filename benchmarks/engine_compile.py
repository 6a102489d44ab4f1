"""The engine's compiled step against its eager one on the demo model (bf16), printed, never asserted.

    PYTHONPATH=. python benchmarks/engine_compile.py [--threads 1] [--rows 8 32] [--prefill 512 2048]
        [--steps 24] [--reps 3] [--no-starts] [--options '{"cpp_wrapper": true}'] [--json out.json]

Starts: two fresh processes build `LLMEngine(demo, enforce_eager=False)` on one empty inductor cache
(TORCHINDUCTOR_CACHE_DIR, a temporary folder): the first compiles every bucket, the second reads the
cache (both time each bucket and store the verdict, $MLAKIT_STEP_MODES or the user's); a third starts
with the default (None: the verdict's buckets, from the cache); each prints its warm-up seconds
(`stats.compile_seconds`). Steps: one engine (compiled buckets,
on that cache) runs decode steps of `--rows` sequences (128-token prompts, greedy) and one-prompt
prefill steps of `--prefill` tokens, eager and compiled in turn (`runner.compiled_buckets` emptied for
the eager ones), ms per `engine.step()` (lm_head and sampling included): min and median. A gate runs one
step's forward in both modes on the same plan and prints the difference of the hidden states
per row (relative to the row's norm) before any timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

from mlakit.engine import LLMEngine, SamplingParams, compiled
from mlakit.engine.demo import demo_model

PROMPT = 128  # tokens of each decoding sequence's prompt
START = """  # one engine start in a fresh process: its warm-up seconds
import sys, torch
torch.set_num_threads({threads})
from mlakit.engine import LLMEngine, compiled
from mlakit.engine.demo import demo_model
compiled.OPTIONS = {options!r}
e = LLMEngine(demo_model(torch.bfloat16), enforce_eager={mode}, cache_memory="1GiB")
print("compile_seconds", e.stats.compile_seconds)
"""


def starts(threads: int, cache: str, options: dict) -> list[float]:
    """Warm-up seconds of three fresh processes on one inductor cache (empty at the first): two with
    enforce_eager=False (compile and measure), then one with None (the verdict they stored)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    out = []
    for mode in (False, False, None):
        run = subprocess.run(
            [sys.executable, "-c", START.format(threads=threads, options=options, mode=mode)],
            env=env,
            capture_output=True,
            text=True,
        )
        if run.returncode:
            raise SystemExit(run.stderr[-2000:])
        sys.stderr.write(run.stderr)
        out.append(float(run.stdout.split()[-1]))
    return out


def set_mode(engine, mode: str) -> None:
    r = engine.runner
    r.compiled_buckets = set(range(len(r.buckets))) if mode == "compiled" else set()


def gate(engine) -> float:
    """Per row of one 40-token prefill step (the same plan in both modes): |compiled - eager| / |eager|
    of the hidden states, sorted."""
    runner, forward, diffs = engine.runner, engine.runner.forward, []

    def both(plan, ids, positions, keep):
        set_mode(engine, "eager")
        want = forward(plan, ids, positions, list(range(len(ids))))
        set_mode(engine, "compiled")
        got = forward(plan, ids, positions, list(range(len(ids))))
        g, w = got.float(), want.float()
        diffs.append(((g - w).norm(dim=-1) / w.norm(dim=-1)).sort().values)  # per row
        return got.index_select(0, torch.tensor(keep))

    runner.forward = both
    try:
        engine.add_request("gate", list(range(3, 3 + 40)), SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        runner.forward = forward
    return diffs[0]


def decode(engine, rows: int, steps: int) -> dict:
    """ms per decode step of `rows` sequences, eager and compiled in turn, 4 steps a turn."""
    params = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"d{rows}-{i}", [(7 * i + 3 * j + 5) % 100000 for j in range(PROMPT)], params)
    while engine.waiting:  # prefill them all (chunks of the token budget)
        engine.step()
    for _ in range(2):
        engine.step()
    times = {"eager": [], "compiled": []}
    for _ in range(max(1, steps // 4)):
        for mode, acc in times.items():
            set_mode(engine, mode)
            for _ in range(4):
                t0 = time.perf_counter()
                engine.step()
                acc.append(time.perf_counter() - t0)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.step()
    return summary(times)


def prefill(engine, tokens: int, reps: int) -> dict:
    """ms of one step prefilling a fresh `tokens`-token prompt, eager and compiled in turn."""
    times = {"eager": [], "compiled": []}
    for r in range(reps):
        for mode, acc in times.items():
            set_mode(engine, mode)
            rid = f"p{tokens}-{r}-{mode}"
            ids = [(11 * r + 5 * j + (mode == "eager")) % 100000 for j in range(tokens)]
            engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0))
            t0 = time.perf_counter()
            engine.step()
            acc.append(time.perf_counter() - t0)
            while rid in engine.requests:
                engine.step()
    return summary(times)


def summary(times: dict) -> dict:
    out = {}
    for mode, ts in times.items():
        ts = sorted(ts)
        out[mode] = {"min_ms": ts[0] * 1e3, "median_ms": ts[len(ts) // 2] * 1e3}
    out["speedup_median"] = out["eager"]["median_ms"] / out["compiled"]["median_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="*", default=[8, 32])
    p.add_argument("--prefill", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--steps", type=int, default=24, help="decode steps per mode")
    p.add_argument("--reps", type=int, default=3, help="prefill steps per mode")
    p.add_argument("--no-starts", action="store_true", help="skip the two start-up processes")
    p.add_argument("--options", default="{}", help='inductor options as JSON, e.g. {"cpp_wrapper": true}')
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    compiled.OPTIONS = json.loads(args.options)
    result = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "options": compiled.OPTIONS,
        "load_before": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory() as cache:
        if not args.no_starts:
            result["start_compile_s"] = starts(args.threads, cache, compiled.OPTIONS)
            print(
                f"start 1 / 2 (--compile) / 3 (default) warm-up seconds: {result['start_compile_s']}",
                flush=True,
            )
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        engine = LLMEngine(
            demo_model(torch.bfloat16), enforce_eager=False, cache_memory="1GiB", enable_prefix_caching=False
        )
        result["buckets"] = engine.stats.compiled_buckets
        rel = gate(engine)
        result["gate_rel_median"], result["gate_rel_max"] = rel[len(rel) // 2].item(), rel[-1].item()
        print(
            f"gate: per-row |compiled - eager| / |eager| of the hidden states, bf16: median "
            f"{result['gate_rel_median']:.3g}, max {result['gate_rel_max']:.3g} ({len(rel)} rows)",
            flush=True,
        )
        for rows in args.rows:
            result[f"decode_{rows}"] = r = decode(engine, rows, args.steps)
            report(f"decode {rows} rows", r)
        for tokens in args.prefill:
            result[f"prefill_{tokens}"] = r = prefill(engine, tokens, args.reps)
            report(f"prefill {tokens} tokens", r)
    result["load_after"] = os.getloadavg()
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def report(name: str, r: dict) -> None:
    e, c = r["eager"], r["compiled"]
    print(
        f"{name:>20}: eager {e['min_ms']:8.1f} / {e['median_ms']:8.1f} ms, compiled {c['min_ms']:8.1f} / "
        f"{c['median_ms']:8.1f} ms (min / median), eager/compiled {r['speedup_median']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()

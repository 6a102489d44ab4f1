"""The engine's step mode, chosen at start: eager, or compiled buckets warmed up (mlakit/engine/compiled.py).

- `enforce_eager=True`: eager steps, nothing compiled.
- `enforce_eager=False`: every bucket compiled and warmed (one line each on stderr), then each bucket's
  warm-up step is timed eager and compiled (best of PROBE_REPS each) and the verdict stored in
  `$XDG_CACHE_HOME/mlakit/step_modes.json` ($MLAKIT_STEP_MODES if set) under this model, dtype,
  threads, machine, torch and compile options. Without a C++ compiler (or when compiling fails): one
  warning line, eager steps.
- `enforce_eager=None` (default): the stored verdict for the same key, if one was measured: only the
  buckets measured faster compiled (their graphs come from the inductor cache); without one, eager:
  on the CPU this was measured on (Intel Xeon AVX512-BF16, no AMX; docs/engine.md "Compiled step")
  the compiled step was within noise of the eager one at decode, and compiling costs a minute at the
  first start.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

from mlakit.engine import compiled

# a bucket is measured to pay when its compiled step beats the eager one by this factor
KEEP_MARGIN = 0.97
# eager/compiled rounds each bucket's warm-up step is timed for (best of each)
PROBE_REPS = 3


def check_enforce_eager(value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"enforce_eager must be None, True or False, got {value!r}")


def warn(why: str) -> None:
    print(f"mlakit: compiled step unavailable ({why}); running eager steps", file=sys.stderr, flush=True)


def set_up(engine, enforce_eager: bool | None) -> float:
    """Give `engine.runner` its step mode (see the module docstring); the seconds spent warming up."""
    if enforce_eager is True:
        return 0.0
    why = compiled.available()
    if why is not None:
        if enforce_eager is False:
            warn(why)
        return 0.0
    runner = engine.runner
    # a warm-up prompt must fit a step and leave a position to sample
    buckets = compiled.buckets_for(engine.max_num_batched_tokens, engine.max_model_len - 1)
    key = verdict_key(engine, buckets)
    if enforce_eager is None:
        chosen = load_verdict(key)
        if not chosen:  # never measured here, or measured not to pay
            return 0.0
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compiled.cache_dir())
    runner.enable_compile(buckets, compiled.BACKEND, compiled.OPTIONS)
    if enforce_eager is None:
        runner.compiled_buckets = {b for b in chosen if b < len(buckets)}
    start = time.perf_counter()
    try:
        times = _warm(
            engine, buckets, sorted(runner.compiled_buckets), PROBE_REPS if enforce_eager is False else 0
        )
    except Exception as e:  # noqa: BLE001  (a compiler failing at any point: eager, said once)
        runner.disable_compile()
        warn(_why(e))
        return time.perf_counter() - start
    if enforce_eager is False:
        store_verdict(key, [b for b, t in sorted(times.items()) if t["compiled"] < KEEP_MARGIN * t["eager"]])
    runner.last_mode = "compiled" if runner.compiled_buckets else "eager"
    return time.perf_counter() - start


def _warm(engine, buckets, which: list[int], reps: int) -> dict:
    """One step per bucket in `which` of its smallest token count (a prompt of its own, prefix caching
    off), compiling it; with `reps`, timing it eager and compiled. Leaves the engine's counters as they
    were. Returns {bucket: {"eager", "compiled", "first"} seconds} (empty without `reps`)."""
    from mlakit.engine.params import SamplingParams

    runner, kv = engine.runner, engine.kv
    runner.probe = {"reps": reps, "times": {}} if reps else None
    saved = (kv.prefix_caching, kv.queries, kv.hits, engine.prompt_tokens, engine.generation_tokens)
    timings = dict(engine.timings)
    kv.prefix_caching = False
    rid = None
    try:
        for j, i in enumerate(which):
            lo, hi = buckets[i]
            t0 = time.perf_counter()
            span = f"{lo}" if lo == hi else f"{lo}-{hi}"
            print(
                f"mlakit: compiling step for {span} tokens ({j + 1}/{len(which)}) ...",
                end="",
                file=sys.stderr,
            )
            rid = f"mlakit-warm-up-{i}"
            prompt = [(i * 7919 + 3 * t + 1) % runner.vocab_size for t in range(lo)]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
            try:
                while rid in engine.requests:
                    engine.step()
            except BaseException:
                print(" failed", file=sys.stderr, flush=True)
                raise
            engine.finished_ids.pop(rid, None)
            t = runner.probe["times"].get(i) if runner.probe else None
            told = (
                ""
                if t is None
                else f" (eager {t['eager'] * 1e3:.1f} ms, compiled {t['compiled'] * 1e3:.1f} ms)"
            )
            print(f" {time.perf_counter() - t0:.1f} s{told}", file=sys.stderr, flush=True)
        return runner.probe["times"] if runner.probe else {}
    finally:
        if rid in engine.requests:  # a step that failed: its request goes, nothing else changed
            engine.abort_request(rid)
            engine._report()
        engine.finished_ids.pop(rid, None)
        runner.probe = None
        kv.prefix_caching, kv.queries, kv.hits, engine.prompt_tokens, engine.generation_tokens = saved
        engine.timings = timings


def _why(e: BaseException) -> str:
    """The root cause of a failed compile, in one line."""
    while getattr(e, "inner_exception", None) is not None or e.__cause__ is not None:
        e = getattr(e, "inner_exception", None) or e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def verdict_key(engine, buckets) -> str:
    """What a measured verdict holds for: the model's config, dtype, threads, machine, torch, compile
    options and buckets."""
    from mlakit.bench.results import _cpu_name as cpu_name  # the name every mlakit figure is filed under

    config = engine.runner.model.config.to_dict()
    config.pop("_name_or_path", None)
    facts = dict(
        config=config,
        dtype=str(engine.runner.dtype),
        device=str(engine.runner.device),
        threads=torch.get_num_threads(),
        machine=cpu_name(),
        torch=torch.__version__,
        backend=compiled.BACKEND,
        options=compiled.OPTIONS,
        buckets=buckets,
    )
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def verdict_path() -> str:
    """$MLAKIT_STEP_MODES, else step_modes.json in $XDG_CACHE_HOME/mlakit."""
    return os.environ.get("MLAKIT_STEP_MODES") or os.path.join(compiled.mlakit_cache(), "step_modes.json")


def load_verdict(key: str) -> list[int] | None:
    try:
        with open(verdict_path()) as f:
            got = json.load(f).get(key)
    except (OSError, ValueError):
        return None
    return got if isinstance(got, list) and all(isinstance(b, int) for b in got) else None


def store_verdict(key: str, chosen: list[int]) -> None:
    path = verdict_path()
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    table[key] = chosen
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(table, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the next start measures again

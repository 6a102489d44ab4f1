"""The engine's compiled step: the model's own transformers forward under torch.compile, over a few
token-count buckets, with the parts that must stay eager as one opaque op each.

What is compiled: everything between the GEMMs of a step (embedding, norms, residuals, the dense MLPs'
activation, the MoE routers, the final norm and family scale): inductor fuses them into a few C++
loops per layer. What stays eager, inside `mlakit::eager_call` (a custom op the graph calls with the
module's registry key): each attention (`EngineAttention`: it reads the step's plan and writes the
paged cache), each prepacked bf16 linear (`PackedLinear`: oneDNN's packed weight is an opaque tensor
dynamo cannot trace) and each prepacked MoE's expert GEMMs (`GroupedMoE`: segments sized from the
routing, a host decision). So eager and compiled steps share one copy of the weights, packed once.

A bucket is a range of packed token counts (1; 2-16; 17-128; 129 up): one graph per bucket, the count a
dynamic dimension inside it. `choose` (engine warm-up) compiles each and, with enforce_eager=None,
keeps a bucket compiled only where its step measured faster than the eager one.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from itertools import count

import torch
from torch import nn

# packed token counts of each bucket's graph: (lo, hi) inclusive; the last one ends at the engine's
# token budget
BUCKETS = ((1, 1), (2, 16), (17, 128), (129, 1 << 30))

_MODULES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = count()


def register(module: nn.Module) -> int:
    """A key under which the compiled graph calls `module.eager(*tensors)` through `eager_call`."""
    key = next(_KEYS)
    _MODULES[key] = module
    return key


@torch.library.custom_op("mlakit::eager_call", mutates_args=())
def eager_call(xs: list[torch.Tensor], key: int, width: int) -> torch.Tensor:
    """`module.eager(*xs)` of the module registered under `key`: [..., width], xs[0]'s dtype."""
    return _MODULES[key].eager(*xs)


@eager_call.register_fake
def _(xs, key, width):
    return xs[0].new_empty((*xs[0].shape[:-1], width))


def opaque(module: nn.Module, xs: list[torch.Tensor], width: int) -> torch.Tensor:
    """In a compiled graph: one eager_call of `module` (registered on first use)."""
    key = module.__dict__.get("_eager_key")
    if key is None:
        key = module.__dict__["_eager_key"] = register(module)
    return torch.ops.mlakit.eager_call(xs, key, width)


def available() -> str | None:
    """None where torch.compile with inductor can run here, else why not (one line)."""
    if sys.platform == "win32":
        return "torch.compile's inductor backend is not supported on Windows here"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001  (any failure means: no compiler)
        return f"no C++ compiler for inductor ({type(e).__name__}: {e})"
    return None


def cache_dir() -> str:
    """Inductor's on-disk cache: $TORCHINDUCTOR_CACHE_DIR if set, else $XDG_CACHE_HOME/mlakit/inductor
    (default ~/.cache/mlakit/inductor)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mlakit", "inductor")


def bucket_of(n: int, buckets) -> int | None:
    """Index of the bucket holding `n` packed tokens, None past them all (an eager step)."""
    for i, (lo, hi) in enumerate(buckets):
        if lo <= n <= hi:
            return i
    return None


# the compiled step is kept for a bucket (enforce_eager=None) when it beats eager by this factor
KEEP_MARGIN = 0.97
# eager/compiled rounds each bucket's warm-up step times (best of each)
PROBE_REPS = 3
# inductor options of the engine's compiled step; BACKEND "eager" / "aot_eager" (tests) skip inductor
BACKEND = "inductor"
OPTIONS: dict = {}


def check_enforce_eager(value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"enforce_eager must be None, True or False, got {value!r}")


def buckets_for(budget: int, max_tokens: int) -> list[tuple[int, int]]:
    """BUCKETS up to the engine's token budget (the last one ending there), each with the token count
    its warm-up step runs (its smallest: `max_tokens` caps it)."""
    out = []
    for lo, hi in BUCKETS:
        if lo > min(budget, max_tokens):
            break
        out.append((lo, min(hi, budget)))
    return out


def warn(why: str) -> None:
    print(f"mlakit: compiled step unavailable ({why}); running eager steps", file=sys.stderr, flush=True)


def set_up(engine, enforce_eager: bool | None) -> float:
    """Give `engine.runner` its step mode: eager (True), compiled for every bucket (False) or, for None,
    compiled where each bucket's warm-up step measured it faster than eager. Compiles each bucket with
    one line on stderr; returns the seconds spent (0 for eager). Any failure: a warning, eager steps."""
    if enforce_eager is True:
        return 0.0
    why = available()
    if why is not None:
        warn(why)
        return 0.0
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir())
    runner = engine.runner
    # a warm-up prompt must fit a step and leave a position to sample
    buckets = buckets_for(engine.max_num_batched_tokens, engine.max_model_len - 1)
    runner.enable_compile(buckets, BACKEND, OPTIONS)
    start = time.perf_counter()
    try:
        times = _warm(engine, buckets, PROBE_REPS if enforce_eager is None else 0)
    except Exception as e:  # noqa: BLE001  (a compiler failing at any point: eager, said once)
        runner.disable_compile()
        warn(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return time.perf_counter() - start
    if enforce_eager is None:
        runner.compiled_buckets = {b for b, t in times.items() if t["compiled"] < KEEP_MARGIN * t["eager"]}
    if not runner.compiled_buckets:
        runner.disable_compile()
    runner.last_mode = "compiled" if runner.compiled_buckets else "eager"
    return time.perf_counter() - start


def _warm(engine, buckets, reps: int) -> dict:
    """One step per bucket of `lo` tokens (a prompt of its own, prefix caching off), compiling it; with
    `reps`, timing eager and compiled on it. Leaves the engine's counters as they were."""
    from mlakit.engine.params import SamplingParams

    runner, kv = engine.runner, engine.kv
    runner.probe = {"reps": reps, "times": {}} if reps else None
    saved = (kv.prefix_caching, kv.queries, kv.hits, engine.prompt_tokens, engine.generation_tokens)
    timings = dict(engine.timings)
    kv.prefix_caching = False
    try:
        for i, (lo, hi) in enumerate(buckets):
            t0 = time.perf_counter()
            print(
                f"mlakit: compiling step for {lo}-{hi} tokens ({i + 1}/{len(buckets)}) ...",
                end="",
                file=sys.stderr,
                flush=True,
            )
            rid = f"mlakit-warm-up-{i}"
            prompt = [(i * 7919 + 3 * j + 1) % runner.vocab_size for j in range(lo)]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
            while rid in engine.requests:
                engine.step()
            engine.finished_ids.pop(rid, None)
            t = (runner.probe or {}).get("times", {}).get(i)
            told = (
                ""
                if t is None
                else (f" (eager {t['eager'] * 1e3:.1f} ms, compiled {t['compiled'] * 1e3:.1f} ms)")
            )
            print(f" {time.perf_counter() - t0:.1f} s{told}", file=sys.stderr, flush=True)
        return {} if runner.probe is None else runner.probe["times"]
    finally:
        runner.probe = None
        kv.prefix_caching, kv.queries, kv.hits, engine.prompt_tokens, engine.generation_tokens = saved
        engine.timings = timings

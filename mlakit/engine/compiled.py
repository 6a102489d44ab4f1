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
dynamic dimension inside it. mlakit/engine/warmup.py chooses the step mode at engine start and compiles
each bucket it keeps.
"""

from __future__ import annotations

import os
import sys
import weakref
from itertools import count

import torch
from torch import nn

# packed token counts of each bucket's graph: (lo, hi) inclusive; the last one ends at the engine's
# token budget
BUCKETS = ((1, 1), (2, 16), (17, 128), (129, 1 << 30))

_MODULES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = count()


def new_key() -> int:
    """A number no other registration in this process has."""
    return next(_KEYS)


def register(module: nn.Module) -> int:
    """A key under which the compiled graph calls `module.eager(*tensors)` through `eager_call`."""
    key = new_key()
    _MODULES[key] = module
    return key


@torch.library.custom_op("mlakit::eager_call", mutates_args=())
def eager_call(xs: list[torch.Tensor], key: int, width: int) -> torch.Tensor:
    """`module.eager(*xs)` of the module registered under `key`: [..., width], xs[0]'s dtype, contiguous
    (what the fake below promises the graph: a transposed result, such as mlakit.linear's upcast
    product of a bf16 o_proj on an AVX2-only CPU, failed inductor's stride assertion)."""
    return _MODULES[key].eager(*xs).contiguous()


@eager_call.register_fake
def _(xs, key, width):
    return xs[0].new_empty((*xs[0].shape[:-1], width))


def opaque(module: nn.Module, xs: list[torch.Tensor], width: int) -> torch.Tensor:
    """In a compiled graph: one eager_call of `module` (registered when it was built)."""
    return torch.ops.mlakit.eager_call(xs, module.__dict__["_eager_key"], width)


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


def mlakit_cache() -> str:
    """$XDG_CACHE_HOME/mlakit (default ~/.cache/mlakit)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mlakit")


def cache_dir() -> str:
    """Inductor's on-disk cache: $TORCHINDUCTOR_CACHE_DIR if set, else mlakit_cache()/inductor."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(mlakit_cache(), "inductor")


def buckets_for(budget: int, max_tokens: int) -> list[tuple[int, int]]:
    """BUCKETS up to the engine's token budget (the last one ending there) whose smallest token count
    (the one its warm-up step runs) is at most `max_tokens`."""
    out = []
    for lo, hi in BUCKETS:
        if lo > min(budget, max_tokens):
            break
        out.append((lo, min(hi, budget)))
    return out


def bucket_of(n: int, buckets) -> int | None:
    """Index of the bucket holding `n` packed tokens, None past them all (an eager step)."""
    for i, (lo, hi) in enumerate(buckets):
        if lo <= n <= hi:
            return i
    return None


# the engine's compiled step: dynamo backend ("eager" / "aot_eager" in tests skip inductor) and inductor
# options
BACKEND = "inductor"
OPTIONS: dict = {}

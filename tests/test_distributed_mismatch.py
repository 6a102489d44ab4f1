"""Ranks called with different inputs: every rank refuses with a ValueError naming what differs.

One gloo launch of 2 ranks runs every case in turn on the same group: each case first makes one good
step, then a step where rank 1's inputs differ (S, batch, slots, one hidden value, block size), then a
good step again. The mismatched step must raise a ValueError on both ranks (no process aborts, no
hang), leave every cache as it was, and the group must stay usable: the last step matches one process.
"""

from __future__ import annotations

import pytest
import torch

from mlakit.attention import MLAAttention
from mlakit.cache.contiguous import LatentCache
from mlakit.config import MLAConfig
from mlakit.distributed import ContextParallelMLA, TensorParallelMLA, launch_local

CFG = MLAConfig(
    hidden_size=24,
    num_heads=4,
    q_lora_rank=12,
    kv_lora_rank=16,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
    rope_interleave=True,
)
MAX_SEQ = 24
TOL = 1e-5


def hidden(batch: int, new: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, new, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))


def nudged(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[0, -1, 3] += 1e-3
    return y


def swapped_tokens(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1)


# (id, what rank 1 passes instead of (hidden [2, 3, D], slots [0, 1]), field the message must name)
MISMATCHES = {
    "S": (lambda x: hidden(2, 4, 7), None, "hidden_states shape"),
    "batch": (lambda x: x[:1], [0], "hidden_states shape"),
    "slots": (None, [1, 0], "slots"),
    "one-value": (nudged, None, "hidden_states checksum"),
    "token-order": (swapped_tokens, None, "hidden_states checksum"),
}


def state(cache) -> tuple:
    local = getattr(cache, "local", None)
    return (cache.lengths.tolist(), None if local is None else local.lengths.tolist())


def caught(step) -> str:
    try:
        step()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "nothing"


def run_case(kind: str, name: str) -> dict:
    torch.manual_seed(0)
    layer = MLAAttention(CFG).eval()
    rank = torch.distributed.get_rank()
    block = 3 if name == "block_size" and rank == 1 else 2
    if kind == "cp":
        par = ContextParallelMLA(layer, block_size=block)
        cache = par.new_cache(2, MAX_SEQ)
    else:
        par = TensorParallelMLA.from_layer(layer)
        cache = LatentCache(CFG, 2, MAX_SEQ)
    ref = LatentCache(CFG, 2, MAX_SEQ)
    x, slots = hidden(2, 3, 1), [0, 1]
    bad_x, bad_slots, _ = MISMATCHES.get(name, (None, None, None))
    if rank == 1:
        x2 = bad_x(x) if bad_x else x
        slots2 = bad_slots or slots
    else:
        x2, slots2 = x, slots
    with torch.inference_mode():
        if name == "block_size":
            # the layouts differ from the first step on: nothing may be written
            before = state(cache)
            msg = caught(lambda: par(x, cache, slots=slots))
            return {"caught": msg, "before": before, "after": state(cache), "err": 0.0}
        par(hidden(2, 5, 0), cache, slots=[0, 1])
        layer(hidden(2, 5, 0), ref, slots=[0, 1])
        before = state(cache)
        msg = caught(lambda: par(x2, cache, slots=slots2))
        after = state(cache)
        got = par(x, cache, slots=slots)
        want = layer(x, ref, slots=slots)
    err = float((got - want).abs().max() / want.abs().max())
    return {"caught": msg, "before": before, "after": after, "err": err}


CASES = [("cp", n) for n in [*MISMATCHES, "block_size"]] + [("tp", n) for n in MISMATCHES]
FIELD = {n: v[2] for n, v in MISMATCHES.items()} | {"block_size": "block_size"}


def all_cases() -> dict:
    return {f"{kind}-{name}": run_case(kind, name) for kind, name in CASES}


@pytest.fixture(scope="module")
def results():
    # under a timeout: a collective that waits 20 s for a peer fails, the whole launch is cut at 120 s
    return launch_local(all_cases, 2, timeout_s=20.0, deadline_s=120.0)


@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_mismatched_inputs_refused_on_every_rank(results, kind, name):
    for rank, r in enumerate(results):
        case = r[f"{kind}-{name}"]
        msg = case["caught"]
        assert msg.startswith("ValueError:"), f"rank {rank}: {msg}"
        assert "different inputs" in msg and FIELD[name] in msg, f"rank {rank}: {msg}"
        assert case["after"] == case["before"], f"rank {rank}: cache {case['before']} -> {case['after']}"
        assert case["err"] <= TOL, f"rank {rank}: step after the refusal off by {case['err']:.2e}"

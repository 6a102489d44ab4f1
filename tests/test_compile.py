"""torch.compile of a planned decode step: one graph, no graph break, no recompilation while the
context grows inside one key bucket, and the same outputs as eager (contiguous, paged, fp8, int8, mixed)."""

from __future__ import annotations

import time

import pytest
import torch
import torch._dynamo as dynamo
from support.common import assert_close, make_layer, randn
from torch._dynamo.testing import CompileCounter

from mlakit import LatentCache, MLAConfig
from mlakit.cache.paged import PagedLatentCache

LAYERS = 4
# fp8 wants the latent in groups of 128; unequal nope / v / rope widths
CFG = MLAConfig(
    hidden_size=64,
    num_heads=2,
    q_lora_rank=32,
    kv_lora_rank=128,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    rope_interleave=True,
)
KINDS = ["contiguous", "paged", "fp8", "int8"]


def stack(count: int = LAYERS) -> list:
    layers = [make_layer(CFG, seed=10 + i) for i in range(count)]
    for i, layer in enumerate(layers):
        layer.layer_idx = i
    return layers


def new_cache(kind: str):
    if kind == "contiguous":
        return LatentCache(CFG, 4, 256, num_layers=LAYERS)
    cache = PagedLatentCache(
        CFG, 160, 8, max_batch=4, num_layers=LAYERS, quant=None if kind == "paged" else kind
    )
    cache.blocks.shuffle(3)
    return cache


def run_stack(layers, hidden, plan):
    for layer in layers:
        hidden = layer(hidden, plan)
    return hidden


def prefilled(kind, layers, tokens: int):
    cache = new_cache(kind)
    with torch.no_grad():
        plan = cache.plan(tokens, batch=4)
        run_stack(layers, randn(4, tokens, CFG.hidden_size, seed=1), plan)
        cache.commit(plan, layers=[layer.layer_idx for layer in layers])
    return cache


def twin_steps(kind, layers, compiled, steps: int, counts, prefix: int, mode: str):
    """Run `steps` steps on two equal caches, eager on one and `compiled` on the other; compare."""
    eager_cache, graph_cache = prefilled(kind, layers, prefix), prefilled(kind, layers, prefix)
    width = max(counts)
    worst = 0.0
    with torch.no_grad():
        for step in range(steps):
            h = randn(4, width, CFG.hidden_size, seed=100 + step)
            plans = [c.plan(counts, mode=mode, seq_len=width) for c in (eager_cache, graph_cache)]
            want = run_stack(layers, h, plans[0])
            got = compiled(layers, h, plans[1])
            for c, p in zip((eager_cache, graph_cache), plans, strict=True):
                c.commit(p, layers=[layer.layer_idx for layer in layers])  # a stack of 1 to 4 layers
            worst = max(worst, assert_close(f"step {step}", got, want, rtol=1e-5))
    assert torch.equal(eager_cache.lengths, graph_cache.lengths)
    return plans[1]


# fullgraph=True below already fails on any break; explain reports them, traced twice only (time)
@pytest.mark.parametrize("kind", ["contiguous", "fp8"])
def test_planned_decode_step_is_one_graph_without_breaks(kind):
    layers = stack()
    cache = prefilled(kind, layers, 33)
    with torch.no_grad():
        plan = cache.plan(1, mode="absorb", batch=4)
        explained = dynamo.explain(run_stack)(layers, randn(4, 1, CFG.hidden_size, seed=2), plan)
    print(f"{kind}: {explained.graph_count} graph, {explained.graph_break_count} breaks")
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("kind", KINDS)
def test_twenty_decode_steps_in_one_bucket_compile_once_and_equal_eager(kind):
    layers = stack()
    counter = CompileCounter()
    compiled = torch.compile(run_stack, backend=counter, fullgraph=True)
    # 33 .. 53 cached tokens: one bucket of 64 keys
    plan = twin_steps(kind, layers, compiled, 20, [1, 1, 1, 1], 33, "absorb")
    assert plan.key_len == 64
    print(f"{kind}: {counter.frame_count} compilation for 20 steps")
    assert counter.frame_count == 1


@pytest.mark.parametrize("kind", ["paged"])
def test_mixed_batch_split_by_the_plan_compiles_once(kind):
    layers = stack()
    counter = CompileCounter()
    compiled = torch.compile(run_stack, backend=counter, fullgraph=True)
    # decode rows and 12-token chunks: "auto" sends them down different paths (crossover ~8 here)
    plan = twin_steps(kind, layers, compiled, 5, [1, 12, 1, 12], 140, "auto")
    assert plan.row_modes == ("absorb", "materialize", "absorb", "materialize")
    assert counter.frame_count == 1


@pytest.mark.slow
def test_inductor_compiles_the_decode_step_once_and_equals_eager():
    """One layer of the stack (inductor's compile time on 2 cores; the 4-layer graph is the same code)."""
    dynamo.reset()
    layers = stack(1)
    start = time.perf_counter()
    compiled = torch.compile(run_stack, backend="inductor", fullgraph=True)
    before = dynamo.utils.counters["stats"]["unique_graphs"]
    twin_steps("contiguous", layers, compiled, 6, [1, 1, 1, 1], 33, "absorb")
    print(f"inductor: compiled and ran 6 steps in {time.perf_counter() - start:.1f} s")
    assert dynamo.utils.counters["stats"]["unique_graphs"] - before == 1

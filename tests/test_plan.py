"""Step plans: a model-wide cache planned once per step equals per-layer calls and an fp64 reference;
layers sharing a cache never read each other's pages; plans serve one step; refusals change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.common import assert_close, make_layer, naive_mla, randn

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.cache.paged import PagedLatentCache

CFG = MLAConfig(
    hidden_size=40,
    num_heads=3,
    q_lora_rank=24,
    kv_lora_rank=128,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
    rope_interleave=True,
)
LAYERS = 3
KINDS = ["contiguous", "paged", "fp8", "int8"]
# quantized latents: planned == per-layer exactly-ish, the fp64 reference only within the format's error
REF_TOL = {"contiguous": 2e-5, "paged": 2e-5, "fp8": 1e-1, "int8": 3e-2}


def make_cache(kind: str, layers: int = LAYERS, slots: int = 4):
    if kind == "contiguous":
        return LatentCache(CFG, slots, 64, num_layers=layers)
    cache = PagedLatentCache(
        CFG, 80, 4, max_batch=slots, num_layers=layers, quant=None if kind == "paged" else kind
    )
    cache.blocks.shuffle(7)
    return cache


def stack(n: int = LAYERS) -> list[MLAAttention]:
    layers = [make_layer(CFG, seed=30 + i) for i in range(n)]
    for i, layer in enumerate(layers):
        layer.layer_idx = i
    return layers


def planned_step(layers, cache, h, counts=None, slots=None, mode="auto"):
    plan = cache.plan(
        counts if counts is not None else h.shape[1], slots, mode=mode, seq_len=h.shape[1], batch=h.shape[0]
    )
    for layer in layers:
        h = layer(h, plan)
    # a stack of fewer layers than the cache holds names the layers it writes
    cache.commit(plan, layers=None if len(layers) == cache.num_layers else [x.layer_idx for x in layers])
    return h


def per_layer_step(layers, caches, h, counts=None, slots=None, mode="auto"):
    """Each layer alone over a cache of its own (one layer: the one-layer call refuses several)."""
    for layer, cache in zip(layers, caches, strict=True):
        idx, layer.layer_idx = layer.layer_idx, 0
        try:
            h = layer(h, cache, slots=slots, new_tokens=counts, mode=mode)
        finally:
            layer.layer_idx = idx
    return h


def write_every_layer(cache, plan) -> None:
    """Zeros for the plan's rows in every layer (a plan is committed once every layer wrote)."""
    for i in range(cache.num_layers):
        c = torch.zeros(plan.batch, plan.seq_len, CFG.kv_lora_rank)
        cache.write(plan, i, c, torch.zeros(plan.batch, plan.seq_len, CFG.qk_rope_head_dim))


def naive_stack(layers, x):
    for layer in layers:
        x = naive_mla(layer, x)
    return x


@pytest.mark.parametrize("mode", ["auto", "absorb", "materialize"])
@pytest.mark.parametrize("kind", KINDS)
def test_planned_stack_equals_per_layer_calls_and_the_fp64_reference(kind, mode):
    layers = stack()
    shared = make_cache(kind)
    own = [make_cache(kind, layers=1) for _ in layers]
    x = randn(2, 11, CFG.hidden_size, seed=1)
    with torch.no_grad():
        for lo, hi in [(0, 7), (7, 8), (8, 11)]:  # prefill, decode, a chunk
            got = planned_step(layers, shared, x[:, lo:hi], mode=mode, slots=[2, 0])
            want = per_layer_step(layers, own, x[:, lo:hi], mode=mode, slots=[2, 0])
            assert_close(f"{kind} {lo}:{hi} planned vs per-layer", got, want, rtol=1e-5)
            ref = naive_stack(layers, x[:, :hi])[:, lo:hi]
            assert_close(f"{kind} {lo}:{hi} vs fp64", got, ref.float(), rtol=REF_TOL[kind])
    assert shared.lengths.tolist() == [11, 0, 11, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_ragged_mixed_batch_rows_on_both_paths_equal_per_row_calls(kind):
    layers = stack()
    shared, rows = make_cache(kind), make_cache(kind)
    with torch.no_grad():
        planned_step(layers, shared, randn(4, 9, CFG.hidden_size, seed=2), counts=[3, 9, 1, 5])
        planned_step(layers, rows, randn(4, 9, CFG.hidden_size, seed=2), counts=[3, 9, 1, 5])
        counts = [1, 12, 1, 6]
        x = randn(4, 12, CFG.hidden_size, seed=3)
        for b, n in enumerate(counts):
            x[b, n:] = float("nan")  # padding is never read
        plan = shared.plan(counts, seq_len=12)
        assert set(plan.row_modes) == {"absorb", "materialize"}
        h = x
        for layer in layers:
            h = layer(h, plan)
        shared.commit(plan)
        for b, n in enumerate(counts):
            want = planned_step(layers, rows, x[b : b + 1, :n], slots=[b], mode=plan.row_modes[b])
            assert_close(f"{kind} row {b} ({n} new)", h[b, :n], want[0], rtol=1e-5)
            assert not h[b, n:].any(), "padding outputs must be zero"
    assert torch.equal(shared.lengths, rows.lengths)


def poison(cache, layer: int) -> None:
    if isinstance(cache, LatentCache):
        for t in cache.layer_view(layer):
            t.fill_(float("nan"))
    else:
        cache.layer_pages(layer).fill_(0xFF)


@pytest.mark.parametrize("kind", KINDS)
def test_each_layer_reads_only_its_own_pages(kind):
    """Layer 1 of a 3-layer cache, the other layers' pages NaN: it equals a one-layer cache."""
    layer = stack(2)[1]
    solo = make_layer(CFG, seed=31)
    shared, alone = make_cache(kind), make_cache(kind, layers=1)
    with torch.no_grad():
        for step, new in enumerate([6, 1, 3]):
            poison(shared, 0)
            poison(shared, 2)
            x = randn(2, new, CFG.hidden_size, seed=10 + step)
            got = planned_step([layer], shared, x)
            want = planned_step([solo], alone, x)
            assert_close(f"{kind} step {step}", got, want, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_lowering_lengths_rolls_back_every_layer_and_release_empties_a_slot(kind):
    layers = stack()
    cache, fresh = make_cache(kind), make_cache(kind)
    x = randn(2, 10, CFG.hidden_size, seed=4)
    with torch.no_grad():
        planned_step(layers, cache, x[:, :8])
        cache.lengths[:2] = 5  # a rejected draft of 3 tokens, in every layer at once
        got = planned_step(layers, cache, x[:, 8:10])
        planned_step(layers, fresh, x[:, :5])
        want = planned_step(layers, fresh, x[:, 8:10])
        assert_close(f"{kind} after rollback", got, want, rtol=1e-5)
        cache.release(np.int64(1))
        assert cache.lengths.tolist()[:2] == [7, 0]
        y = randn(1, 4, CFG.hidden_size, seed=5)
        got = planned_step(layers, cache, y, slots=[1])
        assert_close(f"{kind} reused slot", got, naive_stack(layers, y).float(), rtol=REF_TOL[kind])


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_plan_serves_one_step(kind):
    layers = stack(1)
    cache = make_cache(kind, layers=1)
    h = randn(4, 1, CFG.hidden_size, seed=6)
    with torch.no_grad():
        plan = cache.plan(1)
        layers[0](h, plan)
        cache.commit(plan)
        with pytest.raises(ValueError, match="plan is committed"):
            cache.commit(plan)
        with pytest.raises(ValueError, match="plan is committed"):
            layers[0](h, plan)
        old = cache.plan(1)
        cache.plan(1)
        with pytest.raises(ValueError, match="plan is superseded"):
            layers[0](h, old)
        with pytest.raises(ValueError, match="another cache"):
            make_cache(kind).commit(old)
        with pytest.raises(ValueError, match="belong to the plan"):
            layers[0](h, old, slots=[0])


def refused_layer(case: str):
    """(layer, hidden [2, 1, D]) that `layer(hidden, plan)` refuses, and what the refusal says."""
    h = randn(2, 1, CFG.hidden_size, seed=8)
    if case == "layer-range":
        return MLAAttention(CFG, layer_idx=5), h, "layer_idx 5 out of range: the cache holds 2 layers"
    if case == "rope-width":
        layer = make_layer(CFG.replace(qk_rope_head_dim=8), seed=30)
        return layer, h, r"qk_rope_head_dim \(rope width\): cache 4, layer 8"
    if case == "latent-width":
        layer = make_layer(CFG.replace(kv_lora_rank=64), seed=30)
        return layer, h, r"kv_lora_rank \(latent width\): cache 128, layer 64"
    if case == "rope-theta":
        layer = make_layer(CFG.replace(rope_theta=500.0), seed=30)
        return layer, h, r"rope frequencies \(rope_theta or rope_scaling\) differ"
    # layer 1 of the stack, not yet run this step: a claim made before the refusal would keep it
    layer = make_layer(CFG, seed=32)
    layer.layer_idx = 1
    if case == "seq-len":
        return layer, randn(2, 3, CFG.hidden_size, seed=8), "the plan is for"
    h[1, 0, 3] = float("nan")
    return layer, h, "NaN or inf"


REFUSALS = ["layer-range", "rope-width", "latent-width", "rope-theta", "seq-len", "nan"]


@pytest.mark.parametrize("case", REFUSALS)
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_refused_layer_leaves_the_plan_and_the_cache_as_they_were(kind, case):
    layers = stack(2)
    cache = make_cache(kind, layers=2)
    h = randn(2, 1, CFG.hidden_size, seed=9)
    with torch.no_grad():
        plan = cache.plan(1, [0, 1])
        layers[0](h, plan)
        owners, buffers = dict(plan.owners), [t.clone() for t in cache.buffers()]
        layer, bad, message = refused_layer(case)
        with pytest.raises(ValueError, match=message):
            layer(bad, plan, check_finite=case == "nan")
        assert plan.owners == owners, f"the refusal claimed a layer: {owners} -> {plan.owners}"
        assert all(torch.equal(a, b) for a, b in zip(cache.buffers(), buffers, strict=True))
        # the refused module did not take layer 1: another module still may
        twin = make_layer(CFG, seed=31)
        twin.layer_idx = 1
        twin(h, plan)
        cache.commit(plan)
    assert cache.lengths[:2].tolist() == [1, 1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_layer_leaves_lengths_and_the_next_step_correct(kind, monkeypatch):
    layers = stack()
    cache, fresh = make_cache(kind), make_cache(kind)
    x = randn(2, 6, CFG.hidden_size, seed=7)
    with torch.no_grad():
        planned_step(layers, cache, x[:, :5])
        planned_step(layers, fresh, x[:, :5])
        before = cache.lengths.clone()

        def boom(*args, **kwargs):
            raise RuntimeError("injected")

        monkeypatch.setattr(layers[1].o_proj, "forward", boom)
        with pytest.raises(RuntimeError, match="injected"):
            planned_step(layers, cache, x[:, 5:6])
        with pytest.raises(ValueError, match="commits after one layer"):
            layers[1](x[:, 5:6], cache)  # the one-layer call: one-layer caches only
        monkeypatch.undo()
        assert torch.equal(cache.lengths, before)
        if kind != "contiguous":
            assert cache.free_blocks == fresh.free_blocks
        got = planned_step(layers, cache, x[:, 5:6])
        want = planned_step(layers, fresh, x[:, 5:6])
    assert_close(f"{kind} after a failed step", got, want, rtol=1e-6)


def test_bf16_paged_absorb_runs_on_any_cpu_and_a_failure_grows_nothing():
    layer = make_layer(CFG, dtype=torch.bfloat16, seed=8)
    paged = PagedLatentCache(CFG, 16, 4, max_batch=2, dtype=torch.bfloat16)
    contiguous = LatentCache(CFG, 2, 32, dtype=torch.bfloat16)
    x = randn(2, 6, CFG.hidden_size, seed=9, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x[:, :5], paged, mode="absorb")
        layer(x[:, :5], contiguous, mode="absorb")
        got = layer(x[:, 5:], paged, mode="absorb")
        want = layer(x[:, 5:], contiguous, mode="absorb")
    assert_close("bf16 paged vs contiguous absorb", got, want, rtol=1e-2)
    assert paged.lengths.tolist() == [6, 6]


def test_step_with_a_key_bucket_attends_only_real_keys():
    cache = make_cache("contiguous")
    plan = cache.plan(3, batch=2)
    assert plan.key_len == 16 and plan.kv_lens.tolist() == [3, 3]
    assert plan.positions.tolist() == [0, 1, 2] * 2  # packed: row after row
    assert plan.query_start_loc_cpu == [0, 3, 6] and plan.num_tokens == 6 and not plan.ragged
    write_every_layer(cache, plan)
    cache.commit(plan)
    plan = cache.plan([1, 14], seq_len=14)
    assert plan.key_len == 32 and plan.kv_lens.tolist() == [4, 17]
    # 15 real tokens of a [2, 14] rectangle: the decode row first, then the extend chunk
    assert plan.ragged and plan.num_tokens == 15 and plan.pack.tolist() == [0, *range(14, 28)]
    assert plan.query_start_loc.tolist() == [0, 1, 15] and plan.seq_lens.tolist() == [4, 17]
    assert (plan.num_decodes, plan.num_extends, plan.num_prefills) == (1, 1, 0)
    assert [(g.kind, g.rows, g.tokens) for g in plan.groups] == [
        ("decode", (0, 1), (0, 1)),
        ("extend", (1, 2), (1, 15)),
    ]


def test_check_finite_refuses_nan_at_real_positions_only():
    layer = stack(1)[0]
    cache = make_cache("paged", layers=1)
    x = randn(2, 3, CFG.hidden_size, seed=11)
    x[1, 2] = float("nan")
    before = [t.clone() for t in cache.buffers()]
    with pytest.raises(ValueError, match=r"NaN or inf at \(row, token\) \[\[1, 2\]\]"):
        layer(x, cache, check_finite=True)
    assert all(torch.equal(a, b) for a, b in zip(cache.buffers(), before, strict=True))
    with torch.no_grad():
        out = layer(x, cache, new_tokens=[3, 2], check_finite=True)  # the NaN is padding
    assert torch.isfinite(out).all()
    plan = cache.plan(1, batch=2)
    with pytest.raises(ValueError, match="NaN or inf"):
        layer(torch.full((2, 1, CFG.hidden_size), float("inf")), plan, check_finite=True)


def test_paged_plan_block_table_is_fixed_within_a_bucket_and_locates_every_row():
    cache = make_cache("paged")
    widths = []
    for _ in range(6):
        plan = cache.plan(3, batch=2)
        widths.append(tuple(plan.block_table.shape))
        size = cache.block_size
        for b in range(2):
            t = torch.arange(int(plan.kv_lens[b]))
            rows = plan.block_table[b, t // size].long() * size + t % size
            assert torch.equal(rows[-3:], plan.slot_mapping[3 * b : 3 * b + 3])
        write_every_layer(cache, plan)
        cache.commit(plan)
    assert widths == [(2, 4)] * 5 + [(2, 8)]  # 16 keys (4 pages of 4) until the context passes 16


@pytest.mark.parametrize("multiple", [1, 64], ids=["contiguous", "page64"])
def test_key_buckets_pad_at_most_an_eighth_past_1024_keys(multiple):
    from mlakit.cache.plan import FINE_BUCKETS_FROM, key_bucket

    sizes = set()
    for keys in [*range(1, 3000), *range(3000, 200_000, 997)]:
        size = key_bucket(keys, multiple)
        assert size >= keys and size % multiple == 0
        if keys > FINE_BUCKETS_FROM:
            assert size <= keys * 1.125 + multiple, (keys, size)
        sizes.add(size)
    # few shapes: a compiled or captured step sees a new one only every eighth of an octave
    assert len(sizes) < 120


def test_a_layer_of_another_yarn_factor_is_refused_naming_the_factor():
    def yarn(factor: float) -> MLAConfig:
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
        return CFG.replace(rope_scaling={**scaling, "attention_factor": factor})

    cache = LatentCache(yarn(1.25), 2, 16)
    with torch.no_grad():
        plan = cache.plan(1, [0])
        owners = dict(plan.owners)
        with pytest.raises(ValueError, match=r"rope mscale factor 1.25, layer 1.5 \(rope_scaling\)"):
            make_layer(yarn(1.5), seed=30)(randn(1, 1, CFG.hidden_size, seed=8), plan)
    assert plan.owners == owners

"""Hostile arguments to the caches and the layer: each a ValueError naming the argument, raised
before anything changes; sizes refused before allocating; derived weights never stale."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.cache import CFG as STEP_CFG
from support.common import assert_close, make_layer, naive_mla, randn, tiny_config

from mlakit import LatentCache, MLAAttention
from mlakit.cache.blocks import BlockPool
from mlakit.cache.paged import PagedLatentCache

CFG = tiny_config()


def caches():
    contiguous = LatentCache(CFG, 3, 8)
    paged = PagedLatentCache(CFG, 8, 2, max_batch=3)
    layer = make_layer(CFG, seed=0)
    with torch.no_grad():
        for cache in (contiguous, paged):
            layer(randn(2, 3, CFG.hidden_size, seed=1), cache)
    return {"contiguous": contiguous, "paged": paged}


def snapshot(cache):
    return [t.clone() for t in cache.buffers()]


def assert_same(cache, before):
    for got, want in zip(cache.buffers(), before, strict=True):
        assert torch.equal(got, want), "a refused call changed the cache"


BAD_SLOTS = [
    ("set", {0}),
    ("dict", {0: 1}),
    ("none-in-list", [None]),
    ("string", "0"),
    ("strings", ["0"]),
    ("huge", [2**70]),
    ("complex", [1 + 2j]),
    ("complex-tensor", torch.tensor([1 + 0j])),
    ("nested", [[0]]),
    ("float", [0.0]),
    ("bool", [True]),
    ("meta", torch.tensor([0], device="meta")),
    ("float-array", np.array([0.0])),
    ("2d-tensor", torch.tensor([[0]])),
]
BAD_COUNTS = [
    ("set", {1}),
    ("dict", {0: 1}),
    ("none-in-list", [None]),
    ("string", "1"),
    ("huge", 2**70),
    ("huge-in-list", [1, 2**70]),
    ("complex", 1 + 0j),
    ("nested", [[1], [1]]),
    ("float", 1.0),
    ("zero", 0),
    ("negative-row", [1, -1]),
    ("meta", torch.tensor([1, 1], device="meta")),
    ("bool-tensor", torch.tensor([True, True])),
]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("slots", [c[1] for c in BAD_SLOTS], ids=[c[0] for c in BAD_SLOTS])
def test_bad_slots_are_refused_by_plan_layer_and_append(kind, slots):
    cache = caches()[kind]
    layer = make_layer(CFG, seed=0)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="slots"):
        cache.plan(1, slots)
    with pytest.raises(ValueError, match="slots"):
        layer(randn(1, 1, CFG.hidden_size, seed=2), cache, slots=slots)
    with pytest.raises(ValueError, match="slots"):
        cache.append(randn(1, 1, 20, seed=3), randn(1, 1, 4, seed=4), slots=slots)
    assert_same(cache, before)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("counts", [c[1] for c in BAD_COUNTS], ids=[c[0] for c in BAD_COUNTS])
def test_bad_new_tokens_are_refused_by_plan_and_layer(kind, counts):
    cache = caches()[kind]
    layer = make_layer(CFG, seed=0)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="new_tokens|tokens"):
        cache.plan(counts, batch=2)
    with pytest.raises(ValueError, match="new_tokens"):
        layer(randn(2, 2, CFG.hidden_size, seed=2), cache, new_tokens=counts)
    assert_same(cache, before)


@pytest.mark.parametrize(
    "cache", ["cache", {"lengths": 1}, object(), 3], ids=["str", "dict", "object", "int"]
)
def test_things_that_are_not_a_cache_are_refused(cache):
    layer = make_layer(CFG, seed=0)
    with pytest.raises(ValueError, match="cache must be a LatentCache, a PagedLatentCache or a StepPlan"):
        layer(randn(1, 1, CFG.hidden_size, seed=2), cache)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize(
    "c_kv,k_pe",
    [([[[0.0] * 20]], [[[0.0] * 4]]), (None, None), (np.zeros((1, 1, 20)), np.zeros((1, 1, 4)))],
    ids=["lists", "none", "numpy"],
)
def test_append_refuses_what_is_not_a_tensor(kind, c_kv, k_pe):
    cache = caches()[kind]
    before = snapshot(cache)
    with pytest.raises(ValueError, match="c_kv must be a tensor"):
        cache.append(c_kv, k_pe)
    assert_same(cache, before)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_release_takes_numpy_integers_and_refuses_the_rest(kind):
    cache = caches()[kind]
    cache.release(np.int64(0))
    assert cache.lengths.tolist() == [0, 3, 0]
    for slot in (np.float64(0), "0", 3, np.int64(-1)):
        with pytest.raises(ValueError, match="slot"):
            cache.release(slot)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_lengths_raised_past_the_tokens_written_are_refused(kind):
    cache = caches()[kind]
    layer = make_layer(CFG, seed=0)
    cache.lengths[2] = 2  # slot 2 never written
    before = snapshot(cache)
    with pytest.raises(ValueError, match="tokens written"):
        layer(randn(1, 1, CFG.hidden_size, seed=2), cache, slots=[2])
    assert_same(cache, before)
    cache.lengths[2] = 0
    cache.lengths[0] = 1  # lowered: tokens 1, 2 dropped ...
    cache.plan(1, [1])
    cache.lengths[0] = 3  # ... and cannot come back
    with pytest.raises(ValueError, match="tokens written"):
        cache.plan(1, [0])


@pytest.mark.parametrize(
    "make",
    [
        lambda: PagedLatentCache(CFG, 2**31, 1, max_batch=1),
        lambda: PagedLatentCache(CFG, 10**12, 1, max_batch=1),
        lambda: PagedLatentCache(CFG, 2**30, 64, max_batch=1),
        lambda: PagedLatentCache(CFG, 4, 1, max_batch=10**12),
        lambda: PagedLatentCache(CFG, 4, 1, max_batch=1, num_layers=10**12),
        lambda: LatentCache(CFG, 10**6, 10**6),
        lambda: LatentCache(CFG, 1, 1, num_layers=10**15),
    ],
    ids=["blocks-2^31", "blocks-1e12", "pool-bytes", "batch-1e12", "layers-1e12", "contiguous", "c-layers"],
)
def test_sizes_are_checked_before_allocating(make):
    with pytest.raises(ValueError, match=r"num_blocks must be < 2147483647|would take [\d,]+ bytes"):
        make()


def edit_data(layer, other):
    layer.kv_b_proj.weight.data.mul_(2)


def edit_load(layer, other):
    layer.load_state_dict(other.state_dict())


def edit_copy(layer, other):
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(other.kv_b_proj.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "edit", [edit_data, edit_load, edit_copy], ids=["data-write", "load_state_dict", "copy"]
)
def test_derived_weights_follow_every_kind_of_weight_change(edit, dtype):
    layer, other = make_layer(CFG, seed=20, dtype=dtype), make_layer(CFG, seed=21, dtype=dtype)
    x = randn(1, 4, CFG.hidden_size, seed=22, dtype=dtype)
    with torch.no_grad():
        layer(x, mode="absorb")
        edit(layer, other)
        out = layer(x, mode="absorb")
    assert_close(
        "after the edit", out, naive_mla(layer, x).to(dtype), rtol=2e-5 if dtype == torch.float32 else 2e-2
    )


def test_a_layer_built_under_inference_mode_runs_and_follows_weight_changes():
    with torch.inference_mode():
        layer = MLAAttention(CFG)
        layer.kv_b_proj.weight.normal_()
        x = randn(1, 3, CFG.hidden_size, seed=23)
        first = layer(x, mode="absorb")
        layer.kv_b_proj.weight.mul_(2)
        second = layer(x, mode="absorb")
        w_uk, _ = layer.up_weights()
        assert w_uk.data_ptr() == layer.kv_b_proj.weight.data_ptr()  # views: nothing derived
    assert not torch.equal(first, second)
    assert_close("inference-mode layer", second, naive_mla(layer, x).float(), rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.uint8, "bf16"], ids=str)
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_storage_dtype_is_refused_pointing_to_quant(kind, dtype):
    """int8/fp8 are row formats of the paged cache (quant=...), never a compute dtype of either cache."""
    make = {
        "contiguous": lambda: LatentCache(CFG, 2, 8, dtype=dtype),
        "paged": lambda: PagedLatentCache(CFG, 8, 2, max_batch=2, dtype=dtype),
    }[kind]
    with pytest.raises(ValueError, match=r"dtype must be a floating-point compute dtype.*quant='int8'"):
        make()


def test_refusals_name_their_argument():
    with pytest.raises(ValueError, match="strict must be True or False"):
        __import__("mlakit.hf", fromlist=["patch"]).patch(torch.nn.Linear(2, 2), strict="no")
    with pytest.raises(ValueError, match="batch_size=1000000 x max_seq_len=1000000.*lower batch_size"):
        LatentCache(STEP_CFG, 10**6, 10**6)
    with pytest.raises(ValueError, match="num_blocks=1000000000.*lower num_blocks"):
        PagedLatentCache(STEP_CFG, 10**9, 64, max_batch=1)
    with pytest.raises(ValueError, match="BlockPool\\(num_blocks=10000000000.*lower num_blocks"):
        BlockPool(10**10, 1, 1)

"""Every bad input raises ValueError saying what was given, and leaves the cache exactly as it was."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_unchanged, make_layer, randn, snapshot, tiny_config

from mlakit import LatentCache, MLAAttention

CFG = tiny_config()
# a device unlike the layer's: a GPU when there is one, else the meta device (no data, same checks)
OTHER_DEVICE = "cuda" if torch.cuda.is_available() else "meta"


@pytest.fixture
def layer():
    return make_layer(CFG, seed=0)


@pytest.fixture
def cache(layer):
    """Three slots of 8 tokens holding 5, 2 and 0 tokens."""
    cache = LatentCache(CFG, 3, 8)
    with torch.no_grad():
        layer(randn(1, 5, 40, seed=1), cache, slots=[0])
        layer(randn(1, 2, 40, seed=2), cache, slots=[1])
    assert cache.lengths.tolist() == [5, 2, 0]
    return cache


def hidden(batch: int = 1, new: int = 1, width: int = 40, **kw) -> torch.Tensor:
    return randn(batch, new, width, seed=3).to(**kw)


# (id, call(layer, cache), words the message must contain)
FORWARD_CASES = [
    ("hidden-width", lambda m, c: m(hidden(width=41), c), r"width 41.*40"),
    ("hidden-2d", lambda m, c: m(hidden()[0], c), r"\[batch, seq, hidden\]"),
    ("hidden-S0", lambda m, c: m(hidden(new=0), c), r"shape \(1, 0, 40\)"),
    ("hidden-B0", lambda m, c: m(hidden(batch=0), c), r"shape \(0, 1, 40\)"),
    ("hidden-not-tensor", lambda m, c: m([[0.0] * 40], c), r"tensor"),
    ("dtype-vs-layer", lambda m, c: m(hidden(dtype=torch.bfloat16), c), r"bfloat16.*float32"),
    (
        "dtype-vs-cache",
        lambda m, c: make_layer(CFG, dtype=torch.bfloat16)(hidden(dtype=torch.bfloat16), c),
        r"float32.*bfloat16",
    ),
    ("device-vs-layer", lambda m, c: m(hidden(device=OTHER_DEVICE), c), OTHER_DEVICE),
    (
        "device-vs-cache",
        lambda m, c: MLAAttention(CFG, device=OTHER_DEVICE)(hidden(device=OTHER_DEVICE), c),
        r"cache is on cpu",
    ),
    ("slot-past-end", lambda m, c: m(hidden(), c, slots=[3]), r"\[3\].*0\.\.2"),
    ("slot-negative", lambda m, c: m(hidden(), c, slots=[-1]), r"\[-1\].*0\.\.2"),
    ("slot-float", lambda m, c: m(hidden(), c, slots=[0.0]), r"integers"),
    ("slots-duplicate", lambda m, c: m(hidden(batch=2), c, slots=[1, 1]), r"duplicates"),
    ("slots-too-few", lambda m, c: m(hidden(batch=2), c, slots=[0]), r"1 entries.*\(2\)"),
    ("slots-too-many", lambda m, c: m(hidden(), c, slots=[0, 1]), r"2 entries.*\(1\)"),
    ("rows-past-slots", lambda m, c: m(hidden(batch=4), c), r"4 rows.*3"),
    ("overflow", lambda m, c: m(hidden(new=4), c, slots=[0]), r"\[0\].*5.*4.*8"),
    # row 0 (slot 1) fits, row 1 (slot 0) does not: nothing is written for either
    ("overflow-one-row", lambda m, c: m(hidden(batch=2, new=4), c, slots=[1, 0]), r"slots \[0\]"),
    ("mode-typo", lambda m, c: m(hidden(), c, mode="absorbed"), r"absorbed"),
    ("mode-case", lambda m, c: m(hidden(), c, mode="AUTO"), r"AUTO"),
    ("mode-bad-and-slots", lambda m, c: m(hidden(), c, mode=None, slots=[0]), r"None"),
    (
        "cache-other-widths",
        lambda m, c: make_layer(tiny_config(kv_lora_rank=21))(hidden(), c),
        r"kv_lora_rank \(latent width\): cache 20, layer 21",
    ),
]


@pytest.mark.parametrize("call,words", [c[1:] for c in FORWARD_CASES], ids=[c[0] for c in FORWARD_CASES])
def test_forward_rejects_bad_input_and_keeps_the_cache(layer, cache, call, words):
    before, state_before = snapshot(cache), dict(layer.__dict__)
    with pytest.raises(ValueError, match=words):
        call(layer, cache)
    assert_unchanged(cache, before)
    assert layer.__dict__.keys() == state_before.keys()


def test_slots_without_cache(layer):
    with pytest.raises(ValueError, match="slots.*without a cache"):
        layer(hidden(), slots=[0])


@pytest.mark.parametrize("lengths", [[-1, 2, 0], [5, 9, 0]], ids=["negative", "past-max"])
def test_forward_rejects_corrupt_lengths(layer, cache, lengths):
    cache.lengths[:] = torch.tensor(lengths)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"lengths.*0\.\.8"):
        layer(hidden(), cache, slots=[2])
    assert_unchanged(cache, before)


def good_entries(batch: int = 1, new: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(batch, new, 20, seed=4), randn(batch, new, 4, seed=5)


APPEND_CASES = [
    ("c_kv-2d", lambda: (good_entries()[0][0], good_entries()[1]), {}, r"\[B,S,width\]"),
    ("c_kv-width", lambda: (randn(1, 1, 21, seed=6), good_entries()[1]), {}, r"width 21.*20"),
    ("k_pe-width", lambda: (good_entries()[0], randn(1, 1, 6, seed=6)), {}, r"\(1, 1, 6\).*\(1, 1, 4\)"),
    (
        "k_pe-length",
        lambda: (good_entries(new=2)[0], good_entries(new=1)[1]),
        {},
        r"\(1, 1, 4\).*\(1, 2, 4\)",
    ),
    ("dtype", lambda: tuple(t.bfloat16() for t in good_entries()), {}, r"bfloat16.*float32"),
    ("device", lambda: tuple(t.to(OTHER_DEVICE) for t in good_entries()), {}, OTHER_DEVICE),
    ("S0", lambda: good_entries(new=0), {"slots": [2]}, r"0 tokens"),
    ("overflow", lambda: good_entries(new=4), {"slots": [0]}, r"overflows slots \[0\]"),
    ("slot-range", good_entries, {"slots": [5]}, r"out of range"),
    ("slots-duplicate", lambda: good_entries(batch=2), {"slots": [2, 2]}, r"duplicates"),
    ("slots-count", lambda: good_entries(batch=2), {"slots": [2]}, r"1 entries"),
    ("slots-bool", good_entries, {"slots": [True]}, r"integers"),
]


@pytest.mark.parametrize("make,kwargs,words", [c[1:] for c in APPEND_CASES], ids=[c[0] for c in APPEND_CASES])
def test_append_rejects_bad_input_and_keeps_the_cache(cache, make, kwargs, words):
    before = snapshot(cache)
    c_kv, k_pe = make()
    with pytest.raises(ValueError, match=words):
        cache.append(c_kv, k_pe, **kwargs)
    assert_unchanged(cache, before)

"""Mixed batches: one forward over padded rows plus per-row new-token counts equals per-row calls,
each group of rows runs on the path "auto" picks for it, padding is never read."""

from __future__ import annotations

import pytest
import torch
from support.cache import small_config
from support.common import assert_close, make_layer, randn

from mlakit import LatentCache
from mlakit.cache.paged import PagedLatentCache
from mlakit.dispatch import choose

PREFIX = [7, 0, 12, 3]  # tokens already cached in slots 0..3
COUNTS = [1, 9, 1, 5]  # decode, prefill, decode, chunk


def make_cache(kind: str, cfg):
    if kind == "contiguous":
        return LatentCache(cfg, 4, 40)
    cache = PagedLatentCache(cfg, 40, 4, max_batch=4, quant=None if kind == "paged" else kind)
    cache.blocks.shuffle(11)
    cache.pages.fill_(0xFF)
    return cache


def prefilled(kind, cfg, layer):
    """A cache whose slot b holds PREFIX[b] tokens."""
    cache = make_cache(kind, cfg)
    with torch.no_grad():
        for slot, n in enumerate(PREFIX):
            if n:
                layer(randn(1, n, cfg.hidden_size, seed=50 + slot), cache, slots=[slot])
    return cache


def padded_batch(cfg, counts, seed):
    """hidden [B, max count, D] with NaN in the padding: it must never be read."""
    x = randn(len(counts), max(counts), cfg.hidden_size, seed=seed)
    for row, n in enumerate(counts):
        x[row, n:] = float("nan")
    return x


@pytest.mark.parametrize("mode", ["auto", "absorb", "materialize"])
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_mixed_batch_equals_per_row_calls(kind, mode):
    cfg = small_config()
    layer = make_layer(cfg, seed=3)
    mixed, per_row = prefilled(kind, cfg, layer), prefilled(kind, cfg, layer)
    x = padded_batch(cfg, COUNTS, seed=1)
    slots = [2, 0, 3, 1]
    counts = [COUNTS[s] for s in slots]
    x = x[slots]
    with torch.no_grad():
        got, plan = layer.step(x, mixed, slots=slots, new_tokens=counts, mode=mode)
        modes = list(plan.row_modes)
        for row, (slot, n) in enumerate(zip(slots, counts, strict=True)):
            want = layer(x[row : row + 1, :n], per_row, slots=[slot], mode=mode)
            assert_close(f"row {row} (slot {slot}, {n} new)", got[row, :n], want[0])
            assert not got[row, n:].any(), "padding positions must be zero"
    assert (
        mixed.lengths.tolist()
        == per_row.lengths.tolist()
        == [p + c for p, c in zip(PREFIX, COUNTS, strict=True)]
    )
    s = torch.arange(4)
    for a, b in zip(mixed.view(s, 21), per_row.view(s, 21), strict=True):
        assert_close("cache contents", a, b)
    picked = [choose(cfg, n, PREFIX[slot]) for slot, n in zip(slots, counts, strict=True)]
    assert modes == (picked if mode == "auto" else [mode] * 4)


def test_auto_routes_decode_rows_to_absorb_and_long_prefill_rows_to_materialize():
    cfg = small_config()
    layer = make_layer(cfg)
    cache = prefilled("paged", cfg, layer)
    with torch.no_grad():
        _, plan = layer.step(padded_batch(cfg, COUNTS, seed=2), cache, new_tokens=COUNTS)
    assert list(plan.row_modes) == ["absorb", "materialize", "absorb", "materialize"]
    assert plan.mode == "mixed"


@pytest.mark.parametrize("counts", [[1, 6, 3], [6, 6, 6]], ids=["ragged", "uniform"])
def test_mixed_batch_without_a_cache_equals_per_row_calls(counts):
    cfg = small_config()
    layer = make_layer(cfg, seed=4)
    x = padded_batch(cfg, counts, seed=3)
    with torch.no_grad():
        got = layer(x, new_tokens=torch.tensor(counts))
        for row, n in enumerate(counts):
            assert_close(f"row {row}", got[row, :n], layer(x[row : row + 1, :n])[0])


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_mixed_batch_on_quantized_pages_equals_per_row_calls(kind):
    cfg = small_config(kv_lora_rank=128)
    layer = make_layer(cfg, seed=5)
    mixed, per_row = prefilled(kind, cfg, layer), prefilled(kind, cfg, layer)
    x = padded_batch(cfg, COUNTS, seed=4)
    with torch.no_grad():
        got = layer(x, mixed, new_tokens=COUNTS)
        for row, n in enumerate(COUNTS):
            assert_close(f"row {row}", got[row, :n], layer(x[row : row + 1, :n], per_row, slots=[row])[0])


@pytest.mark.parametrize(
    "new_tokens, match",
    [
        ([1, 2, 3], r"new_tokens must be 4 integers \(one per row\), got torch.int64 of shape \(3,\)"),
        ([1.0, 2.0, 3.0, 4.0], "new_tokens must be 4 integers"),
        ([1, 0, 3, 4], r"new_tokens \[1, 0, 3, 4\] outside 1..9"),
        ([1, 10, 3, 4], r"outside 1..9 \(the padded width of hidden_states\)"),
    ],
    ids=["length", "float", "zero", "past-width"],
)
def test_bad_counts_raise_before_any_write(new_tokens, match):
    cfg = small_config()
    layer = make_layer(cfg)
    cache = prefilled("paged", cfg, layer)
    before = (cache.pages.clone(), cache.lengths.clone())
    with pytest.raises(ValueError, match=match):
        layer(randn(4, 9, cfg.hidden_size, seed=1), cache, new_tokens=new_tokens)
    assert torch.equal(cache.pages, before[0]) and torch.equal(cache.lengths, before[1])


def test_contiguous_overflow_names_the_rows_counts():
    cfg = small_config()
    layer = make_layer(cfg)
    cache = LatentCache(cfg, 2, 8)
    with pytest.raises(ValueError, match=r"appending \[9\] tokens overflows slots \[1\]"):
        layer(randn(2, 9, cfg.hidden_size, seed=1), cache, new_tokens=[2, 9])
    assert cache.lengths.tolist() == [0, 0]


def test_out_of_blocks_counts_every_row_of_a_mixed_batch():
    """Each group of rows would fit alone; the batch does not, and nothing is written."""
    cfg = small_config()
    layer = make_layer(cfg)
    cache = PagedLatentCache(cfg, 3, 4, max_batch=2)
    before = cache.pages.clone()
    with pytest.raises(ValueError, match="needs 4 more blocks of 4 tokens, 3 of 3 are free"):
        layer(randn(2, 9, cfg.hidden_size, seed=1), cache, new_tokens=[9, 1])  # 3 + 1 blocks
    assert torch.equal(cache.pages, before) and cache.lengths.tolist() == [0, 0] and cache.free_blocks == 3

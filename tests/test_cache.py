"""LatentCache: where append writes, slots, views, release and reuse, lowering lengths."""

from __future__ import annotations

import pytest
import torch
from support.common import randn, tiny_config

from mlakit import LatentCache


def entries(batch: int, new: int, seed: int, cfg=None):
    cfg = cfg or tiny_config()
    return (
        randn(batch, new, cfg.kv_lora_rank, seed=seed),
        randn(batch, new, cfg.qk_rope_head_dim, seed=seed + 100),
    )


def test_new_cache_is_empty_and_sized_per_token():
    cfg = tiny_config()
    cache = LatentCache(cfg, 3, 10, dtype=torch.bfloat16)
    assert cache.lengths.tolist() == [0, 0, 0] and cache.lengths.dtype == torch.long
    assert tuple(cache.c_kv.shape) == (3, 10, 20) and tuple(cache.k_pe.shape) == (3, 10, 4)
    assert cache.dtype == torch.bfloat16 and cache.device == torch.device("cpu")
    # L + dr values per token, nothing per head
    assert cache.bytes_per_token == (20 + 4) * 2


def test_append_writes_after_each_slots_length():
    cache = LatentCache(tiny_config(), 3, 10)
    c1, k1 = entries(3, 2, seed=1)
    cache.append(c1, k1)
    c2, k2 = entries(2, 3, seed=2)
    used = cache.append(c2, k2, slots=[2, 0])
    assert used.tolist() == [2, 0]
    assert cache.lengths.tolist() == [5, 2, 5]
    assert torch.equal(cache.c_kv[:, :2], c1) and torch.equal(cache.k_pe[:, :2], k1)
    assert torch.equal(cache.c_kv[2, 2:5], c2[0]) and torch.equal(cache.c_kv[0, 2:5], c2[1])
    assert torch.equal(cache.k_pe[2, 2:5], k2[0]) and torch.equal(cache.k_pe[0, 2:5], k2[1])
    # slot 1 was not touched past its length
    assert torch.equal(cache.c_kv[1, 2:], torch.zeros(8, 20))


def test_append_fills_to_exactly_max_seq_len():
    cache = LatentCache(tiny_config(), 1, 4)
    cache.append(*entries(1, 4, seed=3))
    assert cache.lengths.tolist() == [4]


@pytest.mark.parametrize("slots", [torch.tensor([1, 0]), [1, 0], (1, 0)], ids=["tensor", "list", "tuple"])
def test_slots_accept_tensors_and_sequences(slots):
    cache = LatentCache(tiny_config(), 2, 4)
    c, k = entries(2, 1, seed=4)
    cache.append(c, k, slots=slots)
    assert torch.equal(cache.c_kv[1, 0], c[0, 0]) and torch.equal(cache.c_kv[0, 0], c[1, 0])


def test_view_of_consecutive_slots_is_no_copy_and_others_gather():
    cache = LatentCache(tiny_config(), 4, 6)
    cache.append(*entries(4, 5, seed=5))
    c_kv, k_pe = cache.view(torch.tensor([1, 2]), 3)
    assert c_kv.data_ptr() == cache.c_kv[1].data_ptr() and tuple(c_kv.shape) == (2, 3, 20)
    assert torch.equal(k_pe, cache.k_pe[1:3, :3])
    c_kv, k_pe = cache.view(torch.tensor([3, 0]), 5)
    assert torch.equal(c_kv, cache.c_kv[[3, 0], :5]) and torch.equal(k_pe, cache.k_pe[[3, 0], :5])


def test_release_empties_one_slot_for_reuse():
    cache = LatentCache(tiny_config(), 2, 4)
    cache.append(*entries(2, 3, seed=6))
    cache.release(1)
    assert cache.lengths.tolist() == [3, 0]
    c, k = entries(1, 4, seed=7)
    cache.append(c, k, slots=[1])
    assert cache.lengths.tolist() == [3, 4]
    assert torch.equal(cache.c_kv[1], c[0]) and torch.equal(cache.k_pe[1], k[0])


@pytest.mark.parametrize("slot", [-1, 2, 1.0, True, None], ids=["neg", "past-end", "float", "bool", "none"])
def test_release_rejects_bad_slot(slot):
    cache = LatentCache(tiny_config(), 2, 4)
    cache.append(*entries(2, 1, seed=8))
    with pytest.raises(ValueError, match="slot"):
        cache.release(slot)
    assert cache.lengths.tolist() == [1, 1]


def test_lowering_lengths_drops_the_newest_tokens():
    cache = LatentCache(tiny_config(), 1, 6)
    c, k = entries(1, 5, seed=9)
    cache.append(c, k)
    cache.lengths[0] = 2  # a speculative draft of 3 tokens was rejected
    c2, k2 = entries(1, 2, seed=10)
    cache.append(c2, k2)
    assert cache.lengths.tolist() == [4]
    assert torch.equal(cache.c_kv[0, :4], torch.cat([c[0, :2], c2[0]]))
    assert torch.equal(cache.k_pe[0, :4], torch.cat([k[0, :2], k2[0]]))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"max_seq_len": -1}, "max_seq_len"),
        ({"max_seq_len": 2.0}, "max_seq_len"),
    ],
    ids=["batch0", "len-neg", "len-float"],
)
def test_constructor_rejects_bad_sizes(kwargs, field):
    args = {"batch_size": 2, "max_seq_len": 4, **kwargs}
    with pytest.raises(ValueError, match=field):
        LatentCache(tiny_config(), args["batch_size"], args["max_seq_len"])

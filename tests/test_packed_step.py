"""The packed step: decode rows, an extend chunk over a cached prefix and a fresh prompt in one plan, their
tokens one axis [N, D] in the plan's order (decode -> extend -> prefill), equal the same rows run alone;
for the contiguous cache and paged ones (bf16, fp8, int8 pages), dense MLA and DSA."""

from __future__ import annotations

import copy

import pytest
import torch
from support.cache import CFG, DSA
from support.common import assert_close, make_layer, randn, tiny_config

from mlakit import LatentCache
from mlakit.cache.paged import PagedLatentCache
from mlakit.rope import one_pass

PREFIX = {0: 9, 1: 6, 3: 14}  # cached tokens of slots 0, 1, 3 before the step
# (slot, new tokens): a fresh prompt, a decode row, an extend chunk, another decode row, in the caller's order
ROWS = [(2, 7), (0, 1), (1, 5), (3, 1)]


def cache_of(kind: str, cfg, dtype):
    if kind == "contiguous":
        return LatentCache(cfg, 4, 32, dtype=dtype)
    cache = PagedLatentCache(cfg, 40, 4, max_batch=4, dtype=dtype, quant=None if kind == "pages" else kind)
    cache.blocks.shuffle(5)  # a slot's pages are never consecutive by accident
    return cache


def prefilled(kind, cfg, layer, dtype):
    cache = cache_of(kind, cfg, dtype)
    with torch.no_grad():
        for slot, n in PREFIX.items():
            layer(randn(1, n, cfg.hidden_size, seed=40 + slot, dtype=dtype), cache, slots=[slot])
    return cache


CASES = [
    ("contiguous", "dense", torch.float32),
    ("pages", "dense", torch.float32),
    ("pages", "dense", torch.bfloat16),
    ("fp8", "dense", torch.float32),
    ("int8", "dense", torch.float32),
    ("contiguous", "dsa", torch.float32),
    ("pages", "dsa", torch.float32),
    ("int8", "dsa", torch.float32),
]


@pytest.mark.parametrize("kind,family,dtype", CASES, ids=[f"{k}-{f}-{str(d)[6:]}" for k, f, d in CASES])
def test_a_packed_step_equals_its_rows_run_alone(kind, family, dtype):
    cfg = (CFG if family == "dense" else DSA.replace(index_topk=4)).replace(
        kv_lora_rank=128 if kind in ("fp8", "int8") else 16
    )
    layer = make_layer(cfg, seed=7, dtype=dtype)
    packed = prefilled(kind, cfg, layer, dtype)
    alone = [copy.deepcopy(packed) for _ in ROWS]
    x = {slot: randn(n, cfg.hidden_size, seed=60 + slot, dtype=dtype) for slot, n in ROWS}
    with torch.no_grad():
        plan = packed.plan([n for _, n in ROWS], [s for s, _ in ROWS])
        assert [ROWS[b][0] for b in plan.order] == [0, 3, 1, 2]  # decode, decode, extend, prefill
        assert [g.kind for g in plan.groups] == ["decode", "extend", "prefill"]
        assert plan.query_start_loc_cpu == [0, 1, 2, 7, 14] and plan.num_tokens == 14
        assert plan.seq_lens_cpu == [10, 15, 11, 7] and plan.slot_mapping.shape == (14,)
        hidden = torch.cat([x[ROWS[b][0]] for b in plan.order])  # [N, D], the plan's order
        out = layer(hidden, plan)
        packed.commit(plan)
        assert out.shape == (14, cfg.hidden_size)
        for cache, (slot, n) in zip(alone, ROWS, strict=True):
            want, one = layer.step(x[slot][None], cache, slots=[slot])
            i = plan.order.index(ROWS.index((slot, n)))
            lo, hi = plan.query_start_loc_cpu[i], plan.query_start_loc_cpu[i + 1]
            # the same path for the row alone as in the packed step: the cost model decides per row
            assert one.row_modes[0] == plan.row_modes[ROWS.index((slot, n))]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert_close(f"slot {slot} ({n} new)", out[lo:hi], want[0], rtol=tol)
    if family == "dsa":
        assert "sparse-absorb" in plan.row_modes  # the 14-token slot's decode row sees more than k keys
    # the caches hold the same latents after the step (projections over 14 rows or a few: the GEMMs'
    # blocking may differ in the last bits)
    for cache, (slot, _) in zip(alone, ROWS, strict=True):
        n = int(packed.lengths[slot])
        assert n == int(cache.lengths[slot])
        got = packed.view(torch.tensor([slot]), n)
        want = cache.view(torch.tensor([slot]), n)
        for name, g, w in zip(("c_kv", "k_pe"), got, want, strict=True):
            assert_close(f"slot {slot} {name}", g.float(), w.float(), rtol=tol)


def test_the_caller_rectangle_equals_the_packed_tokens():
    layer = make_layer(CFG, seed=2)
    caches = [prefilled("pages", CFG, layer, torch.float32) for _ in range(2)]
    counts = [n for _, n in ROWS]
    rect = randn(4, 7, CFG.hidden_size, seed=3)
    for row, n in enumerate(counts):
        rect[row, n:] = float("nan")  # padding: never read, zero in the output
    with torch.no_grad():
        plan = caches[0].plan(counts, [s for s, _ in ROWS], seq_len=7)
        got = layer(rect, plan)
        caches[0].commit(plan)
        plan = caches[1].plan(counts, [s for s, _ in ROWS])
        out = layer(torch.cat([rect[b, : counts[b]] for b in plan.order]), plan)
        caches[1].commit(plan)
    for i, b in enumerate(plan.order):
        lo, hi = plan.query_start_loc_cpu[i], plan.query_start_loc_cpu[i + 1]
        assert torch.equal(got[b, : counts[b]], out[lo:hi])
        assert torch.equal(got[b, counts[b] :], torch.zeros_like(got[b, counts[b] :]))


def test_a_packed_hidden_of_the_wrong_length_is_refused_before_any_write():
    layer = make_layer(CFG, seed=2)
    cache = prefilled("pages", CFG, layer, torch.float32)
    before = [t.clone() for t in cache.buffers()]
    plan = cache.plan([1, 5], [0, 1])
    with pytest.raises(ValueError, match=r"the plan packs \[6, 32\]"):
        layer(randn(7, CFG.hidden_size, seed=1), plan)
    assert plan.state == "open" and not plan.ran
    cache.discard(plan)
    assert all(torch.equal(a, b) for a, b in zip(cache.buffers(), before, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "half-split"])
def test_decode_rows_rotate_alike_in_one_pass_and_by_rotation_matrices(interleave, dtype, monkeypatch):
    """A step of decode rows only rotates its queries and keys by `apply_tables`' one pass where it
    runs (a rope width of 64; CPUs with the bf16 core), and by one rotation matrix per token where it
    does not: the same outputs and cached rope keys within the dtype's rounding (the bmm sums the two
    products in another order)."""
    cfg = tiny_config(qk_rope_head_dim=64, kv_lora_rank=32, rope_interleave=interleave)
    layer = make_layer(cfg, seed=3, dtype=dtype)
    caches = [prefilled("pages", cfg, layer, dtype) for _ in range(2)]
    slots = list(PREFIX)
    x = randn(len(slots), cfg.hidden_size, seed=9, dtype=dtype)
    outs, plans = [], []
    for cache, matrices in zip(caches, (False, True), strict=True):
        if matrices:
            monkeypatch.setattr("mlakit.cache.plan.one_pass", lambda *a: False)
        with torch.no_grad():
            plan = cache.plan([1] * len(slots), slots)
            outs.append(layer(x, plan))
            cache.commit(plan)
        plans.append(plan)
    fast = one_pass(torch.device("cpu"), dtype, 64, "interleave" if interleave else "half")
    assert (plans[0].rotation is None) == fast and plans[1].rotation is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close("layer output", outs[0], outs[1], rtol=tol)
    for slot in slots:
        n = int(caches[0].lengths[slot])
        got, want = (c.view(torch.tensor([slot]), n)[1] for c in caches)  # k_pe rows
        assert_close(f"slot {slot} k_pe", got.float(), want.float(), rtol=tol)

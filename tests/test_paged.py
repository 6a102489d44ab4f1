"""PagedLatentCache: paged == contiguous through appends, decodes, releases and reuse, with shuffled free
lists, NaN-poisoned pages and sentinel block-table entries; a pool shared with an engine (`adopt`);
edge cases; errors; a non-finite hidden state poisoning only its own slot over every page format; the
paged kernel's checks of the block table and lengths it would trust. The pool itself: test_block_pool.py."""

from __future__ import annotations

import pytest
import torch
from support.cache import CFG as STEP_CFG
from support.cache import DSA as STEP_DSA
from support.cache import small_config
from support.common import assert_close, make_layer, randn

from mlakit import LatentCache, MLAConfig, PagedLatentCache
from mlakit.cache.blocks import BlockPool
from mlakit.cache.paged import BLOCK_SENTINEL
from mlakit.ops import absorb
from mlakit.ops.paged import absorb_chunked


def poisoned(cfg, num_blocks, block_size, max_batch, seed=0, **kw) -> PagedLatentCache:
    """A paged cache whose free list is shuffled and whose every byte is 0xFF (NaN in every float format)."""
    cache = PagedLatentCache(cfg, num_blocks, block_size, max_batch=max_batch, **kw)
    cache.blocks.shuffle(seed)
    cache.pages.fill_(0xFF)
    return cache


def entries(batch, new, seed, cfg):
    return randn(batch, new, cfg.kv_lora_rank, seed=seed), randn(
        batch, new, cfg.qk_rope_head_dim, seed=seed + 1
    )


def assert_same_view(paged: PagedLatentCache, contiguous: LatentCache, slots: list[int]) -> None:
    """Both caches hold the same tokens; the paged view is zero past each slot's length."""
    assert paged.lengths.tolist() == contiguous.lengths.tolist()
    s = torch.tensor(slots)
    top = int(paged.lengths[s].max()) + 2
    got_c, got_k = paged.view(s, top)
    want_c, want_k = contiguous.view(s, top)
    for row, slot in enumerate(slots):
        n = int(paged.lengths[slot])
        assert torch.equal(got_c[row, :n], want_c[row, :n]) and torch.equal(got_k[row, :n], want_k[row, :n])
        assert not got_c[row, n:].any() and not got_k[row, n:].any(), "positions past the length are not zero"
    paged.blocks.check()


# PagedLatentCache alone


@pytest.mark.parametrize(
    "dtype, quant, want",
    [(torch.bfloat16, None, 1152), (torch.bfloat16, "fp8", 656), (torch.bfloat16, "int8", 644)],
    ids=["bf16", "fp8", "int8"],
)
def test_bytes_per_token_at_deepseek_v3_widths(dtype, quant, want):
    cache = PagedLatentCache(MLAConfig.preset("deepseek-v3"), 2, 4, max_batch=1, dtype=dtype, quant=quant)
    assert cache.bytes_per_token == want
    assert tuple(cache.pages.shape) == (2, 4, want) and cache.pages.dtype == torch.uint8


@pytest.mark.parametrize("block_size", [1, 3, 4], ids=["bs1", "bs3", "bs4"])
def test_views_equal_contiguous_through_appends_releases_and_reuse(block_size):
    cfg = small_config()
    paged = poisoned(cfg, 40, block_size, 3, seed=block_size)
    ref = LatentCache(cfg, 3, 40)
    steps = [([0, 1, 2], 5), ([2, 0], 1), ([1], 4), ("release", 0), ([0, 2], 3), ([0, 1, 2], 1)]
    for i, (slots, n) in enumerate(steps):
        if slots == "release":
            paged.release(n)
            ref.release(n)
            continue
        c, k = entries(len(slots), n, seed=10 * i, cfg=cfg)
        assert paged.append(c, k, slots=slots).tolist() == slots
        ref.append(c, k, slots=slots)
        assert_same_view(paged, ref, [0, 1, 2])
        assert_same_view(paged, ref, [2, 0])


@pytest.mark.parametrize("length", [3, 4, 5, 7, 8, 9], ids=lambda n: f"len{n}")
def test_lengths_at_block_boundaries(length):
    """Block size 4: lengths one below, at and one above the first two block boundaries."""
    cfg = small_config()
    paged, ref = poisoned(cfg, 8, 4, 2), LatentCache(cfg, 2, 12)
    for cache in (paged, ref):
        cache.append(*entries(2, length, seed=length, cfg=cfg))
    assert len(paged.blocks.tables[0]) == -(-length // 4)
    assert_same_view(paged, ref, [0, 1])
    for cache in (paged, ref):  # one more token: crosses into a new block exactly when length % 4 == 0
        cache.append(*entries(1, 1, seed=99, cfg=cfg), slots=[1])
    assert_same_view(paged, ref, [1, 0])


def test_chunk_that_fills_the_last_block_exactly():
    cfg = small_config()
    paged = poisoned(cfg, 3, 4, 1)
    paged.append(*entries(1, 3, seed=1, cfg=cfg))
    paged.append(*entries(1, 9, seed=2, cfg=cfg))  # 12 tokens = the whole pool
    assert paged.free_blocks == 0 and paged.lengths.tolist() == [12]
    with pytest.raises(ValueError, match="out of blocks"):
        paged.append(*entries(1, 1, seed=3, cfg=cfg))


def test_empty_slot_views_as_zeros_and_length_one_works():
    cfg = small_config()
    paged = poisoned(cfg, 4, 4, 2)
    c, k = paged.view(torch.tensor([0, 1]), 3)
    assert tuple(c.shape) == (2, 3, 20) and not c.any() and not k.any()
    c1, k1 = entries(1, 1, seed=5, cfg=cfg)
    paged.append(c1, k1, slots=[1])
    c, k = paged.view(torch.tensor([1, 0]), 1)
    assert torch.equal(c[0], c1[0]) and torch.equal(k[0], k1[0]) and not c[1].any()


def test_block_table_has_sentinels_past_each_slots_blocks_and_they_fail_loudly():
    cfg = small_config()
    paged = poisoned(cfg, 10, 4, 3, seed=7)
    paged.append(*entries(1, 9, seed=1, cfg=cfg), slots=[0])  # 3 blocks
    paged.append(*entries(1, 2, seed=2, cfg=cfg), slots=[2])  # 1 block
    table = paged.block_table
    assert table.dtype == torch.int32 and tuple(table.shape) == (3, 3)
    assert table[0].tolist() == paged.blocks.tables[0]
    assert table[1].tolist() == [BLOCK_SENTINEL] * 3
    assert table[2, 1:].tolist() == [BLOCK_SENTINEL] * 2
    with pytest.raises(IndexError):
        paged.pages.index_select(0, table[1].long())


def test_slot_mapping_locates_every_token_in_the_pages():
    cfg = small_config()
    paged = poisoned(cfg, 10, 4, 2, seed=2)
    c, k = entries(2, 6, seed=4, cfg=cfg)
    paged.append(c, k)
    assert torch.equal(paged.last_slot_mapping, paged.slot_mapping(torch.tensor([0, 1]), 6))
    mapping = paged.slot_mapping(torch.tensor([1]), 8)
    assert mapping[0, 6:].tolist() == [-1, -1]
    rows = paged.pages.view(-1, paged.bytes_per_token)[mapping[0, :6]]
    latent = rows[:, : 20 * 4].contiguous().view(torch.float32)
    assert torch.equal(latent, c[1])


def test_lowering_lengths_drops_tokens_and_frees_blocks_at_the_next_read():
    cfg = small_config()
    paged, ref = poisoned(cfg, 8, 4, 2, seed=5), LatentCache(cfg, 2, 32)
    for cache in (paged, ref):
        cache.append(*entries(2, 10, seed=1, cfg=cfg))  # 3 blocks each
    paged.lengths[0] = 5
    ref.lengths[0] = 5
    assert len(paged.blocks.tables[0]) == 3, "freed before anything read lengths"
    assert paged.free_blocks == 3  # 2 idle + 1 freed from slot 0 (5 tokens keep 2 blocks)
    assert len(paged.blocks.tables[0]) == 2
    for cache in (paged, ref):
        cache.append(*entries(2, 4, seed=2, cfg=cfg))  # overwrites the dropped tokens
    assert_same_view(paged, ref, [0, 1])


def test_lengths_cannot_be_raised_past_the_tokens_written():
    cfg = small_config()
    paged = poisoned(cfg, 4, 4, 1)
    paged.append(*entries(1, 2, seed=1, cfg=cfg))
    paged.lengths[0] = 3
    with pytest.raises(ValueError, match=r"lengths \[3\] outside 0..tokens written \[2\]"):
        paged.check_lengths()
    paged.lengths[0] = -1
    with pytest.raises(ValueError, match="lengths can only be lowered"):
        paged.view(torch.tensor([0]), 1)


def test_out_of_blocks_raises_before_anything_is_written():
    cfg = small_config()
    paged = poisoned(cfg, 4, 2, 2)
    paged.append(*entries(2, 4, seed=1, cfg=cfg))  # 2 full blocks each: pool full
    before = (paged.pages.clone(), paged.lengths.clone(), [list(t) for t in paged.blocks.tables])
    with pytest.raises(ValueError, match="out of blocks"):
        paged.append(*entries(2, 1, seed=2, cfg=cfg))
    assert torch.equal(paged.pages, before[0]) and torch.equal(paged.lengths, before[1])
    assert paged.blocks.tables == before[2]


# on a pool shared with an engine


def pool_cache(cfg, num_blocks=6, block_size=2, max_batch=3):
    pool = BlockPool(num_blocks, block_size, max_batch)
    pool.shuffle(1)
    cache = PagedLatentCache(cfg, num_blocks, block_size, max_batch=max_batch, pool=pool)
    cache.pages.fill_(0xFF)
    assert cache.blocks is pool
    return cache, pool


def test_a_slot_adopted_on_another_slots_pages_reads_them_and_goes_on_in_its_own():
    cfg = small_config()
    paged, pool = pool_cache(cfg)
    c, k = entries(1, 5, seed=1, cfg=cfg)
    paged.append(c, k, slots=[0])  # 3 pages, the last half full
    pages = pool.tables[0][:2]
    paged.adopt(1, pages)
    assert paged.lengths.tolist() == [5, 4, 0] and [pool.refs[p] for p in pages] == [2, 2]
    c2, k2 = entries(1, 3, seed=2, cfg=cfg)
    paged.append(c2, k2, slots=[1])
    assert pool.tables[1][:2] == pages and not set(pool.tables[1][2:]) & set(pool.tables[0])
    paged.release(0)  # slot 1 still holds the pages it started on
    want_c, want_k = torch.cat([c[:, :4], c2], 1), torch.cat([k[:, :4], k2], 1)
    got_c, got_k = paged.view(torch.tensor([1]), 8)
    assert torch.equal(got_c[:, :7], want_c) and torch.equal(got_k[:, :7], want_k) and not got_c[:, 7:].any()
    assert [pool.refs[p] for p in pages] == [1, 1] and paged.free_blocks == 2
    pool.check()


def test_adopt_refusals_change_nothing():
    cfg = small_config()
    paged, pool = pool_cache(cfg)
    paged.append(*entries(1, 5, seed=1, cfg=cfg), slots=[0])
    plan = paged.plan(1, [2])
    pages, idle = pool.tables[0][:2], next(iter(pool.free))
    before = (paged.pages.clone(), paged.lengths.clone(), list(pool.free), [list(t) for t in pool.tables])
    for slot, arg, match in [
        (0, pages, r"slot 0 holds 5 tokens or an open plan's rows, expected an empty slot"),
        (2, pages, r"slot 2 holds 0 tokens or an open plan's rows"),
        (1, [idle], rf"pages \[{idle}\]: free pages no prefix hash names hold nothing to share"),
        (1, [pages[0]] * 2, r"has duplicates"),
        (1, "x", r"pages must be integers"),
        (3, pages, r"slot 3 out of range"),
    ]:
        with pytest.raises(ValueError, match=match):
            paged.adopt(slot, arg)
        after = (paged.pages, paged.lengths, list(pool.free), pool.tables)
        assert (
            all(torch.equal(a, b) for a, b in zip(after[:2], before[:2], strict=True))
            and after[2:] == before[2:]
        )
    assert plan.state == "open"
    pool.check()


def test_check_append_counts_only_unshared_pages_past_the_lengths_as_free():
    cfg = small_config()
    paged, pool = pool_cache(cfg, num_blocks=4)
    paged.append(*entries(1, 4, seed=1, cfg=cfg), slots=[0])
    paged.adopt(1, pool.tables[0])
    paged.lengths[1] = 0  # its pages come back at the next read, but slot 0 still holds them
    with pytest.raises(ValueError, match=r"needs 3 more blocks of 2 tokens, 2 of 4 are free"):
        paged.check_append(6, torch.tensor([2]))
    paged.check_append(4, torch.tensor([2]))
    assert paged.free_blocks == 2 and pool.tables[1] == [] and pool.refs.count(1) == 2


def test_a_pool_of_another_shape_is_refused():
    cfg = small_config()
    with pytest.raises(
        ValueError, match=r"pool must be None or a BlockPool of .* \(6, 2, 3\), got BlockPool\(num_b"
    ):
        PagedLatentCache(cfg, 6, 2, max_batch=3, pool=BlockPool(6, 2, 2))
    with pytest.raises(ValueError, match=r"got 'pool'"):
        PagedLatentCache(cfg, 6, 2, max_batch=3, pool="pool")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=0), "num_blocks must be a positive integer, got 0"),
        (dict(block_size=0), "block_size must be a positive integer, got 0"),
        (dict(max_batch=0), "max_batch must be a positive integer, got 0"),
        (dict(quant="fp4"), "quant must be one of"),
        (dict(quant="fp8"), "fp8 needs kv_lora_rank divisible by 128, got 20"),
        (dict(dtype=torch.int8), "dtype must be a floating-point compute dtype of 16 bits or more"),
    ],
    ids=["blocks", "block-size", "batch", "quant", "fp8-width", "dtype"],
)
def test_constructor_rejects_bad_arguments(kwargs, match):
    args = dict(num_blocks=4, block_size=4, max_batch=1) | kwargs
    with pytest.raises(ValueError, match=match):
        PagedLatentCache(small_config(), **args)


def test_append_and_release_reject_bad_input():
    cfg = small_config()
    paged = poisoned(cfg, 4, 4, 2)
    c, k = entries(1, 2, seed=1, cfg=cfg)
    with pytest.raises(ValueError, match="c_kv has dtype torch.float64, cache holds torch.float32"):
        paged.append(c.double(), k.double())
    with pytest.raises(ValueError, match="slots .* out of range"):
        paged.append(c, k, slots=[2])
    with pytest.raises(ValueError, match="slot 2 out of range"):
        paged.release(2)
    assert paged.lengths.tolist() == [0, 0] and paged.free_blocks == 4


# through the layer


def run_script(layer, caches, script, seed):
    """Run each step of `script` on every cache; returns the outputs per cache."""
    cfg = layer.cfg
    outs = [[] for _ in caches]
    for i, (slots, new, mode) in enumerate(script):
        if slots == "release":
            for cache in caches:
                cache.release(new)
            continue
        x = randn(len(slots), new, cfg.hidden_size, seed=seed + i)
        for out, cache in zip(outs, caches, strict=True):
            with torch.no_grad():
                out.append(layer(x, cache, mode=mode, slots=slots))
    return outs


SCRIPT = [
    ([0, 1, 2], 9, "materialize"),  # prefill
    ([0, 1, 2], 1, "absorb"),  # decode
    ([2, 0], 1, "absorb"),
    ([1], 6, "auto"),  # a chunk of prefill over a prefix
    ("release", 0, None),
    ([0, 2], 5, "materialize"),  # slot 0 reused
    ([2, 0, 1], 1, "absorb"),
    ([1, 0], 3, "absorb"),
    ([0, 1, 2], 1, "materialize"),
]


@pytest.mark.parametrize("block_size", [1, 4, 16], ids=["bs1", "bs4", "bs16"])
def test_layer_on_paged_equals_contiguous_through_a_serving_script(block_size):
    cfg = small_config()
    layer = make_layer(cfg, seed=1)
    paged = poisoned(cfg, 60 // block_size + 6, block_size, 3, seed=block_size)
    ref = LatentCache(cfg, 3, 40)
    got, want = run_script(layer, [paged, ref], SCRIPT, seed=100)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(f"step {i}", g, w)
    assert_same_view(paged, ref, [0, 1, 2])


def test_layer_rejects_a_paged_cache_of_another_dtype_and_writes_nothing():
    cfg = small_config()
    layer = make_layer(cfg)
    paged = poisoned(cfg, 4, 4, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cache holds dtype torch.bfloat16, layer computes in torch.float32"):
        layer(randn(1, 2, cfg.hidden_size, seed=1), paged)
    assert paged.lengths.tolist() == [0] and paged.free_blocks == 4


def test_layer_out_of_blocks_leaves_the_cache_unchanged():
    cfg = small_config()
    layer = make_layer(cfg)
    paged = poisoned(cfg, 3, 4, 2)
    with torch.no_grad():
        layer(randn(2, 4, cfg.hidden_size, seed=1), paged)  # one full block per slot
        before = (paged.pages.clone(), paged.lengths.clone(), [list(t) for t in paged.blocks.tables])
        with pytest.raises(ValueError, match=r"needs 2 more blocks of 4 tokens, 1 of 3 are free"):
            layer(randn(2, 1, cfg.hidden_size, seed=2), paged)
    assert torch.equal(paged.pages, before[0]) and torch.equal(paged.lengths, before[1])
    assert paged.blocks.tables == before[2]


@pytest.mark.parametrize("mode", ["absorb", "materialize"])
@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_a_step_padded_past_one_rows_capacity_takes_the_rows_real_tokens(kind, mode):
    # 12 tokens of room: 12 pages of 1 token, or 12 per slot
    cfg = small_config()
    layer = make_layer(cfg)

    def make():
        return poisoned(cfg, 12, 1, 2) if kind == "paged" else LatentCache(cfg, 2, 12)

    cache, ref = make(), make()
    h = randn(1, 28, cfg.hidden_size, seed=2)
    h[0, 9:] = float("nan")  # padding: never read
    with torch.no_grad():
        out = layer(h, cache, new_tokens=[9], mode=mode)
        want = layer(h[:, :9], ref, mode=mode)
        assert_close("the padded step's real tokens", out[:, :9], want, 1e-6)
        assert not out[:, 9:].any()
        assert cache.lengths.tolist() == [9, 0]
        # what a row writes is what is checked: 4 more tokens do not fit, whatever the padded width
        before = [t.clone() for t in cache.buffers()]
        with pytest.raises(ValueError, match=r"\[4\] tokens"):
            layer(randn(1, 28, cfg.hidden_size, seed=3), cache, new_tokens=[4], mode=mode)
        # a width no step can have (past the model's context and the cache's room) is still refused
        with pytest.raises(ValueError, match=r"seq_len 4097 is wider than any step can be \(4096"):
            cache.plan([1], [1], seq_len=cfg.max_position_embeddings + 1)
    # as bytes: the padding's NaN rows compare equal to themselves
    after = cache.buffers()
    same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before, strict=True)]
    assert all(same), f"the refused step changed a buffer: {same}"
    assert cache.lengths.tolist() == [9, 0]


# absorb over pages read chunk by chunk


@pytest.mark.parametrize("chunk", [1, 5, 16, 17, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("new", [1, 4], ids=["decode", "new4"])
def test_absorb_chunked_over_pages_equals_absorb_over_the_gathered_context(chunk, new):
    """Ragged rows (a row shorter than one chunk, a row of exactly 16): every chunk boundary case."""
    cfg = small_config()
    paged = poisoned(cfg, 20, 4, 3, seed=chunk)
    for slots, n in (([0, 1, 2], 3), ([0, 2], 13), ([2], 22)):
        paged.append(*entries(len(slots), n, seed=n, cfg=cfg), slots=slots)
    h, dn, dv, lat = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_nope, q_pe = randn(3, new, h, dn, seed=1), randn(3, new, h, cfg.qk_rope_head_dim, seed=2)
    w_uk, w_uv = randn(h, dn, lat, seed=3), randn(h, dv, lat, seed=4)
    slots = torch.tensor([2, 1, 0])
    lens = paged.lengths[slots].clone()  # 38, 3, 16
    top = int(lens.max())
    c_kv, k_pe = paged.view(slots, top)
    want_out, want_lse = absorb(q_nope, q_pe, c_kv, k_pe, lens, w_uk, w_uv, 0.3)
    got_out, got_lse = absorb_chunked(
        q_nope, q_pe, paged.reader(slots, top), lens, w_uk, w_uv, 0.3, chunk_tokens=chunk
    )
    assert_close("out", got_out, want_out)
    # a query before its row's first key (row of 3 keys, 4 new) sees nothing: lse -inf in both
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse))
    seen = torch.isfinite(want_lse)
    assert_close("lse", got_lse[seen], want_lse[seen])


# latent 128: fp8 pages need whole groups of 128 latent values
POISON_CFGS = {"dense": STEP_CFG.replace(kv_lora_rank=128), "dsa": STEP_DSA.replace(kv_lora_rank=128)}


@pytest.mark.parametrize("mode", ["absorb", "materialize"])
@pytest.mark.parametrize("quant", [None, "fp8", "int8"], ids=["unquantized", "fp8", "int8"])
@pytest.mark.parametrize("family", ["dense", "dsa"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_hidden_poisons_its_slot_over_every_page_format(value, family, quant, mode):
    cfg = POISON_CFGS[family]
    layer = make_layer(cfg, seed=4)
    caches = [PagedLatentCache(cfg, 16, 4, max_batch=2, quant=quant) for _ in range(2)]
    x = randn(2, 27, cfg.hidden_size, seed=5)
    poisoned = x.clone()
    poisoned[0, 2, 3] = float(value)
    runs = []
    with torch.no_grad():
        for cache, h in zip(caches, (poisoned, x), strict=True):
            outs = [layer(h[:, :24], cache, mode=mode)]
            steps = [layer.step(h[:, t : t + 1], cache, mode=mode) for t in (24, 25, 26)]
            outs += [out for out, _ in steps]
            runs.append(outs)
    assert steps[-1][1].mode.startswith("sparse") == (family == "dsa")
    got, clean = runs
    # the poisoned slot: non-finite from the poisoned token on, in the prefill and every decode step
    assert not torch.isfinite(got[0][0, 2:]).any()
    assert all(not torch.isfinite(o[0]).any() for o in got[1:]), (
        "a decode step of the poisoned slot is finite"
    )
    # the other slot: bit for bit what it is beside a clean slot
    assert all(torch.equal(a[1], b[1]) for a, b in zip(got, clean, strict=True))


def paged_inputs():
    cache = PagedLatentCache(STEP_CFG, 8, 4, max_batch=2)
    q_nope, q_pe = torch.zeros(2, 1, 2, 8), torch.zeros(2, 1, 2, 4)
    return cache, (q_nope, q_pe, cache), (torch.zeros(2, 8, 16), torch.zeros(2, 6, 16), 0.3)


@pytest.mark.parametrize(
    "table, lens, match",
    [
        ([[0, 1], [2, BLOCK_SENTINEL]], [8, 5], "block_table names pages \\[2147483647\\]"),
        ([[0, -1], [2, 3]], [8, 5], "block_table names pages \\[-1\\]"),
        ([[0, 9], [2, 3]], [8, 5], "block_table names pages \\[9\\]"),
        ([[0, 1], [2, 3]], [9, 5], "kv_lens \\[9\\] of rows \\[0\\] outside 0..8"),
        ([[0, 1], [2, 3]], [8, -1], "kv_lens \\[-1\\]"),
    ],
    ids=["sentinel", "negative", "past-pool", "past-table", "negative-len"],
)
def test_absorb_paged_checks_the_table_and_lengths_it_would_trust(table, lens, match):
    from mlakit.kernels.checks import check_table
    from mlakit.kernels.paged import absorb_paged

    _, (q_nope, q_pe, cache), (w_uk, w_uv, scale) = paged_inputs()
    table, lens = torch.tensor(table, dtype=torch.int32), torch.tensor(lens)
    with pytest.raises(ValueError, match=match):
        absorb_paged(q_nope, q_pe, cache, table, lens, w_uk, w_uv, scale)
    with pytest.raises(ValueError, match=match):
        check_table(table, lens, 8, 4)
    check_table(torch.tensor([[0, 1], [2, BLOCK_SENTINEL]]), torch.tensor([8, 4]), 8, 4)  # past: unread

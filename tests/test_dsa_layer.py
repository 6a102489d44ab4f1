"""MLAAttention on DSA configs against transformers' DeepseekV32Attention / GlmMoeDsaAttention (their own
indexer, cache and eager attention), and the caches' indexer keys: contiguous and paged (NaN-poisoned
pages, fp8), ragged batches, rollback of lengths, bad inputs, a NaN in one slot's hidden states poisoning
that slot only."""

from __future__ import annotations

import pytest
import torch
from support.cache import DSA as STEP_DSA
from support.common import assert_close, make_layer, randn
from support.dsa import HIDDEN, hf_attention, run_hf

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.cache.paged import PagedLatentCache
from mlakit.cache.quant import dequantize, hadamard, quantize
from mlakit.ops.sparse import index_scores, select_topk


def our_layer(config, attn):
    cfg = MLAConfig.from_hf(config)
    layer = MLAAttention(cfg).eval()
    layer.load_state_dict(attn.state_dict(), strict=True)
    return cfg, layer


def schedule(seed: int, topk: int, batch: int = 2):
    """Prefill topk-3 (T < k), a 4-token chunk whose queries see k-2 .. k+1, then 10 decode steps."""
    first = topk - 3
    total = first + 4 + 10
    x = randn(batch, total, HIDDEN, seed=seed)
    return [x[:, :first], x[:, first : first + 4]] + [x[:, t : t + 1] for t in range(first + 4, total)]


def run_ours(layer, cache, chunks, mode="auto"):
    outs, modes = [], []
    with torch.no_grad():
        for x in chunks:
            out, plan = layer.step(x, cache, mode=mode)
            outs.append(out)
            modes.append(plan.mode)
    return torch.cat(outs, dim=1), modes


def contiguous(cfg, batch, total):
    return LatentCache(cfg, batch, total)


def paged_poisoned(cfg, batch, total, block=4, quant=None):
    cache = PagedLatentCache(
        cfg, num_blocks=3 * total // block + 8, block_size=block, max_batch=batch, quant=quant
    )
    cache._rows.view(torch.uint8)[:] = 0xFF  # NaN in every float field of every page
    return cache


@pytest.mark.parametrize("mode", ["auto", "absorb", "materialize"])
@pytest.mark.parametrize(
    "family,topk", [("v32", 8), ("glm5", 8), ("glm5", 12)], ids=["v32-k8", "glm5-k8", "glm5-k12"]
)
@pytest.mark.parametrize("kind", ["contiguous", "paged-nan"])
def test_layer_matches_theirs(family, topk, mode, kind):
    config, attn, rotary = hf_attention(family, topk=topk, seed=21)
    chunks = schedule(22, topk)
    want, _, hf_cache = run_hf(config, attn, rotary, chunks)
    cfg, layer = our_layer(config, attn)
    total = sum(x.shape[1] for x in chunks)
    cache = contiguous(cfg, 2, total) if kind == "contiguous" else paged_poisoned(cfg, 2, total)
    got, modes = run_ours(layer, cache, chunks, mode)
    first = topk - 3
    assert_close(f"{mode} prefill T<k", got[:, :first], want[:, :first])
    assert_close(f"{mode} chunk k-2..k+1", got[:, first : first + 4], want[:, first : first + 4])
    assert_close(f"{mode} decode", got[:, first + 4 :], want[:, first + 4 :])
    assert modes[0] in ("absorb", "materialize")  # every query sees < k: dense
    assert all(m.startswith("sparse-") for m in modes[1:]), modes
    if mode != "auto":
        assert set(modes[1:]) == {f"sparse-{mode}"}
    if kind == "contiguous":
        their_keys = hf_cache.layers[0].indexer_keys
        assert_close("cached indexer keys", cache._i_rows[0, :-1].view(2, total, -1), their_keys, rtol=1e-6)


def test_cache_bytes_count_the_indexer_key():
    cfg = MLAConfig.preset("deepseek-v3.2").replace(num_layers=1)
    assert LatentCache(cfg, 1, 4, dtype=torch.bfloat16).bytes_per_token == 1152 + 256
    for quant, want in ((None, 1408), ("fp8", 788), ("int8", 776)):
        cache = PagedLatentCache(cfg, 2, 4, max_batch=1, dtype=torch.bfloat16, quant=quant, device="meta")
        assert cache.bytes_per_token == want, quant


def test_ragged_batch_rows_match_their_own_runs():
    config, attn, _ = hf_attention("v32", topk=8, seed=23)
    cfg, layer = our_layer(config, attn)
    x = randn(3, 14, HIDDEN, seed=24)
    counts = [14, 7, 11]  # prefill past k for rows 0 and 2; row 1 sees <= k: dense
    cache = LatentCache(cfg, 3, 40)
    with torch.no_grad():
        prefill, plan = layer.step(x, cache, new_tokens=counts)
        modes = list(plan.row_modes)
        step = randn(3, 1, HIDDEN, seed=25)
        decode = layer(step, cache)
        for b, n in enumerate(counts):
            alone = LatentCache(cfg, 1, 40)
            want = layer(x[b : b + 1, :n], alone)
            assert_close(f"row {b} prefill", prefill[b : b + 1, :n], want)
            assert torch.equal(prefill[b, n:], torch.zeros_like(prefill[b, n:]))
            assert_close(f"row {b} decode", decode[b : b + 1], layer(step[b : b + 1], alone))
    assert modes[1] in ("absorb", "materialize") and modes[0].startswith("sparse-"), modes


@pytest.mark.parametrize("kind", ["contiguous", "paged-nan"])
def test_rollback_of_lengths_drops_the_indexer_keys_too(kind):
    config, attn, _ = hf_attention("glm5", topk=8, seed=26)
    cfg, layer = our_layer(config, attn)
    x = randn(1, 20, HIDDEN, seed=27)
    draft = randn(1, 3, HIDDEN, seed=28)
    make = contiguous if kind == "contiguous" else paged_poisoned
    with torch.no_grad():
        cache = make(cfg, 1, 40)
        layer(x[:, :16], cache)
        layer(draft, cache)  # a rejected draft: its latents and indexer keys must not be seen again
        cache.lengths[0] = 16
        got = torch.cat([layer(x[:, t : t + 1], cache) for t in range(16, 20)], dim=1)
        fresh = make(cfg, 1, 40)
        layer(x[:, :16], fresh)
        want = torch.cat([layer(x[:, t : t + 1], fresh) for t in range(16, 20)], dim=1)
    assert_close("after rollback", got, want, rtol=1e-6)


def test_no_cache_prefill_past_k_is_sparse():
    config, attn, rotary = hf_attention("v32", topk=8, seed=29)
    x = randn(2, 30, HIDDEN, seed=30)
    want, _, _ = run_hf(config, attn, rotary, [x])
    cfg, layer = our_layer(config, attn)
    for mode in ("absorb", "materialize", "auto"):
        with torch.no_grad():
            got, plan = layer.step(x, mode=mode)
        assert plan.mode.startswith("sparse-")
        assert_close(f"no cache {mode}", got, want)


@pytest.mark.parametrize("quant", ["fp8", "int8"])
def test_quantized_paged_cache_stays_close(quant):
    from support.common import make_layer, tiny_config

    # fp8 tiles the latent by 128 values: widths of 128 here
    cfg = tiny_config(
        hidden_size=48,
        kv_lora_rank=128,
        index_n_heads=8,
        index_head_dim=128,
        index_topk=8,
        indexer_rope_interleave=False,
    )
    layer = make_layer(cfg, seed=31)
    x = randn(1, 24, 48, seed=32)
    chunks = [x[:, :6], x[:, 6:10]] + [x[:, t : t + 1] for t in range(10, 24)]
    want, _ = run_ours(layer, contiguous(cfg, 1, 24), chunks)
    cache = PagedLatentCache(cfg, num_blocks=16, block_size=4, max_batch=1, quant=quant)
    assert cache.layout.index.dtype == (torch.float8_e4m3fn if quant == "fp8" else torch.int8)
    got, modes = run_ours(layer, cache, chunks)
    assert modes[-1].startswith("sparse-") and bool(torch.isfinite(got).all())
    # quantized indexer keys read back within the format's error of the exact ones
    with torch.no_grad():
        exact = layer.indexer.keys(x, *layer.rope.cos_sin(torch.arange(24)[None]))
    group = type("G", (), {"read_rows": cache._read_rows(torch.tensor([0]), 24)})
    keys = cache.index_keys(0, group, 24)
    assert cache.index_rotation is (quant == "fp8")
    if cache.index_rotation:
        exact = hadamard(exact)
    key_err = ((keys - exact).norm() / exact.norm()).item()
    assert key_err < (0.05 if quant == "fp8" else 0.01), f"{quant} indexer keys: relative error {key_err:.3g}"
    # fp8 latents alone cost ~3% here; a selection flipped by quantized keys moves single outputs more
    err = ((got - want).norm() / want.norm()).item()
    assert err < 0.25, f"{quant} cache: relative error {err:.3g}"


BAD = {
    "dense-cache": (lambda cfg: LatentCache(cfg.dense(), 1, 16), "indexer keys of width"),
    "narrower-index-cache": (lambda cfg: LatentCache(cfg.replace(index_head_dim=12), 1, 16), "indexer keys"),
}


@pytest.mark.parametrize("make,match", BAD.values(), ids=BAD.keys())
def test_a_cache_without_the_indexer_is_refused_unchanged(make, match):
    config, attn, _ = hf_attention("v32", topk=8, seed=33)
    cfg, layer = our_layer(config, attn)
    cache = make(cfg)
    before = [t.clone() for t in cache.buffers()]
    with pytest.raises(ValueError, match=match):
        layer(randn(1, 2, HIDDEN, seed=34), cache)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.buffers(), strict=True))


def test_strict_load_refuses_a_missing_or_misshapen_indexer():
    config, attn, _ = hf_attention("v32", topk=8, seed=35)
    cfg = MLAConfig.from_hf(config)
    state = attn.state_dict()
    with pytest.raises(RuntimeError, match="indexer.wk.weight"):
        MLAAttention(cfg).load_state_dict({k: v for k, v in state.items() if k != "indexer.wk.weight"})
    with pytest.raises(RuntimeError, match="indexer.wq_b.weight"):
        MLAAttention(cfg).load_state_dict({**state, "indexer.wq_b.weight": torch.zeros(3, 3)})
    with pytest.raises(RuntimeError, match="indexer"):
        MLAAttention(cfg.dense()).load_state_dict(state)


def overlap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean share of want's selection per query that got selects too."""
    hits = [len(set(a.tolist()) & set(b.tolist())) / len(b) for a, b in zip(got[0], want[0], strict=True)]
    return sum(hits) / len(hits)


def test_hadamard_cuts_the_fp8_indexer_error():
    """The reference's fp8 indexer: keys (and queries) rotated by H/√128 before e4m3 with power-of-two
    scales. Keys with a few outlier channels (as trained activations have) lose the most without it."""
    g = torch.Generator().manual_seed(40)
    heads, dim, keys, k = 16, 128, 4096, 256
    k_idx = torch.randn(1, keys, dim, generator=g)
    k_idx[..., :4] *= 30  # outlier channels
    q_idx = torch.randn(1, 8, heads, dim, generator=g)
    w = torch.rand(1, 8, heads, generator=g)
    lens = torch.tensor([keys])
    exact = select_topk(index_scores(q_idx.double(), w, k_idx.double(), lens), k)

    def fp8(x):
        values, scale = quantize(x.reshape(-1, dim), "fp8", 1, pow2=True)
        return dequantize(values, scale, torch.float32).view(x.shape)

    plain = select_topk(index_scores(q_idx, w, fp8(k_idx), lens), k)
    rotated = select_topk(index_scores(hadamard(q_idx), w, fp8(hadamard(k_idx)), lens), k)
    o_plain, o_rot = overlap(plain, exact), overlap(rotated, exact)
    print(f"selection overlap with fp64: fp8 {o_plain:.4f}, fp8 + Hadamard {o_rot:.4f}")
    assert o_rot > o_plain and o_rot > 0.95


@pytest.mark.parametrize("mode", ["absorb", "materialize"])
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_nan_in_a_dsa_slot_makes_its_outputs_nan_from_then_on_and_nowhere_else(kind, mode):
    layer = make_layer(STEP_DSA, seed=4)
    cache = (
        LatentCache(STEP_DSA, 2, 24)
        if kind == "contiguous"
        else PagedLatentCache(STEP_DSA, 12, 4, max_batch=2)
    )
    x = randn(2, 10, STEP_DSA.hidden_size, seed=5)
    x[0, 3] = float("nan")
    with torch.no_grad():
        prefill, plan = layer.step(x[:, :8], cache, mode=mode)
        assert plan.mode.startswith("sparse")
        outs = [layer(x[:, t : t + 1], cache, mode=mode) for t in (8, 9)]
    # NaN from that step on (docs/cache.md; the masked dense form may spread it to the step's earlier
    # queries: 0 · NaN), never to another slot
    assert torch.isnan(prefill[0, 3:]).all()
    assert all(torch.isnan(o[0]).all() for o in outs), "the poisoned slot's decode outputs are finite"
    assert torch.isfinite(prefill[1]).all() and all(torch.isfinite(o[1]).all() for o in outs)

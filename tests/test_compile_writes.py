"""The caches' writes under torch.compile: whole rows by one `index_put_` into the
buffer itself (`put_fields`, `PagedLatentCache._put_rows`, `LatentCache.write`) instead of writes
through layer, column or dtype views of it, which made inductor copy the whole buffer back at every
layer. The compiled step must
leave the very bytes the eager step leaves (latent, scales, rope key, DSA indexer key and its scales)
and give the same outputs."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_close, randn

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.cache.paged import PagedLatentCache
from mlakit.cache.quant import put_fields, token_layout

CFG = MLAConfig(
    hidden_size=64,
    num_heads=2,
    q_lora_rank=32,
    kv_lora_rank=128,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    rope_interleave=True,
    index_n_heads=2,
    index_head_dim=128,
    index_topk=8,
    indexer_rope_interleave=False,
)
LAYERS, BATCH = 2, 3


def stack():
    out = []
    for i in range(LAYERS):
        torch.manual_seed(30 + i)
        layer = MLAAttention(CFG, layer_idx=i).eval()
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() == 2:
                    p.normal_(0, p.shape[1] ** -0.5)
        out.append(layer)
    return out


def run_stack(layers, hidden, plan):
    for layer in layers:
        hidden = layer(hidden, plan)
    return hidden


def cache(quant):
    if quant == "contiguous":
        return LatentCache(CFG, BATCH, 24, num_layers=LAYERS)
    c = PagedLatentCache(CFG, 24, 4, max_batch=BATCH, num_layers=LAYERS, quant=quant)
    c.blocks.shuffle(5)
    return c


def buffers(c) -> torch.Tensor:
    """Every byte the cache holds, one uint8 tensor [layers, rows, bytes]."""
    if isinstance(c, LatentCache):
        return torch.cat([t.view(torch.uint8) for t in (c._c_rows, c._k_rows, c._i_rows)], dim=-1)
    return c._store.view(torch.uint8)


CASES = [
    *[pytest.param(q, "eager", id=f"{q or 'paged'}-eager") for q in ("contiguous", None, "fp8", "int8")],
    # one inductor compile (~60 s cold on a 2-core CPU): the kernels once seen copying the pool
    pytest.param("fp8", "inductor", id="fp8-inductor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("quant, backend", CASES)
def test_compiled_dsa_steps_write_the_eager_bytes(quant, backend):
    layers = stack()
    torch._dynamo.reset()
    compiled = torch.compile(run_stack, fullgraph=True, backend=backend)
    caches = [cache(quant), cache(quant)]
    with torch.no_grad():
        for step, new in enumerate([11, 1, 1, 1]):  # past index_topk 8: the selection is live
            h = randn(BATCH, new, CFG.hidden_size, seed=step)
            plans = [c.plan(new, batch=BATCH, mode="absorb") for c in caches]
            want = run_stack(layers, h, plans[0])
            got = (compiled if new == 1 else run_stack)(layers, h, plans[1])
            for c, p in zip(caches, plans, strict=True):
                c.commit(p)
            assert_close(f"step {step}", got, want, rtol=1e-5)
    eager_pool, graph_pool = (buffers(c) for c in caches)
    if backend == "eager":  # the same values: the same bytes
        assert torch.equal(graph_pool, eager_pool), "the compiled steps wrote other bytes"
        return
    # inductor fuses the norms and rope (fp32 round-off in scales and rope keys): values, not bytes
    written = eager_pool.ne(0).any(-1)  # [layers, rows]
    assert torch.equal(graph_pool[~written], eager_pool[~written]), "bytes written outside the step's rows"
    rows = torch.arange(eager_pool.shape[1])[None]
    for layer in range(LAYERS):
        (c0, k0), (c1, k1) = (c.gather(layer, rows) for c in caches)
        assert_close(f"layer {layer} latent", c1, c0, rtol=0.07)  # one fp8 step of the group's scale
        assert_close(f"layer {layer} rope key", k1, k0, rtol=1e-5)


def test_put_fields_keeps_the_other_fields():
    lay = token_layout(CFG, torch.float32, "fp8")
    store = torch.randint(0, 255, (2, 10, lay.row_bytes), dtype=torch.uint8)
    before = store.clone()
    target = torch.tensor([7, 2])
    scale = torch.tensor([[0.5], [2.0]])
    put_fields(store, 1, target, [(lay.scale, scale)])
    assert torch.equal(store[0], before[0])
    pool, before = store[1], before[1]
    span = slice(lay.scale.offset, lay.scale.offset + 4 * lay.scale.count)
    assert torch.equal(pool[target][:, span].view(torch.float32), scale)
    rest = torch.ones(lay.row_bytes, dtype=torch.bool)
    rest[span] = False
    assert torch.equal(pool[:, rest], before[:, rest])
    untouched = torch.tensor([i not in (2, 7) for i in range(10)])
    assert torch.equal(pool[untouched], before[untouched])

"""Materialize over a long cached prefix: chunked by `workspace_tokens` it equals one shot, and its
memory grows with the latent, not with per-head keys and values (docs/cache.md has DeepSeek-V3 at 64K)."""

from __future__ import annotations

import pytest
import torch
from support.cache import PeakMemory, small_config
from support.common import assert_close, make_layer, randn

from mlakit.cache.paged import PagedLatentCache

# many heads over a narrow latent, as in DeepSeek-V3 (128 heads x 320 values vs 576 per token)
WIDE = dict(num_heads=32, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, qk_rope_head_dim=4)


def prefix_cache(layer, context: int, quant=None, seed=0, through_layer=True) -> PagedLatentCache:
    cfg = layer.cfg
    cache = PagedLatentCache(cfg, 2 * (context // 16 + 2), 16, max_batch=2, quant=quant)
    cache.blocks.shuffle(seed)
    cache.pages.fill_(0xFF)
    if through_layer:
        with torch.no_grad():
            layer(randn(2, context, cfg.hidden_size, seed=seed), cache, mode="materialize")
    else:
        latent = randn(2, context, cfg.kv_lora_rank, seed=seed)
        cache.append(
            latent / latent.norm(dim=-1, keepdim=True) * cfg.kv_lora_rank**0.5,
            randn(2, context, cfg.qk_rope_head_dim, seed=seed + 1),
        )
    return cache


def prefill_over(layer, cache, context: int, workspace: int, new: int = 12) -> torch.Tensor:
    """`new` tokens over the first `context` cached tokens of each slot; the cache is left as it was."""
    layer.workspace_tokens = workspace
    cache.lengths[:] = context
    with torch.no_grad():
        out = layer(randn(2, new, layer.cfg.hidden_size, seed=7), cache, mode="materialize")
    cache.lengths[:] = context
    return out


@pytest.mark.parametrize("workspace", [1, 7, 64, 149, 150, 161], ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("quant", [None, "int8"], ids=["exact", "int8"])
def test_chunked_prefill_equals_one_shot(workspace, quant):
    """Context 150 + 12 new = 162 keys: chunks of 1, 7, 64, one short of the prefix, the prefix, all."""
    layer = make_layer(small_config(), seed=2)
    cache = prefix_cache(layer, 150, quant=quant)
    want = prefill_over(layer, cache, 150, workspace=10**9)
    assert_close(f"workspace {workspace}", prefill_over(layer, cache, 150, workspace), want)


def peak_bytes(layer, cache, context, workspace) -> int:
    with PeakMemory() as mem:
        prefill_over(layer, cache, context, workspace)
    return mem.peak


def test_chunked_prefill_memory_grows_with_the_latent_not_with_keys_and_values():
    layer = make_layer(small_config(**WIDE), seed=3)
    cache = prefix_cache(layer, 800, through_layer=False)
    # longest first: lengths can only be lowered
    chunked, one_shot = [], []
    for n in (800, 400):
        chunked.insert(0, peak_bytes(layer, cache, n, workspace=50))
        one_shot.insert(0, peak_bytes(layer, cache, n, workspace=10**9))
    print(f"peak bytes at 400 and 800 cached tokens: chunked {chunked}, one shot {one_shot}")
    assert chunked[1] < one_shot[1] / 4
    assert chunked[1] - chunked[0] < (one_shot[1] - one_shot[0]) / 4

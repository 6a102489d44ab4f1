"""The DSA cost model: the indexer's terms, selected pairs, break-even contexts, the sparse crossover band,
the indexer key's bytes, and the sparse sections of `mlakit cost` and `mlakit cache`."""

from __future__ import annotations

import json
import math

import pytest

from mlakit import MLAConfig
from mlakit.cli import main
from mlakit.cost import (
    absorb_macs,
    cache_economics,
    choose_sparse,
    dsa_breakeven,
    dsa_breakeven_bytes,
    dsa_decode_summary,
    index_key_bytes,
    indexer_macs,
    selected_pairs,
    sparse_crossover,
    sparse_path_macs,
)
from mlakit.cost.sparse import dense_core_macs, sparse_core_macs
from mlakit.cost.traffic import _cache_row_bytes

SPARSE = ["deepseek-v3.2", "glm-5"]
TINY = MLAConfig(
    hidden_size=64,
    num_heads=4,
    q_lora_rank=24,
    kv_lora_rank=20,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=8,
    indexer_rope_interleave=False,
)


@pytest.mark.parametrize("model", ["independent", "causal"])
@pytest.mark.parametrize("new,cached", [(1, 0), (1, 8), (1, 30), (5, 0), (5, 5), (12, 3), (20, 40)])
def test_selected_pairs_count_min_k_visible(new, cached, model):
    k = TINY.index_topk
    if model == "independent":
        want = new * min(k, cached)
    else:
        want = sum(min(k, cached + i) for i in range(1, new + 1))
    assert selected_pairs(TINY, new, cached, model) == want


def test_indexer_skipped_while_every_query_sees_at_most_k():
    on, off = indexer_macs(TINY, 1, 9), indexer_macs(TINY, 1, 8)
    assert off["index_scores"] == off["index_wq_b"] == off["index_weights"] == 0
    assert off["index_wk"] == on["index_wk"] > 0  # the key is cached either way
    assert on["index_scores"] == 9 * TINY.index_n_heads * (TINY.index_head_dim + 1)


@pytest.mark.parametrize("preset", SPARSE)
def test_breakeven_is_where_the_core_terms_cross(preset):
    cfg = MLAConfig.preset(preset)
    t = dsa_breakeven(cfg)
    below, above = math.floor(t), math.ceil(t)
    assert sum(sparse_core_macs(cfg, below).values()) > dense_core_macs(cfg, below)
    assert sum(sparse_core_macs(cfg, above).values()) < dense_core_macs(cfg, above)
    assert dsa_breakeven(cfg, include_projections=True) > t


@pytest.mark.parametrize("dtype,index_dtype", [("bf16", None), ("bf16", "fp8"), ("fp8", None)])
@pytest.mark.parametrize("preset", SPARSE)
def test_breakeven_bytes_balances_the_cache_reads(preset, dtype, index_dtype):
    cfg = MLAConfig.preset(preset)
    t = dsa_breakeven_bytes(cfg, dtype, index_dtype)
    row = sum(_cache_row_bytes(cfg, dtype))
    key = index_key_bytes(cfg, index_dtype or dtype)
    assert t * row == pytest.approx(cfg.index_topk * row + t * key)


@pytest.mark.parametrize("cached", [4096, 32768, 131072])
def test_decode_summary_is_the_terms_ratio(cached):
    cfg = MLAConfig.preset("deepseek-v3.2")
    s = dsa_decode_summary(cfg, cached)
    dense = sum(absorb_macs(cfg, 1, cached).values())
    sparse = sparse_path_macs(cfg, "sparse-absorb", 1, cached)
    assert s["all_terms"]["ratio"] == pytest.approx(dense / sparse)
    assert s["core"]["ratio"] > s["all_terms"]["ratio"]  # the constant terms only narrow the gap
    assert 0 < s["core"]["indexer_share"] < 1


@pytest.mark.parametrize("context", [0, 1024, 2048, 4096])
def test_sparse_crossover_band_edges_flip_the_choice(context):
    cfg = MLAConfig.preset("deepseek-v3.2")
    band = sparse_crossover(cfg, context)
    assert band is not None
    lower, upper = band

    def cheaper_mat(n):
        return sparse_path_macs(cfg, "sparse-materialize", n, context, "causal") < sparse_path_macs(
            cfg, "sparse-absorb", n, context, "causal"
        )

    assert cheaper_mat(lower * 1.001) and (lower <= 1 or not cheaper_mat(lower * 0.999))
    assert upper is not None and cheaper_mat(upper * 0.999) and not cheaper_mat(upper * 1.001)


def test_sparse_crossover_none_at_long_context():
    assert sparse_crossover(MLAConfig.preset("deepseek-v3.2"), 32768) is None


def test_auto_picks_absorb_for_decode_and_materialize_for_a_fresh_prefill():
    cfg = MLAConfig.preset("deepseek-v3.2")
    assert choose_sparse(cfg, 1, 131072) == "sparse-absorb"
    assert choose_sparse(cfg, 4096, 0) == "sparse-materialize"
    assert choose_sparse(cfg, 64, 65536) == "sparse-absorb"


@pytest.mark.parametrize("dtype,want", [("bf16", 2 * 128), ("fp8", 128 + 4), ("fp32", 4 * 128)])
def test_index_key_bytes(dtype, want):
    assert index_key_bytes(MLAConfig.preset("deepseek-v3.2"), dtype) == want


def test_dense_models_have_no_indexer_terms():
    cfg = MLAConfig.preset("deepseek-v3")
    assert "indexer" not in cache_economics(cfg, 10)
    with pytest.raises(ValueError, match="no indexer"):
        index_key_bytes(cfg)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cli_cache_counts_the_indexer_key(capsys, dtype):
    assert main(["cache", "--model", "deepseek-v3.2", "--context", "1000", "--dtype", dtype, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    ix = r["indexer"]
    key = ix["index_key_bytes_per_token_per_layer"]
    assert key == index_key_bytes(MLAConfig.preset("deepseek-v3.2"), dtype)
    assert ix["mla_with_indexer_bytes_per_token_per_layer"] == r["bytes_per_token_per_layer"]["mla"] + key
    assert ix["mla_with_indexer_bytes_per_sequence"] == (r["bytes_per_token_per_layer"]["mla"] + key) * 61000


def test_cli_cost_has_a_sparse_section(capsys):
    argv = ["cost", "--model", "deepseek-v3.2", "--context", "131072", "--new", "1"]
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["sparse"]
    assert r["auto_picks"] == "sparse-absorb" and not r["dense"]
    assert r["totals"]["sparse-absorb"]["macs"] == sparse_path_macs(
        MLAConfig.preset("deepseek-v3.2"), "sparse-absorb", 1, 131072, "causal"
    )
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "DSA decode beats dense absorb from" in text and "sparse-absorb" in text
    assert main(["cost", "--model", "deepseek-v3", "--context", "10", "--new", "1", "--json"]) == 0
    assert "sparse" not in json.loads(capsys.readouterr().out)

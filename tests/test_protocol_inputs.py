"""The step protocol's inputs: DSA index scores within the score budget and the poisoned-slot contract,
from_hf of DSA / Mistral-Large-4 configs and JSON null, the kernel's trusted inputs checked where
they are host facts, and the refusals that must name their argument before any change."""

from __future__ import annotations

import pytest
import torch
from support.cache import CFG, DSA
from support.common import make_layer, randn
from support.dsa import hf_config

from mlakit import LatentCache, MLAConfig
from mlakit.cache.blocks import BlockPool
from mlakit.cache.paged import BLOCK_SENTINEL, PagedLatentCache
from mlakit.cli import main
from mlakit.ops import common
from mlakit.ops.sparse import index_scores, index_topk, select_topk


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_index_topk_scores_a_block_of_queries_at_a_time_and_selects_the_same(monkeypatch):
    batch, new, keys, heads, dim, k = 2, 200, 256, 3, 8, 7
    q, w = randn(batch, new, heads, dim, seed=1), randn(batch, new, heads, seed=2)
    k_idx, kv_lens = randn(batch, keys, dim, seed=3), torch.tensor([230, 256])
    w[0, 5, :] = 0  # a query whose scores all tie at 0: the tie rule decides
    want = select_topk(index_scores(q, w, k_idx, kv_lens, max_keys=keys), k)
    monkeypatch.setattr(common, "SCORE_BUDGET", batch * 16 * keys)  # 16 queries a block
    probe = LargestTensor()
    with probe:
        got = index_topk(q, w, k_idx, kv_lens, k, max_keys=keys)
    assert torch.equal(got, want)
    print(f"largest tensor {probe.numel:,} elements, [B, S, T] {batch * new * keys:,}")
    assert probe.numel <= batch * 16 * keys * heads  # the block's dot products, never [B, S, T]


@pytest.mark.parametrize("mode", ["absorb", "materialize"])
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_nan_in_a_dsa_slot_makes_its_outputs_nan_from_then_on_and_nowhere_else(kind, mode):
    layer = make_layer(DSA, seed=4)
    cache = LatentCache(DSA, 2, 24) if kind == "contiguous" else PagedLatentCache(DSA, 12, 4, max_batch=2)
    x = randn(2, 10, DSA.hidden_size, seed=5)
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


# latent 128: fp8 pages need whole groups of 128 latent values
POISON_CFGS = {"dense": CFG.replace(kv_lora_rank=128), "dsa": DSA.replace(kv_lora_rank=128)}


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


def test_select_topk_ranks_nan_first():
    scores = torch.tensor([[[0.5, float("nan"), 2.0, -float("inf"), 1.0]]])
    assert select_topk(scores, 2).tolist() == [[[1, 2]]]


def test_from_hf_dsa_without_index_topk_is_sparse_with_transformers_default():
    d = hf_config("v32").to_dict()
    d.pop("index_topk")
    theirs = type(hf_config("v32"))(**d)
    cfg = MLAConfig.from_hf(d)
    assert cfg.is_sparse and cfg.index_topk == theirs.index_topk == 2048


def test_from_hf_mistral_large4_text_without_rms_norm_eps_takes_transformers_default():
    from transformers import CONFIG_MAPPING

    d = hf_config("v32").to_dict()
    d.update(model_type="mistral_large4_text")
    d.pop("rms_norm_eps")
    assert MLAConfig.from_hf(d).rms_norm_eps == CONFIG_MAPPING["mistral_large4_text"]().rms_norm_eps


@pytest.mark.parametrize("key", ["num_hidden_layers", "max_position_embeddings", "model_type"])
def test_from_hf_reads_json_null_as_absent_as_documented(key):
    from mlakit.hf.config import NULL_AS_ABSENT

    d = hf_config("v32").to_dict()
    d.pop("index_topk")  # a model_type-free DSA config: read without its family's indexer rope table
    d["indexer_rope_interleave"] = False
    nulled, dropped = dict(d, **{key: None}), {k: v for k, v in d.items() if k != key}
    assert MLAConfig.from_hf(nulled) == MLAConfig.from_hf(dropped)
    assert key in NULL_AS_ABSENT


def paged_inputs():
    cache = PagedLatentCache(CFG, 8, 4, max_batch=2)
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


def test_refusals_name_their_argument():
    with pytest.raises(ValueError, match="strict must be True or False"):
        __import__("mlakit.hf", fromlist=["patch"]).patch(torch.nn.Linear(2, 2), strict="no")
    with pytest.raises(ValueError, match="batch_size=1000000 x max_seq_len=1000000.*lower batch_size"):
        LatentCache(CFG, 10**6, 10**6)
    with pytest.raises(ValueError, match="num_blocks=1000000000.*lower num_blocks"):
        PagedLatentCache(CFG, 10**9, 64, max_batch=1)
    with pytest.raises(ValueError, match="BlockPool\\(num_blocks=10000000000.*lower num_blocks"):
        BlockPool(10**10, 1, 1)


def test_check_of_a_dsa_model_at_1m_tokens_refuses_in_one_line(capsys):
    from mlakit.commands.check import WORKSPACE_TOKENS
    from mlakit.ops.materialize import DEFAULT_WORKSPACE_TOKENS

    assert WORKSPACE_TOKENS == DEFAULT_WORKSPACE_TOKENS
    assert main(["check", "--model", "deepseek-v3.2", "--prefill", "1M"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlakit check: error:") and "--prefill" in err and "\n" not in err


def test_sparse_materialize_holds_one_key_block_of_the_selection_at_a_time():
    from mlakit.ops.sparse import sparse_absorb, sparse_materialize

    new, keys, k = 96, 256, 8
    case = dict(
        q_nope=randn(1, new, 2, 8, seed=20),
        q_pe=randn(1, new, 2, 4, seed=21),
        c_kv=randn(1, keys, 16, seed=22),
        k_pe=randn(1, keys, 4, seed=23),
        kv_lens=torch.tensor([keys]),
        w_uk=randn(2, 8, 16, seed=24),
        w_uv=randn(2, 6, 16, seed=25),
        scale=0.3,
    )
    scores = index_scores(randn(1, new, 2, 8, seed=26), randn(1, new, 2, seed=27), randn(1, keys, 8, seed=28),
                          case["kv_lens"])  # fmt: skip
    idx = select_topk(scores, k)
    probe = LargestTensor()
    with probe:
        got, _ = sparse_materialize(**case, indices=idx, workspace_tokens=32)
    want, _ = sparse_absorb(**case, indices=idx)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    print(f"largest tensor {probe.numel:,}, [S, T] {new * keys:,}")
    assert probe.numel < new * keys // 2

"""DSA ops: index scores against an fp64 oracle and transformers' indexers, the tie rule, the rope
layout of each family, and sparse attention against transformers' DSA attention given its indices; NaN
ranked first; top-k scoring a block of queries and sparse materialize a block of keys at a time."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_close, assert_lse_close, randn
from support.dsa import (
    FAMILIES,
    HIDDEN,
    assert_same_selection,
    hf_attention,
    oracle_scores,
    run_hf,
)

from mlakit import MLAAttention, MLAConfig
from mlakit.indexer import Indexer
from mlakit.ops import absorb, reference
from mlakit.ops.sparse import index_scores, index_topk, select_topk, sparse_absorb, sparse_materialize
from mlakit.rope import RotaryTable, attention_factor, inv_freq


def our_indexer(config, attn, cfg=None):
    cfg = cfg or MLAConfig.from_hf(config)
    indexer = Indexer(cfg)
    indexer.load_state_dict(attn.indexer.state_dict(), strict=True)
    return cfg, indexer.eval()


def fresh_scores(cfg, indexer, attn, x):
    """Our index scores of a fresh prefill x [B,N,D] (positions 0..N-1)."""
    batch, new, _ = x.shape
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    cos, sin = RotaryTable(cfg).cos_sin(torch.arange(new)[None].expand(batch, new))
    q_idx, w, k_idx = indexer(x, q_resid, cos, sin)
    return index_scores(q_idx, w, k_idx, torch.full((batch,), new)), q_resid


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch,new", [(1, 1), (2, 7), (1, 33)], ids=["B1-N1", "B2-N7", "B1-N33"])
def test_index_scores_match_fp64_oracle(family, batch, new):
    config, attn, _ = hf_attention(family, seed=3)
    cfg, indexer = our_indexer(config, attn)
    x = randn(batch, new, HIDDEN, seed=4)
    with torch.no_grad():
        got, q_resid = fresh_scores(cfg, indexer, attn, x)
        want = oracle_scores(indexer, cfg, x, q_resid, inv_freq(cfg), attention_factor(cfg))
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "visible keys differ from causal"
    finite = torch.isfinite(want)
    assert_close(f"{family} index scores", got[finite], want[finite].float(), rtol=1e-5)


@pytest.mark.parametrize("topk", [4, 8, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_selection_matches_their_indexer(family, topk):
    config, attn, rotary = hf_attention(family, topk=topk, seed=5)
    cfg, indexer = our_indexer(config, attn)
    x = randn(2, 40, HIDDEN, seed=6)
    positions = torch.arange(40)[None].expand(2, 40)
    mask = torch.zeros(40, 40).masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
    with torch.no_grad():
        scores, q_resid = fresh_scores(cfg, indexer, attn, x)
        exact = oracle_scores(indexer, cfg, x, q_resid, inv_freq(cfg), attention_factor(cfg))
        theirs = attn.indexer(x, q_resid, rotary(x, positions), mask[None].expand(2, 40, 40), None)
    ours = select_topk(scores, topk)
    exact_ties = assert_same_selection("ours", ours, exact, topk)
    assert_same_selection("theirs", theirs.long(), exact, topk)
    assert exact_ties > 0.9 * 2 * 40, f"only {exact_ties} of 80 selections were decided by a margin"


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_layout_is_the_models(family):
    """V3.2's indexer rotates halves, GLM-5's interleaved pairs; the other layout changes the scores
    and the selection transformers makes."""
    config, attn, rotary = hf_attention(family, topk=8, seed=7)
    cfg = MLAConfig.from_hf(config)
    assert cfg.indexer_rope_interleave is (family == "glm5")
    wrong_cfg = cfg.replace(indexer_rope_interleave=not cfg.indexer_rope_interleave)
    x = randn(1, 48, HIDDEN, seed=8)
    positions = torch.arange(48)[None]
    mask = torch.zeros(48, 48).masked_fill(~torch.ones(48, 48, dtype=torch.bool).tril(), float("-inf"))
    with torch.no_grad():
        theirs = attn.indexer(x, attn.q_a_layernorm(attn.q_a_proj(x)), rotary(x, positions), mask[None], None)
        picks = {}
        for name, c in (("right", cfg), ("wrong", wrong_cfg)):
            c, indexer = our_indexer(config, attn, c)
            scores, _ = fresh_scores(c, indexer, attn, x)
            picks[name] = select_topk(scores, 8)
    same, wrong = (agreement(picks[name][0], theirs.long()[0]) for name in ("right", "wrong"))
    assert sum(same) >= 46, f"right layout agrees with transformers on {sum(same)} of 48 queries"
    assert sum(wrong) < 40, f"the wrong layout still agrees on {sum(wrong)} of 48 queries"


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> list[bool]:
    """Per query t: the same set of visible positions (0..t) picked."""
    return [
        {i for i in a.tolist() if 0 <= i <= t} == {i for i in b.tolist() if 0 <= i <= t}
        for t, (a, b) in enumerate(zip(ours, theirs, strict=True))
    ]


TIES = {
    # scores of one query, k, the expected selection (ascending; -1: nothing left to see)
    "no-ties": ([3.0, 1.0, 2.0, 0.0], 2, [0, 2]),
    "tie-at-kth-lowest-wins": ([1.0, 2.0, 1.0, 1.0], 2, [0, 1]),
    "all-equal": ([5.0, 5.0, 5.0, 5.0, 5.0], 3, [0, 1, 2]),
    "ties-above-kth-kept": ([2.0, 2.0, 1.0, 1.0], 3, [0, 1, 2]),
    "fewer-visible": ([1.0, float("-inf"), 0.5, float("-inf")], 3, [0, -1, 2]),
    "k-over-length": ([0.0, 1.0], 5, [0, 1]),
    "zeros-after-relu": ([0.0, 0.0, 0.3, 0.0], 2, [0, 2]),
}


@pytest.mark.parametrize("scores,k,want", TIES.values(), ids=TIES.keys())
def test_select_topk_tie_rule(scores, k, want):
    got = select_topk(torch.tensor(scores)[None, None], k)
    assert got[0, 0].tolist() == want


def test_select_topk_rejects_bad_k():
    for k in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="index_topk"):
            select_topk(torch.zeros(1, 1, 4), k)


def schedule(seed: int, topk: int):
    """Prefill of topk-3 tokens (T < k), a 4-token chunk whose queries see k-2 .. k+1, then 10 decode
    steps (k+2 .. k+11); batch 2."""
    first = topk - 3
    total = first + 4 + 10
    x = randn(2, total, HIDDEN, seed=seed)
    return [x[:, :first], x[:, first : first + 4]] + [x[:, t : t + 1] for t in range(first + 4, total)]


@pytest.mark.parametrize("op", ["absorb", "materialize"])
@pytest.mark.parametrize(
    "family,topk", [("v32", 8), ("glm5", 8), ("v32", 12)], ids=["v32-k8", "glm5-k8", "v32-k12"]
)
def test_sparse_attention_matches_theirs_given_their_indices(family, topk, op):
    config, attn, rotary = hf_attention(family, topk=topk, seed=9)
    chunks = schedule(10, topk)
    want, their_idx, _ = run_hf(config, attn, rotary, chunks)
    cfg = MLAConfig.from_hf(config)
    dense = MLAAttention(
        cfg.replace(index_n_heads=None, index_head_dim=None, index_topk=None, indexer_rope_interleave=None)
    ).eval()
    missing, unexpected = dense.load_state_dict(attn.state_dict(), strict=False)
    assert not missing and all(k.startswith("indexer.") for k in unexpected)
    w_uk, w_uv = dense.up_weights()
    fn = sparse_absorb if op == "absorb" else sparse_materialize
    outs, ctx, past = [], [], 0
    with torch.no_grad():
        for x, idx in zip(chunks, their_idx, strict=True):
            batch, new, _ = x.shape
            q_nope, q_pe, c_kv, k_pe = dense.project(x, (past + torch.arange(new))[None].expand(batch, new))
            ctx.append((c_kv, k_pe))
            c_all, k_all = (torch.cat([c[i] for c in ctx], dim=1) for i in (0, 1))
            lens = torch.full((batch,), past + new)
            o, _ = fn(q_nope, q_pe, c_all, k_all, lens, w_uk, w_uv, dense.scale, indices=idx)
            outs.append(dense.o_proj(o.reshape(batch, new, -1)))
            past += new
    got = torch.cat(outs, dim=1)
    first = topk - 3
    assert_close(f"{op} prefill T<k", got[:, :first], want[:, :first])
    assert_close(f"{op} chunk T=k-2..k+1", got[:, first : first + 4], want[:, first : first + 4])
    assert_close(f"{op} decode past k", got[:, first + 4 :], want[:, first + 4 :])


def random_case(seed: int, batch=2, new=5, keys=23, heads=3, latent=16, dn=6, dr=4, dv=5):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(
        q_nope=r(batch, new, heads, dn),
        q_pe=r(batch, new, heads, dr),
        c_kv=r(batch, keys, latent),
        k_pe=r(batch, keys, dr),
        kv_lens=torch.tensor([keys, keys - 6][:batch]),
        w_uk=r(heads, dn, latent) / latent**0.5,
        w_uv=r(heads, dv, latent) / latent**0.5,
        scale=(dn + dr) ** -0.5,
    )


def all_visible(kv_lens, new, keys):
    """indices [B,S,keys]: every position, in a shuffled order; the ops must drop the invisible ones."""
    g = torch.Generator().manual_seed(0)
    return torch.stack([torch.randperm(keys, generator=g) for _ in range(kv_lens.numel() * new)]).view(
        kv_lens.numel(), new, keys
    )


@pytest.mark.parametrize("fn", [sparse_absorb, sparse_materialize], ids=["absorb", "materialize"])
def test_selecting_everything_is_dense_attention(fn):
    case = random_case(11)
    case["c_kv"][1, 17:] = float("nan")  # row 1 holds 17 tokens: the rest must never be read
    case["k_pe"][1, 17:] = float("nan")
    idx = all_visible(case["kv_lens"], 5, 23)
    got, got_lse = fn(**case, indices=idx)
    want, want_lse = reference(**case)
    assert_close("all selected", got, want)
    assert_lse_close("all selected lse", got_lse, want_lse)
    dense, _ = absorb(**case)
    assert_close("vs absorb", got, dense)


@pytest.mark.parametrize("seed", [12, 13])
def test_sparse_materialize_equals_sparse_absorb(seed):
    case = random_case(seed)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, 23, (2, 5, 9), generator=g)
    idx = torch.stack([torch.randperm(23, generator=g)[:9] for _ in range(10)]).view(2, 5, 9)
    idx[0, 0, :3] = -1  # padding entries
    case["c_kv"][1, 17:] = float("nan")
    a, a_lse = sparse_absorb(**case, indices=idx)
    m, m_lse = sparse_materialize(**case, indices=idx, workspace_tokens=7)
    assert_close("materialize vs absorb", m, a)
    assert_lse_close("lse", m_lse, a_lse)


BAD_INDICES = {
    "rank-2": (torch.zeros(2, 5, dtype=torch.long), "indices must be"),
    "wrong-queries": (torch.zeros(2, 4, 3, dtype=torch.long), "indices must be"),
    "float": (torch.zeros(2, 5, 3), "integers"),
    "bool": (torch.zeros(2, 5, 3, dtype=torch.bool), "integers"),
}


@pytest.mark.parametrize("fn", [sparse_absorb, sparse_materialize], ids=["absorb", "materialize"])
@pytest.mark.parametrize("indices,match", BAD_INDICES.values(), ids=BAD_INDICES.keys())
def test_bad_indices_raise(fn, indices, match):
    with pytest.raises(ValueError, match=match):
        fn(**random_case(14), indices=indices)


DSA = dict(index_n_heads=4, index_head_dim=16, index_topk=8, indexer_rope_interleave=False)
BAD_CONFIGS = {
    "no-q-lora": (dict(DSA, q_lora_rank=None), "q_lora_rank"),
    "index-dim-equals-rope": (dict(DSA, index_head_dim=4), "index_head_dim"),
    "index-dim-below-rope": (dict(DSA, index_head_dim=2), "index_head_dim"),
    "topk-missing": (dict(DSA, index_topk=None), "all-or-none"),
    "layout-missing": (dict(DSA, indexer_rope_interleave=None), "all-or-none"),
    "heads-zero": (dict(DSA, index_n_heads=0), "index_n_heads"),
    "topk-float": (dict(DSA, index_topk=8.0), "index_topk"),
    "layout-int": (dict(DSA, indexer_rope_interleave=1), "indexer_rope_interleave"),
}


@pytest.mark.parametrize("changes,match", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_indexer_config_raises(changes, match):
    from support.common import tiny_config

    with pytest.raises(ValueError, match=match):
        tiny_config(**changes)


@pytest.mark.parametrize(
    "preset,heads,interleave", [("deepseek-v3.2", 64, False), ("glm-5", 32, True)], ids=["v3.2", "glm-5"]
)
def test_presets_carry_the_published_indexer(preset, heads, interleave):
    cfg = MLAConfig.preset(preset)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (heads, 128, 2048)
    assert cfg.indexer_rope_interleave is interleave and cfg.is_sparse
    assert not MLAConfig.preset("deepseek-v3").is_sparse


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_reads_their_dsa_config(family):
    default = FAMILIES[family][0]()
    cfg = MLAConfig.from_hf(default)
    want = MLAConfig.preset("deepseek-v3.2" if family == "v32" else "glm-5")
    for f in ("index_n_heads", "index_head_dim", "index_topk", "indexer_rope_interleave", "q_lora_rank"):
        assert getattr(cfg, f) == getattr(want, f), f
    d = default.to_dict()
    d["model_type"] = "some_new_dsa"
    with pytest.raises(ValueError, match="indexer rope layout"):
        MLAConfig.from_hf(d)


@pytest.mark.parametrize("family", FAMILIES)
def test_index_scores_in_small_blocks_and_query_chunks(family, monkeypatch):
    import mlakit.ops.common as common
    import mlakit.ops.sparse as sparse

    config, attn, _ = hf_attention(family, seed=3)
    cfg, indexer = our_indexer(config, attn)
    x = randn(2, 23, HIDDEN, seed=4)
    with torch.no_grad():
        whole, q_resid = fresh_scores(cfg, indexer, attn, x)
        monkeypatch.setattr(sparse, "INDEX_KEY_BLOCK", 5)  # 23 keys: 4 full blocks and one of 3
        monkeypatch.setattr(common, "SCORE_BUDGET", 2 * 8 * 5 * 3)  # 3 queries per chunk
        blocked, _ = fresh_scores(cfg, indexer, attn, x)
        want = oracle_scores(indexer, cfg, x, q_resid, inv_freq(cfg), attention_factor(cfg))
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(blocked), torch.isneginf(want))
    assert_close("blocked index scores", blocked[finite], want[finite].float(), rtol=1e-5)
    assert_close("blocked vs whole", blocked[finite], whole[finite], rtol=1e-6)


_PEAK_SCRIPT = """
import sys, torch
from mlakit.ops import common, sparse
common.SCORE_BUDGET = 1 << 20  # 4 MB of fp32 scores per block
torch.manual_seed(0)
b, s, t = 1, 4096, 4096  # all the scores at once: 64 MB
q, w, k = torch.randn(b, s, 2, 8), torch.randn(b, s, 2), torch.randn(b, t, 8)
lens = torch.tensor([t])
sparse.index_topk(q[:, :64], w[:, :64], k, lens, 16)  # warm: libraries and thread pools loaded
def hwm():
    return int(next(x for x in open("/proc/self/status") if x.startswith("VmHWM")).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # resets the peak resident size to the current one
base = hwm()
got = sparse.index_topk(q, w, k, lens, 16)
print(hwm() - base)
"""


def test_index_topk_peak_memory_stays_near_the_score_budget():
    """Issue: the selection's working set (a NaN-free copy, an int64 running count, fp32 ranks, bool
    masks) held ~12 score budgets at once (49 MB here); now about 1.5 (6 MB)."""
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident size")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    peak = int(run.stdout.split()[-1])
    budget_bytes = 4 << 20
    assert peak < 3 * budget_bytes, f"peak {peak / 2**20:.1f} MB over a {budget_bytes >> 20} MB score budget"


def test_index_topk_in_blocks_is_bit_identical(monkeypatch):
    from mlakit.ops import common

    g = torch.Generator().manual_seed(3)
    q, w, k = torch.randn(2, 40, 3, 8, generator=g), torch.randn(2, 40, 3, generator=g), torch.randn(2, 50, 8)
    k[:, 7] = float("nan")  # a poisoned key: selected first, in blocks as whole
    lens = torch.tensor([50, 45])
    q[:, :, :, :4] = q[:, :, :, :4].round()  # ties
    scores = index_scores(q, w, k, lens, max_keys=50)
    want = select_topk(scores, 9)
    assert not scores.isnan().any() or torch.equal(scores.isnan(), index_scores(q, w, k, lens).isnan())
    monkeypatch.setattr(common, "SCORE_BUDGET", 2 * 50 * 3 * 3)  # blocks of 3 queries
    assert torch.equal(index_topk(q, w, k, lens, 9, max_keys=50), want)


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
    from mlakit.ops import common

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


def test_select_topk_ranks_nan_first():
    scores = torch.tensor([[[0.5, float("nan"), 2.0, -float("inf"), 1.0]]])
    assert select_topk(scores, 2).tolist() == [[[1, 2]]]


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

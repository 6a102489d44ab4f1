"""The attention ops: absorb == materialize == reference (fp32), lse, merge, and the toy of
*Understanding MLA Decoding*."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.common import assert_close, assert_lse_close

from mlakit.ops import absorb, materialize, merge, reference
from mlakit.ops import common as ops_common
from mlakit.ops.absorb import fold_queries, latent_attention, unfold_values
from mlakit.ops.materialize import expand


@dataclass(frozen=True)
class Problem:
    batch: int
    new: int
    heads: int
    dn: int
    dr: int
    dv: int
    latent: int
    prefix: tuple[int, ...]  # cached tokens of each row before the new ones
    pad: int = 0  # extra context rows past the longest row (never read)
    left_pad: tuple[int, ...] | None = None  # keys hidden by key_mask at the start of each row
    seed: int = 0

    @property
    def kv_lens(self) -> torch.Tensor:
        return torch.tensor([p + self.new for p in self.prefix])

    def __str__(self) -> str:
        return (
            f"B{self.batch}-S{self.new}-H{self.heads}-dn{self.dn}-dr{self.dr}-dv{self.dv}-L{self.latent}"
            f"-pre{'.'.join(map(str, self.prefix))}" + (f"-lpad{self.left_pad}" if self.left_pad else "")
        )


def make_inputs(p: Problem, dtype: torch.dtype = torch.float32, tail: float = 1e3) -> dict:
    """The ops' arguments. Context rows past each row's length hold large junk (`tail`), rows past
    the longest row hold NaN: neither may change the result."""
    g = torch.Generator().manual_seed(p.seed)
    lens = p.kv_lens
    t = int(lens.max()) + p.pad

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    c_kv, k_pe = rnd(p.batch, t, p.latent), rnd(p.batch, t, p.dr)
    for b, n in enumerate(lens.tolist()):
        c_kv[b, n:], k_pe[b, n:] = tail, -tail
    c_kv[:, int(lens.max()) :], k_pe[:, int(lens.max()) :] = float("nan"), float("nan")
    args = dict(
        q_nope=rnd(p.batch, p.new, p.heads, p.dn),
        q_pe=rnd(p.batch, p.new, p.heads, p.dr),
        c_kv=c_kv,
        k_pe=k_pe,
        w_uk=rnd(p.heads, p.dn, p.latent) / p.latent**0.5,
        w_uv=rnd(p.heads, p.dv, p.latent) / p.latent**0.5,
    )
    args = {k: v.to(dtype) for k, v in args.items()}
    args["kv_lens"] = lens
    args["scale"] = (p.dn + p.dr) ** -0.5
    if p.left_pad is not None:
        args["key_mask"] = torch.arange(t)[None, :] >= torch.tensor(p.left_pad)[:, None]
    return args


def call(op, args: dict, **extra):
    a = dict(args)
    return op(
        a.pop("q_nope"),
        a.pop("q_pe"),
        a.pop("c_kv"),
        a.pop("k_pe"),
        a.pop("kv_lens"),
        a.pop("w_uk"),
        a.pop("w_uv"),
        a.pop("scale"),
        **a,
        **extra,
    )


PATHS = {
    "absorb": lambda args: call(absorb, args),
    "materialize": lambda args: call(materialize, args),
    "materialize-ws1": lambda args: call(materialize, args, workspace_tokens=1),
    "materialize-ws3": lambda args: call(materialize, args, workspace_tokens=3),
    "materialize-sdpa": lambda args: call(materialize, args, need_lse=False),
}


def check_all_paths(p: Problem) -> None:
    args = make_inputs(p)
    want_out, want_lse = call(reference, args)
    assert want_out.dtype == torch.float32 and want_lse.dtype == torch.float32
    for name, run in PATHS.items():
        out, lse = run(args)
        assert out.dtype == torch.float32
        assert_close(f"{p} {name} out", out, want_out, rtol=1e-5)
        if lse is not None:
            assert_lse_close(f"{p} {name} lse", lse, want_lse)


CASES = [
    Problem(1, 1, 1, 2, 2, 2, 3, (0,)),
    Problem(1, 1, 4, 6, 4, 5, 20, (17,)),  # decode
    Problem(3, 1, 2, 7, 2, 3, 9, (5, 0, 11)),  # ragged decode, one row with an empty cache
    Problem(2, 5, 3, 6, 4, 5, 20, (0, 0)),  # prefill
    Problem(2, 4, 3, 9, 6, 7, 33, (9, 2), pad=3),  # chunk over ragged prefixes
    Problem(2, 7, 2, 5, 4, 8, 31, (3, 6), left_pad=(2, 0)),  # left padding
    Problem(2, 3, 1, 3, 2, 3, 7, (0, 4), left_pad=(2, 5)),  # queries inside the padding see nothing
]


@pytest.mark.parametrize("p", CASES, ids=str)
def test_paths_match_reference_table(p):
    check_all_paths(p)


@st.composite
def problems(draw) -> Problem:
    batch = draw(st.integers(1, 3))
    new = draw(st.integers(1, 6))
    prefix = tuple(draw(st.lists(st.integers(0, 12), min_size=batch, max_size=batch)))
    left_pad = None
    if draw(st.booleans()):
        left_pad = tuple(draw(st.integers(0, pre + new)) for pre in prefix)
    return Problem(
        batch=batch,
        new=new,
        heads=draw(st.integers(1, 4)),
        dn=draw(st.integers(1, 9)),
        dr=2 * draw(st.integers(1, 4)),
        dv=draw(st.integers(1, 9)),
        latent=draw(st.integers(1, 33)),
        prefix=prefix,
        pad=draw(st.integers(0, 3)),
        left_pad=left_pad,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(problems())
def test_paths_match_reference_property(p):
    check_all_paths(p)


@pytest.mark.parametrize("budget", [1, 7, 50], ids=lambda b: f"budget{b}")
def test_query_chunking_matches_reference(monkeypatch, budget):
    # a tiny score budget forces both paths to split the queries into chunks (1 query at budget 1)
    monkeypatch.setattr(ops_common, "SCORE_BUDGET", budget)
    check_all_paths(Problem(2, 6, 3, 6, 4, 5, 20, (4, 1), left_pad=(1, 0)))


def test_fully_hidden_queries_give_zero_output_and_neg_inf_lse():
    p = Problem(1, 3, 2, 4, 2, 3, 5, (0,), left_pad=(2,))
    args = make_inputs(p)
    for name, op in (("reference", reference), ("absorb", absorb), ("materialize", materialize)):
        out, lse = call(op, args)
        # queries 0 and 1 sit on hidden keys only; query 2 sees key 2
        assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2])), name
        assert torch.isneginf(lse[:, :2]).all(), name
        assert torch.isfinite(lse[:, 2]).all() and out[:, 2].abs().max() > 0, name


@pytest.mark.parametrize("op", [absorb, materialize], ids=["absorb", "materialize"])
def test_nan_past_a_rows_length_is_not_read(op):
    p = Problem(2, 1, 2, 4, 2, 3, 5, (6, 1))
    args = make_inputs(p, tail=float("nan"))
    want, _ = call(reference, args)
    got, _ = call(op, args)
    assert_close("NaN tail", got, want)


def test_ops_keep_query_dtype_and_fp32_lse():
    args = make_inputs(Problem(2, 3, 2, 6, 4, 5, 20, (4, 0)), dtype=torch.bfloat16)
    for op in (absorb, materialize, reference):
        out, lse = call(op, args)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32, op.__name__


def test_lse_is_the_log_of_the_softmax_denominator():
    # explicit per-key scores, written without any of the ops: one row, one head, decode
    p = Problem(1, 1, 1, 3, 2, 4, 5, (6,))
    args = make_inputs(p)
    t = int(p.kv_lens[0])
    keys = args["c_kv"][0, :t] @ args["w_uk"][0].T  # [T, dn]
    scores = (keys @ args["q_nope"][0, 0, 0] + args["k_pe"][0, :t] @ args["q_pe"][0, 0, 0]) * args["scale"]
    want = torch.logsumexp(scores.double(), dim=0)
    for op in (reference, absorb, materialize):
        _, lse = call(op, args)
        assert abs(lse[0, 0, 0].item() - want.item()) < 1e-5 * max(1, abs(want.item())), op.__name__


# ---------------------------------------------------------------- merge


def test_merge_of_key_parts_equals_whole():
    # attention over disjoint key sets (chosen by key_mask) merged by lse == attention over all keys
    p = Problem(2, 4, 3, 6, 4, 5, 20, (7, 3))
    args = make_inputs(p)
    t = args["c_kv"].shape[1]
    want_out, want_lse = call(reference, args)
    owner = torch.randint(0, 3, (t,), generator=torch.Generator().manual_seed(1))
    parts = [call(reference, {**args, "key_mask": (owner == k)[None].expand(2, t)}) for k in range(3)]
    out, lse = merge([o for o, _ in parts], [lse for _, lse in parts])
    assert_close("merge of 3 parts", out, want_out)
    assert_lse_close("merge of 3 parts", lse, want_lse)


def test_merge_by_hand():
    # part 1: one key, value 1, exp-sum 1; part 2: value 3, exp-sum 3 -> (1·1 + 3·3) / 4 = 2.5, lse ln 4
    out, lse = merge(
        [torch.tensor([[1.0]]), torch.tensor([[3.0]])], [torch.tensor([0.0]), torch.tensor([math.log(3)])]
    )
    assert out.item() == pytest.approx(2.5, rel=1e-6)
    assert lse.item() == pytest.approx(math.log(4), rel=1e-6)


def test_merge_ignores_parts_that_saw_no_key():
    o1, l1 = torch.tensor([[2.0, -1.0]]), torch.tensor([0.7])
    empty_o, empty_l = torch.zeros(1, 2), torch.tensor([float("-inf")])
    out, lse = merge([empty_o, o1, empty_o], [empty_l, l1, empty_l])
    assert torch.allclose(out, o1) and torch.allclose(lse, l1)
    out, lse = merge([empty_o, empty_o], [empty_l, empty_l])
    assert torch.equal(out, torch.zeros(1, 2)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("outs,lses", [([], []), ([torch.zeros(1, 1)], [])], ids=["empty", "unmatched"])
def test_merge_rejects_bad_lists(outs, lses):
    with pytest.raises(ValueError, match="merge needs"):
        merge(outs, lses)


# ------------------------------------------------ *Understanding MLA Decoding*, sections 3a and 3c

# one head, latent 3, nope 2; the article writes K = c · W_K with W_K (3 × 2), so w_uk[0] = W_Kᵀ
W_K = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
W_V = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
Q_NOPE = torch.tensor([1.0, 0.0])
C = torch.eye(3)  # c0, c1, c2


def toy_args(key_mask=None) -> dict:
    # rope part zero and scale 1, so every score is exactly the article's content score
    args = dict(
        q_nope=Q_NOPE.view(1, 1, 1, 2),
        q_pe=torch.zeros(1, 1, 1, 2),
        c_kv=C[None],
        k_pe=torch.zeros(1, 3, 2),
        kv_lens=torch.tensor([3]),
        w_uk=W_K.T[None],
        w_uv=W_V.T[None],
        scale=1.0,
    )
    if key_mask is not None:
        args["key_mask"] = torch.tensor([key_mask])
    return args


def test_toy_keys_explicit_and_absorbed():
    explicit_keys = expand(C[None], torch.zeros(1, 3, 2), W_K.T[None], W_V.T[None])[0][0, 0, :, :2]
    assert explicit_keys.tolist() == [[1, 0], [0, 2], [1, 1]]  # K0, K1, K2
    assert (explicit_keys @ Q_NOPE).tolist() == [1, 0, 1]
    q_abs = fold_queries(Q_NOPE.view(1, 1, 1, 2), W_K.T[None])
    assert q_abs.flatten().tolist() == [1, 0, 1]  # Q_absorbed = Q_nope · W_Kᵀ
    assert (C @ q_abs.flatten()).tolist() == [1, 0, 1]


@pytest.mark.parametrize("op", [reference, absorb, materialize], ids=["reference", "absorb", "materialize"])
def test_toy_scores_through_the_ops(op):
    # with only key j visible, lse = score_j (scale 1): reads each score out of the op itself
    scores = []
    for j in range(3):
        _, lse = call(op, toy_args([k == j for k in range(3)]))
        scores.append(round(lse.item(), 6))
    assert scores == [1, 0, 1]


@pytest.mark.parametrize("op", [reference, absorb, materialize], ids=["reference", "absorb", "materialize"])
def test_toy_mixed_value_through_the_ops(op):
    # hiding key 1 turns the equal scores 1, 1 of keys 0 and 2 into the article's weights [0.5, 0, 0.5]
    out, lse = call(op, toy_args([True, False, True]))
    assert out.flatten().tolist() == pytest.approx([0.5, 0.5], abs=1e-6)
    assert lse.item() == pytest.approx(1 + math.log(2), abs=1e-6)


def test_toy_mixed_value_both_ways():
    weights = torch.tensor([0.5, 0.0, 0.5])
    values = expand(C[None], torch.zeros(1, 3, 2), W_K.T[None], W_V.T[None])[1][0, 0]  # V0, V1, V2
    assert values.tolist() == [[1, 0], [0, 1], [0, 1]]
    assert (weights @ values).tolist() == [0.5, 0.5]  # materialize: build every V, then mix
    c_mixed = weights @ C
    assert c_mixed.tolist() == [0.5, 0.0, 0.5]
    out = unfold_values(c_mixed.view(1, 1, 1, 3), W_V.T[None])  # absorb: mix latents, then W_V
    assert out.flatten().tolist() == [0.5, 0.5]


def test_toy_latent_attention_mixes_latents():
    # absorb's inner step returns the mixed latent itself, before W_V
    q_abs = fold_queries(Q_NOPE.view(1, 1, 1, 2), W_K.T[None])
    hidden = torch.tensor([[[False, True, False]]])  # [B, q, k]
    o_lat, lse = latent_attention(q_abs, torch.zeros(1, 1, 1, 2), C[None], torch.zeros(1, 3, 2), hidden, 1.0)
    assert o_lat.flatten().tolist() == pytest.approx([0.5, 0.0, 0.5], abs=1e-7)
    # all three keys: softmax of the scores 1, 0, 1
    o_lat, lse = latent_attention(q_abs, torch.zeros(1, 1, 1, 2), C[None], torch.zeros(1, 3, 2), None, 1.0)
    e = math.e
    assert o_lat.flatten().tolist() == pytest.approx([e / (2 * e + 1), 1 / (2 * e + 1), e / (2 * e + 1)])
    assert lse.item() == pytest.approx(math.log(2 * e + 1))

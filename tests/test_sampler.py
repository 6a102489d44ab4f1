"""The sampler's draw: the inverse CDF against the distribution it should draw from (frequencies over
many draws, a chi-square bound), weights of zero never drawn (top-k / top-p / min-p exclusions, and a
uniform at the very top of [0, 1)), greedy rows beside sampled ones, seeded rows independent of the
others, and bad shapes refused."""

from __future__ import annotations

import math

import pytest
import torch

from mlakit.engine import SamplingParams
from mlakit.engine.sampler import _filter, inverse_cdf, sample


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the categories of expected count >= 5 (the rest pooled)."""
    n = counts.sum().item()
    expect = p.double() * n
    big = expect >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([expect[big], expect[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def within_chi_square(stat: float, dof: int) -> bool:
    """stat below the 99.99th percentile of chi-square(dof) (Wilson-Hilferty's approximation)."""
    z = 3.72  # one-sided 1e-4
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < bound


def test_inverse_cdf_draws_from_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=g) * 2
    p = logits.softmax(-1)[0]
    n = 200_000
    u = torch.rand(n, dtype=torch.float64, generator=g)
    tokens = inverse_cdf(p.expand(n, -1), u)
    counts = torch.bincount(tokens, minlength=50)
    stat, dof = chi_square(counts, p)
    assert within_chi_square(stat, dof), (stat, dof)


def test_weights_of_zero_are_never_drawn_even_at_the_top_of_the_uniform():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]])
    top = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    for u in (0.0, 0.25, 0.5 - 1e-12, 0.5, 0.75, top.item()):
        (tok,) = inverse_cdf(p, torch.tensor([u], dtype=torch.float64)).tolist()
        assert tok in (1, 3), (u, tok)
    # unnormalized weights: the same rule on u x total
    w = torch.tensor([[0.0, 3.0, 1.0, 0.0]])
    got = inverse_cdf(w.expand(4, -1), torch.tensor([0.0, 0.7, 0.76, top.item()], dtype=torch.float64))
    assert got.tolist() == [1, 1, 2, 2]


def test_sample_with_filters_draws_only_what_they_keep_and_in_proportion():
    g = torch.Generator().manual_seed(1)
    v = 40
    logits = torch.randn(1, v, generator=g) * 1.5
    sp = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02)
    want = _filter(logits, [sp]).softmax(-1)[0]
    rows = 4000
    shared = torch.Generator().manual_seed(2)
    counts = torch.zeros(v, dtype=torch.long)
    for _ in range(10):
        tokens, _ = sample(logits.expand(rows, -1).clone(), [sp] * rows, [None] * rows, shared)
        counts += torch.bincount(torch.tensor(tokens), minlength=v)
    assert counts[want == 0].sum() == 0
    stat, dof = chi_square(counts, want)
    assert within_chi_square(stat, dof), (stat, dof)


def test_greedy_rows_beside_sampled_rows_and_seeded_rows_independent_of_the_rest():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g)
    greedy = SamplingParams(temperature=0)
    hot = SamplingParams(temperature=1.0)
    seeded = [None, torch.Generator().manual_seed(7), None, None, torch.Generator().manual_seed(8)]
    params = [greedy, hot, hot, greedy, hot]
    tokens, lps = sample(logits.clone(), params, seeded, torch.Generator().manual_seed(0))
    assert tokens[0] == logits[0].argmax().item() and tokens[3] == logits[3].argmax().item()
    assert lps == [None] * 5
    # row 1 and row 4 draw from their own generators: the same tokens alone, and in another batch
    alone, _ = sample(logits[1:2].clone(), [hot], [torch.Generator().manual_seed(7)], torch.Generator())
    assert alone == [tokens[1]]
    other = torch.cat([torch.randn(3, 300, generator=g), logits[4:5]])
    gens = [None, None, None, torch.Generator().manual_seed(8)]
    again, _ = sample(other, [hot, greedy, hot, hot], gens, torch.Generator().manual_seed(5))
    assert again[3] == tokens[4]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="probs"):
        inverse_cdf(torch.ones(3), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="u"):
        inverse_cdf(torch.ones(2, 3), torch.zeros(3, dtype=torch.float64))


def full_sort_keep(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top-p by a sort of the whole row (the definition)."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    probs = sorted_x.softmax(-1)
    stay = probs.cumsum(-1) - probs <= top_p[:, None]
    return torch.zeros_like(stay).scatter_(1, order, stay)


@pytest.mark.parametrize("candidates", [8, 64, 10_000], ids=lambda c: f"candidates{c}")
def test_top_p_among_candidates_equals_the_full_sort(monkeypatch, candidates):
    # peaked rows find their set among the candidates, flat ones sort; the same tokens either way
    import mlakit.engine.sampler as sampler

    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(4)
    v = 3000
    scale = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.3, 0.05, 6.0, 3.0])[:, None]
    x = torch.randn(8, v, generator=g, dtype=torch.float64).float() * scale
    x[6, 100:] = float("-inf")  # a top-k before top-p: -inf among the candidates
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.7, 0.99, 0.2, 0.9, 1e-6])
    got = sampler.top_p_keep(x, top_p)
    want = full_sort_keep(x, top_p)
    assert torch.equal(got, want)
    assert got.sum(-1).min() >= 1 and bool(got.gather(1, x.argmax(-1, keepdim=True)).all())


def test_top_p_one_rows_keep_every_token_beside_nucleus_rows():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 500, generator=g) * 3
    params = [SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.3)]  # fmt: skip
    out = _filter(x, params)
    assert torch.isfinite(out[1]).all() and torch.equal(out[1], x[1])
    for i, p in ((0, 0.8), (2, 0.3)):
        kept = torch.isfinite(out[i])
        assert torch.equal(kept, full_sort_keep(x[i : i + 1], torch.tensor([p]))[0])


@pytest.fixture
def small_blocks(monkeypatch):
    """The two-level running sum on small rows: blocks of 8 tokens."""
    import mlakit.engine.sampler as sampler

    monkeypatch.setattr(sampler, "CDF_BLOCK", 8)
    return sampler


def test_two_level_draws_from_p(small_blocks):
    test_inverse_cdf_draws_from_p()  # 50 tokens: 6 blocks of 8 and a tail of 2
    test_sample_with_filters_draws_only_what_they_keep_and_in_proportion()


def test_two_level_never_draws_a_weight_of_zero(small_blocks):
    top = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    w = torch.zeros(1, 43)  # 5 blocks of 8 and a tail of 3
    w[0, [3, 20, 21, 41]] = torch.tensor([0.25, 0.25, 0.25, 0.25])  # block 1, 3 and 4 empty
    u = [0.0, 0.2, 0.25, 0.3, 0.5 - 1e-15, 0.5, 0.74, 0.75, 0.9, top.item()]
    u = torch.tensor(u, dtype=torch.float64)
    got = inverse_cdf(w.expand(len(u), -1), u)
    assert got.tolist() == [3, 3, 20, 20, 20, 21, 21, 41, 41, 41]


def test_two_level_agrees_with_one_running_sum(monkeypatch):
    import mlakit.engine.sampler as sampler

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(64, 3000, generator=g) * torch.linspace(0.1, 6, 64)[:, None]
    probs = logits.softmax(-1)
    u = torch.rand(64 * 300, dtype=torch.float64, generator=g)
    rows = probs.repeat(300, 1)
    monkeypatch.setattr(sampler, "CDF_BLOCK", 10**9)
    flat = inverse_cdf(rows, u)
    monkeypatch.setattr(sampler, "CDF_BLOCK", 64)
    blocked = inverse_cdf(rows, u)
    # the two differ only where u falls within fp32 rounding of a block sum of a boundary
    assert (flat == blocked).float().mean() > 0.999


def need_fused_draw():
    from mlakit.ops import cpu_core

    if not cpu_core.available(torch.bfloat16):
        pytest.skip(f"fused core unavailable: {cpu_core.unavailable_reason()}")


def test_fused_draw_from_logits_draws_from_the_tempered_softmax():
    """`inverse_cdf_logits` (csrc/sample.cpp) on rows of 5,000 logits: frequencies against
    softmax(x / 0.7) (with 1,000 tokens at -inf, never drawn), the top of [0, 1) included."""
    need_fused_draw()
    g = torch.Generator().manual_seed(11)
    v = 5000
    logits = torch.randn(v, generator=g) * 3
    logits[torch.randperm(v, generator=g)[:1000]] = float("-inf")
    p = (logits / 0.7).softmax(-1)
    n = 100_000
    u = torch.rand(n, dtype=torch.float64, generator=g)
    u[0] = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    inv = torch.full((n,), 1 / 0.7)
    tokens = torch.ops.mlakit_cpu.inverse_cdf_logits(logits.expand(n, -1), inv, u)
    counts = torch.bincount(tokens, minlength=v)
    assert counts[p == 0].sum() == 0
    stat, dof = chi_square(counts, p)
    assert within_chi_square(stat, dof), (stat, dof)
    # the same uniforms through the torch path's two-level sum: the same tokens but where u falls
    # within fp32 rounding of a boundary
    same = inverse_cdf((logits / 0.7).softmax(-1).expand(20_000, -1), u[:20_000])
    assert (same == tokens[:20_000]).float().mean() > 0.999
    none = torch.full((1, v), float("-inf"))  # no token has weight: the torch path's clamp, V - 1
    assert torch.ops.mlakit_cpu.inverse_cdf_logits(none, torch.ones(1), u[:1]).tolist() == [v - 1]


def test_sample_draws_wide_rows_in_one_op(monkeypatch):
    """sample() sends rows wider than two CDF blocks to the fused draw (temperature folded in, or
    after top-k / top-p / min-p), seeded rows still their own."""
    need_fused_draw()
    import mlakit.engine.sampler as sampler

    calls = []
    monkeypatch.setattr(sampler, "_fused_draw", lambda x: calls.append(x.shape) or True)
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(1, 3000, generator=g) * 2
    for sp in (SamplingParams(temperature=0.6), SamplingParams(temperature=1.2, top_k=50, min_p=0.01)):
        want = _filter(logits, [sp]).softmax(-1)[0]
        rows = 20_000
        tokens, _ = sample(logits.expand(rows, -1).clone(), [sp] * rows, [None] * rows, torch.Generator())
        counts = torch.bincount(torch.tensor(tokens), minlength=3000)
        assert counts[want == 0].sum() == 0
        stat, dof = chi_square(counts, want)
        assert within_chi_square(stat, dof), (stat, dof)
    assert len(calls) == 2
    test_greedy_rows_beside_sampled_rows_and_seeded_rows_independent_of_the_rest()


def test_bf16_logits_draw_what_their_fp32_widening_draws():
    """`inverse_cdf_logits` reads bf16 logits (the lm_head's own output) as their exact fp32 widening:
    the same token for every uniform, -inf entries and a row of all -inf included."""
    need_fused_draw()
    g = torch.Generator().manual_seed(13)
    rows, v = 64, 5000
    logits = (torch.randn(rows, v, generator=g) * 4).to(torch.bfloat16)
    logits[:, torch.randperm(v, generator=g)[:700]] = float("-inf")
    logits[5] = float("-inf")
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    inv = torch.rand(rows, generator=g) + 0.5
    got = torch.ops.mlakit_cpu.inverse_cdf_logits(logits, inv, u)
    assert torch.equal(got, torch.ops.mlakit_cpu.inverse_cdf_logits(logits.float(), inv, u))
    assert got[5].item() == v - 1


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0.8), SamplingParams(temperature=0), SamplingParams(seed=3)],
        [SamplingParams(temperature=0)] * 3,
        [SamplingParams(temperature=0.8, top_k=20), SamplingParams(), SamplingParams(temperature=0)],
        [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(temperature=0)],
        [SamplingParams(repetition_penalty=1.3), SamplingParams(), SamplingParams(temperature=0)],
    ],
)
def test_sample_reads_bf16_logits_as_their_widening(params, monkeypatch):
    """sample() on bf16 logits gives what it gives on their fp32 widening (tokens and log-probabilities),
    reading them unwidened only where nothing but the fused draw and argmax reads them."""
    import mlakit.engine.sampler as sampler

    g = torch.Generator().manual_seed(14)
    v = 3000
    logits = (torch.randn(len(params), v, generator=g) * 3).to(torch.bfloat16)
    history = [([1, 2, 3, 4], 2)] * len(params)
    outs = []
    for x in (logits, logits.float()):
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        outs.append(sample(x, params, gens, torch.Generator().manual_seed(5), history, eos=1))
    assert outs[0] == outs[1]
    widened = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(t.shape) or real_float(t))
    sample(logits, params, [None] * len(params), torch.Generator().manual_seed(5), history, eos=1)
    plain = sampler.plain(logits, params)
    readable = params[0].top_k <= 0 and params[0].logprobs is None and not params[0].penalized
    # sampled rows need the fused draw (the bf16 core: not on AVX2-only CPUs); greedy rows never do
    assert plain == (readable and (all(p.greedy for p in params) or sampler._fused_draw(logits)))
    assert (tuple(logits.shape) in widened) == (not plain)


def argmax_cases(dtype, v: int) -> torch.Tensor:
    """Rows of v logits where argmax is easy to get wrong: ties everywhere (the first of them wins), a
    NaN (the largest: the first NaN wins), +inf, all -inf, one finite value among -inf; rows of a wider
    tensor (strided)."""
    g = torch.Generator().manual_seed(v)
    rows = 12
    x = torch.randint(-3, 4, (rows, v + 7), generator=g).to(dtype)[:, 3 : 3 + v]  # ties everywhere
    x[1] = float("-inf")
    x[2, -1] = float("inf")
    x[3, v // 2] = float("nan")
    x[4, v - 1] = float("nan")
    x[4, 0] = float("inf")
    if v > 2:
        x[5, [v // 3, v - 2]] = float("nan")
        x[6, [0, v - 1]] = x[6].max() + 1  # the same largest value at both ends
    x[7] = torch.randn(v, generator=g).to(dtype)
    x[8] = float("-inf")
    x[8, v - 1] = -1e30
    assert x.stride(0) == v + 7
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [1, 5, 7, 8, 9, 15, 16, 17, 33, 1000, 129280])
def test_argmax_equals_torch_argmax(dtype, v):
    """sampler.argmax (`argmax_rows` where a fused core is loaded) gives torch.argmax's indices on
    `argmax_cases`, on their contiguous copy, and on no rows at all."""
    from mlakit.engine.sampler import argmax

    x = argmax_cases(dtype, v)
    want = x.argmax(-1)
    assert torch.equal(argmax(x), want)
    assert torch.equal(argmax(x.contiguous()), want)
    assert argmax(x[:0]).shape == (0,)


@pytest.mark.parametrize("v", [1, 5, 7, 8, 9, 15, 16, 17, 33, 1000, 129280])
def test_fp32_core_argmax_equals_torch_argmax(v, monkeypatch):
    """The fp32 core's `argmax_rows` (AVX2: what greedy rows take on CPUs without AVX512-BF16) gives
    torch.argmax's indices on `argmax_cases`; sampler.argmax takes it where the bf16 core is absent."""
    from mlakit.engine import sampler
    from mlakit.ops import cpu_core

    if not cpu_core.available(torch.float32):
        pytest.skip(f"fp32 core unavailable: {cpu_core.unavailable_reason(torch.float32)}")
    x = argmax_cases(torch.float32, v)
    want = x.argmax(-1)
    assert torch.equal(torch.ops.mlakit_cpu_f32.argmax_rows(x), want)
    assert torch.equal(torch.ops.mlakit_cpu_f32.argmax_rows(x.contiguous()), want)
    real = cpu_core.available

    def no_bf16_core(dtype=torch.bfloat16):  # as on a CPU without AVX512-BF16
        return dtype == torch.float32 and real(dtype)

    monkeypatch.setattr(cpu_core, "available", no_bf16_core)
    calls = []
    op = torch.ops.mlakit_cpu_f32.argmax_rows
    monkeypatch.setattr(torch.ops.mlakit_cpu_f32, "argmax_rows", lambda t: calls.append(t.shape) or op(t))
    assert torch.equal(sampler.argmax(x), want) and calls == [x.shape]
    assert torch.equal(sampler.argmax(x.to(torch.bfloat16)), x.to(torch.bfloat16).argmax(-1))  # torch's
    assert len(calls) == 1


def test_greedy_tokens_are_torch_argmax_of_bf16_logits():
    """sample() on greedy rows of bf16 logits (read unwidened) picks torch.argmax's tokens."""
    g = torch.Generator().manual_seed(15)
    logits = (torch.randn(9, 129280, generator=g) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=0)] * 9
    tokens, _ = sample(logits, params, [None] * 9, torch.Generator())
    assert tokens == logits.argmax(-1).tolist() == logits.float().argmax(-1).tolist()

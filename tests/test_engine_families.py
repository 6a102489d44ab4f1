"""The engine on every family it serves, tiny fp32 models: 16 prompts of 1-300 tokens (half sharing a
120-token prefix), greedy, a token budget that chunks every long prompt and a page budget that forces
preemption; every request's tokens equal transformers' generate() of that prompt alone, unpatched, and
the chosen tokens' log-probabilities agree to fp32 round-off. fp8 / int8 pages: the divergence printed."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("xxhash")

from support.engine import FAMILIES, prompts, reference, tiny_model  # noqa: E402

from mlakit.engine import LLM, SamplingParams  # noqa: E402

LENGTHS = [1, 7, 300, 64, 150, 33, 17, 250]
NEW = 6
ENGINE = dict(num_blocks=30, block_size=16, max_num_seqs=8, max_num_batched_tokens=96)


def run_engine(model, ps, **kw):
    llm = LLM(model, **{**ENGINE, **kw})
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    return llm, llm.generate(ps, params, use_tqdm=False)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_generate(family):
    ps = prompts(16, LENGTHS, shared=120)
    want = reference(tiny_model(family), ps, NEW)
    llm, outs = run_engine(tiny_model(family), ps)
    eng = llm.llm_engine
    for i, (out, (tokens, lps)) in enumerate(zip(outs, want, strict=True)):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {i} ({len(ps[i])} tokens): {got.token_ids} != {tokens}"
        assert got.finish_reason == "length" and out.finished
        for step, (entry, lp) in enumerate(zip(got.logprobs, lps, strict=True)):
            assert abs(entry[got.token_ids[step]] - lp) <= 1e-4, f"prompt {i} step {step}"
    stats = eng.stats
    assert stats.num_preemptions > 0, "the page budget was meant to force preemption"
    assert stats.prefix_cache_hits > 0 and sum(o.num_cached_tokens for o in outs) > 0
    eng.check()
    assert eng.kv.pool.num_used == 0 and stats.kv_cache_usage == 0


@pytest.mark.parametrize("quant", ["fp8", "int8"])
def test_quantized_pages_divergence(quant):
    ps = prompts(8, LENGTHS[:4] * 2, seed=3)
    kw = dict(kv_lora_rank=128)  # fp8 groups of 128 latent values
    want = reference(tiny_model("deepseek-v3", **kw), ps, NEW)
    llm, outs = run_engine(tiny_model("deepseek-v3", **kw), ps, cache_dtype=quant, num_blocks=60)
    same, first, gaps = 0, [], []
    for out, (tokens, lps) in zip(outs, want, strict=True):
        got = out.outputs[0]
        n = next((j for j, (a, b) in enumerate(zip(got.token_ids, tokens, strict=True)) if a != b), NEW)
        same += n == NEW
        first.append(n)
        gaps += [abs(e[t] - lp) for e, t, lp in zip(got.logprobs[:n], got.token_ids, lps, strict=False)]
    gap = max(gaps)
    print(f"\n{quant}: {same}/8 prompts token-identical, first divergence {first}, max logprob gap {gap:.3g}")
    assert max(first) > 0, "quantized pages diverged at the first token of every prompt"
    llm.llm_engine.check()

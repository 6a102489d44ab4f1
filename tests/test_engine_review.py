"""The engine's contract under misuse: LLM's signature, checks before any change,
tokenizer/device/seed/temperature arguments, plan() failures undone in the shared page pool, fp8
refused by name."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.engine import prompts, tiny_model  # noqa: E402

from mlakit.engine import LLM, LLMEngine, SamplingParams  # noqa: E402

SMALL = dict(num_blocks=24, block_size=8, max_num_seqs=6, max_num_batched_tokens=48)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
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

"""SamplingParams' vLLM options: unknown keywords refused by name, each option's range, penalties and
min_tokens in the sampler against hand computations and transformers' logits processors, stop-string
and special-token text rules, and LLM.chat against the server's chat rendering."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("xxhash")

from support.engine import tiny_model  # noqa: E402
from support.serve_tiny import write_tiny_model  # noqa: E402

from mlakit.engine import LLM, LLMEngine, SamplingParams  # noqa: E402
from mlakit.engine.sampler import process  # noqa: E402

EOS = 257  # the tiny served model's end token


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_tiny_model(tmp_path_factory.mktemp("tiny")), dtype="fp32", num_blocks=64)


@pytest.mark.parametrize("name", ["best_of", "use_beam_search", "temprature"], ids=str)
def test_unknown_keywords_are_a_value_error_naming_them(name):
    with pytest.raises(ValueError, match=f"unknown keyword.*{name}.*accepted: n, max_tokens") as err:
        SamplingParams(**{name: 1})
    assert "min_tokens" in str(err.value) and "repetition_penalty" in str(err.value)


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (dict(skip_special_tokens="no"), "skip_special_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=21), "logprobs"),
    ],
    ids=["min-neg", "min-over-max", "presence", "frequency", "frequency-nan", "rep-zero", "rep-inf",
         "include-type", "skip-type", "max-tokens-zero", "logprobs-21"],
)  # fmt: skip
def test_option_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingParams(**kw)


def test_max_tokens_none_is_the_rest_of_the_context():
    eng = LLMEngine(tiny_model("deepseek-v3"), num_blocks=4, block_size=8)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    while eng.has_unfinished_requests():
        done = [o for o in eng.step() if o.finished]
    assert len(done[0].outputs[0].token_ids) == 32 - 3 and done[0].outputs[0].finish_reason == "length"


def hand_penalties(row: list[float], tokens: list[int], prompt_len: int, p: SamplingParams) -> list[float]:
    """vLLM's penalties written out per token: repetition over prompt + output, then frequency and
    presence over the output."""
    out = list(row)
    generated = tokens[prompt_len:]
    for t in range(len(out)):
        if t in tokens and p.repetition_penalty != 1:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = generated.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


@pytest.mark.parametrize(
    "kw",
    [dict(presence_penalty=0.7), dict(frequency_penalty=-0.4), dict(repetition_penalty=1.6),
     dict(repetition_penalty=0.5, frequency_penalty=1.1, presence_penalty=-1.5)],
    ids=["presence", "frequency", "repetition", "all"],
)  # fmt: skip
def test_penalties_equal_a_hand_computation(kw):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 11, generator=g) * 3
    history = [([1, 2, 2, 3, 9, 9, 9], 3), ([4, 4, 0], 2)]
    params = [SamplingParams(**kw), SamplingParams(**kw)]
    got = process(logits, params, history)
    for i, (tokens, plen) in enumerate(history):
        want = hand_penalties(logits[i].tolist(), tokens, plen, params[i])
        assert got[i].tolist() == pytest.approx(want, abs=1e-6)
    assert not torch.equal(got, logits)


def test_repetition_penalty_equals_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 50, generator=g) * 4
    tokens = torch.randint(0, 50, (1, 30), generator=g)
    want = RepetitionPenaltyLogitsProcessor(1.3)(tokens, logits.clone())
    got = process(logits, [SamplingParams(repetition_penalty=1.3)], [(tokens[0].tolist(), 12)])
    torch.testing.assert_close(got, want)


def hf_greedy(model, ids: list[int], n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("penalty", [1.3, 0.8], ids=["1.3", "0.8"])
def test_greedy_repetition_penalty_equals_transformers_generate(penalty):
    model = tiny_model("deepseek-v3")
    ref = copy.deepcopy(model)
    llm = LLM(model, num_blocks=24, block_size=8)
    prompt = [5, 6, 7, 5, 6, 7, 8, 9, 5]
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, repetition_penalty=penalty)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    want = hf_greedy(ref, prompt, 12, repetition_penalty=penalty)
    plain = hf_greedy(ref, prompt, 12)
    assert out.outputs[0].token_ids == want and want != plain


def test_min_tokens_masks_eos_and_stop_strings_until_reached(llm):
    plain = llm.generate("keep talking", SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    c = plain.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == EOS and len(c.token_ids) < 30
    sp = SamplingParams(temperature=0, max_tokens=60, min_tokens=30)
    (out,) = llm.generate("keep talking", sp, use_tqdm=False)
    ids = out.outputs[0].token_ids
    assert len(ids) >= 30 and EOS not in ids[:30] and ids[: len(c.token_ids) - 1] == c.token_ids[:-1]
    stop = c.text[1:3]  # met in the first tokens: not looked for before min_tokens
    (late,) = llm.generate("keep talking", SamplingParams(temperature=0, max_tokens=8, min_tokens=6,
                                                          stop=stop), use_tqdm=False)  # fmt: skip
    assert len(late.outputs[0].token_ids) >= 6


def test_include_stop_str_and_skip_special_tokens(llm):
    base = SamplingParams(temperature=0, max_tokens=60)
    c = llm.generate("keep talking", base, use_tqdm=False)[0].outputs[0]
    stop = c.text[4:6]
    cut, kept = (
        llm.generate("keep talking", SamplingParams(temperature=0, max_tokens=60, stop=stop, **kw),
                     use_tqdm=False)[0].outputs[0]
        for kw in ({}, {"include_stop_str_in_output": True})
    )  # fmt: skip
    at = c.text.index(stop)
    assert (cut.text, kept.text) == (c.text[:at], c.text[: at + len(stop)])
    assert cut.finish_reason == kept.finish_reason == "stop" and cut.stop_reason == stop
    shown = SamplingParams(
        temperature=0, max_tokens=60, include_stop_str_in_output=True, skip_special_tokens=False
    )
    special = llm.generate("keep talking", shown, use_tqdm=False)[0].outputs[0]
    assert special.text == c.text + "<eos>" and "<eos>" not in c.text and c.token_ids[-1] == EOS


def test_stop_token_text_is_left_out_unless_included(llm):
    sp = dict(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "MLA caches one latent per token"  # its greedy text starts with two whole characters
    c = llm.generate(prompt, SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    first, token = 1, c.token_ids[1]
    assert token not in c.token_ids[:1] and "\ufffd" not in tok.decode(c.token_ids[:2])
    cut, kept = (
        llm.generate(prompt, SamplingParams(**sp, stop_token_ids=[token], **kw), use_tqdm=False)[0]
        for kw in ({}, {"include_stop_str_in_output": True})
    )
    cut, kept = cut.outputs[0], kept.outputs[0]
    assert cut.token_ids == kept.token_ids == c.token_ids[: first + 1] and cut.stop_reason == token
    assert cut.text == tok.decode(c.token_ids[:first]) and kept.text == tok.decode(c.token_ids[: first + 1])


def test_chat_renders_as_the_server_does(llm):
    from mlakit.serve.adapter import EngineAdapter

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    sp = SamplingParams(temperature=0, max_tokens=6)
    (out,) = llm.chat(messages, sp, use_tqdm=False)
    ids = EngineAdapter(llm.llm_engine).render_chat(messages)
    (want,) = llm.generate([ids], sp, use_tqdm=False)
    assert out.prompt == "system: be brief\nuser: hi\nassistant:" and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    both = llm.chat([messages, messages[1:]], sp, use_tqdm=False)
    assert [o.prompt_token_ids for o in both] == [
        ids,
        EngineAdapter(llm.llm_engine).render_chat(messages[1:]),
    ]


def test_chat_uses_the_tokenizers_template(llm):
    tok = llm.get_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    try:
        (out,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        tok.chat_template = None
    assert out.prompt_token_ids == tok.encode("<user>hi<assistant>", add_special_tokens=False)


def test_chat_takes_vllms_template_keywords(llm):
    """chat_template overrides the tokenizer's; continue_final_message leaves the last message open;
    use_tqdm may be passed by position, as vLLM's signature allows."""
    tok = llm.get_tokenizer()
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last or not cont %}</>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]
    sp = SamplingParams(max_tokens=1)
    (out,) = llm.chat(conv, sp, False, chat_template=template, chat_template_kwargs={"cont": True},
                      add_generation_prompt=False, continue_final_message=True)  # fmt: skip
    assert out.prompt == "<user>hi</><assistant>hel"
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    (plain,) = llm.chat(conv, sp, False, add_generation_prompt=False, continue_final_message=True)
    assert plain.prompt == "user: hi\nassistant: hel"


@pytest.mark.parametrize(
    "kwargs,match",
    [({"continue_final_message": True}, "needs add_generation_prompt=False"),
     ({"chat_template": ""}, "chat_template must be"),
     ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
     ({"add_generation_prompt": "yes"}, "add_generation_prompt must be a boolean")],
    ids=["continue-and-prompt", "empty-template", "kwargs-list", "not-bool"],
)  # fmt: skip
def test_chat_template_keywords_refused_before_anything_is_queued(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.chat([{"role": "user", "content": "x"}], use_tqdm=False, **kwargs)
    assert not llm.llm_engine.requests and not llm.llm_engine.waiting


@pytest.mark.parametrize(
    "messages,match",
    [([], "messages must be"), ([{"role": "robot", "content": "x"}], r"messages\[0\]"),
     ([{"role": "user", "content": 3}], r"messages\[0\].content"),
     ([[{"role": "user", "content": "x"}], [{"role": "user"}]], r"messages\[1\]\[0\].content")],
    ids=["empty", "role", "content", "second-conversation"],
)  # fmt: skip
def test_chat_refusals_queue_nothing(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, use_tqdm=False)
    assert not llm.llm_engine.requests and not llm.llm_engine.waiting

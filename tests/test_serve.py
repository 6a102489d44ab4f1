"""mlakit serve's HTTP layer against a fake engine (tests/support/serve.py) on 127.0.0.1: the OpenAI
shapes, streaming, n, stop, usage, logprobs, every error with its status and `param`, the API key, the
queue limit, disconnects aborting, and the engine touched only by its loop thread."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from support.serve import FakeEngine, SamplingParams, ThreadServer, fake_completion

from mlakit.serve.adapter import EngineAdapter
from mlakit.serve.app import build_app


def make_server(engine=None, **kw) -> tuple[ThreadServer, FakeEngine]:
    engine = engine or FakeEngine()
    app = build_app(EngineAdapter(engine, sampling_params_cls=SamplingParams), "fake", **kw)
    return ThreadServer(app), engine


@pytest.fixture(scope="module")
def served():
    server, engine = make_server()
    try:
        yield server, engine
    finally:
        server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


def test_completion_matches_the_engine(client):
    r = client.completions.create(model="fake", prompt="hello world", max_tokens=7)
    want, reason = fake_completion("hello world", 7)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.created > 0
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 7, 18)


def test_stream_equals_whole_answer(client):
    chunks = list(client.completions.create(model="fake", prompt="stream me", max_tokens=9, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == fake_completion("stream me", 9)[0]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert len({c.id for c in chunks}) == 1


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model="fake", messages=messages, max_tokens=6)
    prompt = "system: be brief\nuser: hi\nassistant:"  # the plain template (the tokenizer has none)
    assert whole.choices[0].message.content == fake_completion(prompt, 6)[0]
    assert whole.choices[0].message.role == "assistant" and whole.usage.prompt_tokens == len(prompt)
    options = {"include_usage": True}
    stream = client.chat.completions.create(
        model="fake", messages=messages, max_completion_tokens=6, stream=True, stream_options=options
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == fake_completion(prompt, 6)[0]
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_n_choices_and_batch_prompts(client):
    r = client.completions.create(model="fake", prompt=["ab", "cd"], max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [fake_completion("ab", 3)[0]] * 2 + [
        fake_completion("cd", 3)[0]
    ] * 2
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 4


def test_token_id_prompt(client):
    r = client.completions.create(model="fake", prompt=[104, 105], max_tokens=4)
    assert r.choices[0].text == fake_completion("hi", 4)[0]


def test_stop_strings_cut_and_finish_stop(client):
    full = fake_completion("stopper", 12)[0]
    stop = full[5:7]
    r = client.completions.create(model="fake", prompt="stopper", max_tokens=12, stop=[stop, "\x00"])
    want = fake_completion("stopper", 12, [stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == want and r.choices[0].finish_reason == "stop"


def test_cached_tokens_on_a_repeated_prompt(client):
    prompt = "a prompt of thirty-one chars.."
    first = client.completions.create(model="fake", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="fake", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 28  # whole pages of 4, the last token computed


def test_logprobs(client):
    r = client.completions.create(model="fake", prompt="lp", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and lp.token_logprobs == [-0.5] * 3
    assert all(len(top) == 2 for top in lp.top_logprobs) and lp.text_offset == [0, 1, 2]
    messages = [{"role": "user", "content": "x"}]
    c = client.chat.completions.create(
        model="fake", messages=messages, max_tokens=2, logprobs=True, top_logprobs=1
    )
    content = c.choices[0].logprobs.content
    assert [e.token for e in content] == list(c.choices[0].message.content)
    assert all(len(e.top_logprobs) == 1 and e.bytes == list(e.token.encode()) for e in content)


def test_models_health_metrics(served):
    url = served[0].url
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "fake" and models["data"][0]["max_model_len"] == 512
    assert httpx.get(f"{url}/health").status_code == 200
    text = httpx.get(f"{url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket"):  # fmt: skip
        assert f"mlakit:{name}" in text, name


BAD = [
    ("unknown-model", {"model": "gpt-x", "prompt": "a"}, 404, "model"),
    ("no-prompt", {"model": "fake"}, 400, "prompt"),
    ("empty-prompt", {"prompt": ""}, 400, "prompt"),
    ("empty-list", {"prompt": []}, 400, "prompt"),
    ("prompt-type", {"prompt": {"a": 1}}, 400, "prompt"),
    ("token-past-vocab", {"prompt": [1, 999]}, 400, "prompt"),
    ("negative-token", {"prompt": [1, -2]}, 400, "prompt"),
    ("max-tokens-past-context", {"prompt": "abc", "max_tokens": 510}, 400, "max_tokens"),
    ("prompt-past-context", {"prompt": "x" * 600}, 400, "prompt"),
    ("max-tokens-zero", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-type", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("max-tokens-bool", {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("temperature", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("temperature-type", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("top-p-zero", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top-p-big", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("top-k", {"prompt": "a", "top_k": -2}, 400, "top_k"),
    ("min-p", {"prompt": "a", "min_p": 2}, 400, "min_p"),
    ("n-zero", {"prompt": "a", "n": 0}, 400, "n"),
    ("seed-type", {"prompt": "a", "seed": 1.5}, 400, "seed"),
    ("seed-range", {"prompt": "a", "seed": 2**64}, 400, "seed"),
    ("stop-type", {"prompt": "a", "stop": 5}, 400, "stop"),
    ("stop-empty", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("stop-ids", {"prompt": "a", "stop_token_ids": ["x"]}, 400, "stop_token_ids"),
    ("ignore-eos", {"prompt": "a", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("logprobs-big", {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("stream-type", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("stream-options", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("logit-bias", {"prompt": "a", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("prompt-logprobs", {"prompt": "a", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("best-of", {"prompt": "a", "best_of": 3}, 400, "best_of"),
]
BAD_CHAT = [
    ("no-messages", {"model": "fake"}, 400, "messages"),
    ("empty-messages", {"messages": []}, 400, "messages"),
    ("chat-echo", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
    ("bad-role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]"),
    ("content-type", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("top-logprobs-alone", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat-max-tokens", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 600}, 400,
     "max_tokens"),
    ("chat-max-completion-tokens", {"messages": [{"role": "user", "content": "x"}],
                                    "max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ("chat-max-completion-tokens-zero", {"messages": [{"role": "user", "content": "x"}],
                                         "max_completion_tokens": 0}, 400, "max_completion_tokens"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,param", [("/v1/completions", *b[1:]) for b in BAD]
                         + [("/v1/chat/completions", *b[1:]) for b in BAD_CHAT],
                         ids=[b[0] for b in BAD] + [b[0] for b in BAD_CHAT])  # fmt: skip
def test_bad_requests(served, path, body, status, param):
    r = httpx.post(served[0].url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe"], ids=["broken", "array", "bytes"])
def test_bad_bodies_are_400(served, content):
    r = httpx.post(served[0].url + "/v1/completions", content=content)
    assert r.status_code == 400 and r.json()["error"]["param"] is None


def test_non_finite_numbers_are_400(served):
    r = httpx.post(served[0].url + "/v1/completions", content=b'{"prompt": "a", "temperature": NaN}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_api_key():
    server, _ = make_server(api_key="sesame")
    try:
        body = {"prompt": "a", "max_tokens": 1}
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
        wrong = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
        assert ok.completions.create(model="fake", prompt="a", max_tokens=1).choices[0].text
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.close()


def _open_stream(http: httpx.Client, url: str, max_tokens: int = 200):
    body = {"prompt": "slow", "max_tokens": max_tokens, "stream": True}
    stream = http.stream("POST", url + "/v1/completions", json=body)
    response = stream.__enter__()
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    return stream, lines  # the caller holds `lines`: dropping it closes the response


def _wait_for(check, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_queue_limit_is_503_with_retry_after():
    server, engine = make_server(FakeEngine(max_num_seqs=1, step_delay=0.01), max_waiting=0)
    http = httpx.Client(timeout=10)
    streams = []
    try:
        streams = [_open_stream(http, server.url)]  # running: the one batch slot is taken
        r = http.post(server.url + "/v1/completions", json={"prompt": "one too many", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
    finally:
        for stream, _ in streams:
            stream.__exit__(None, None, None)
        http.close()
        server.close()


def test_disconnect_mid_stream_aborts_and_frees_pages():
    server, engine = make_server(FakeEngine(step_delay=0.01))
    try:
        with httpx.Client(timeout=10) as http:
            stream, lines = _open_stream(http, server.url)
            assert engine.used_pages > 0 and not engine.aborted
            stream.__exit__(None, None, None)
        _wait_for(lambda: len(engine.aborted) == 1 and engine.used_pages == 0)
        _wait_for(
            lambda: (
                'mlakit:num_requests_running{model_name="fake"} 0.0'
                in httpx.get(server.url + "/metrics").text
            )
        )
        assert not engine.has_unfinished_requests()
    finally:
        server.close()


def test_disconnect_while_waiting_for_a_whole_answer_aborts():
    server, engine = make_server(FakeEngine(step_delay=0.01))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 400}, timeout=0.3)
        _wait_for(lambda: len(engine.aborted) == 1 and engine.used_pages == 0)
    finally:
        server.close()


def test_32_concurrent_streams_and_one_engine_thread():
    server, engine = make_server(FakeEngine(max_num_seqs=8))
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    async def one(i: int) -> str:
        chunks = await client.completions.create(
            model="fake", prompt=f"p{i}", max_tokens=5 + i % 7, stream=True
        )
        return "".join([c.choices[0].text async for c in chunks])

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(32)))

    try:
        got = asyncio.run(all_of_them())
        assert got == [fake_completion(f"p{i}", 5 + i % 7)[0] for i in range(32)]
        assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids
        assert engine.used_pages == 0
    finally:
        server.close()


def test_the_loop_runs_on_the_compute_thread_the_engine_was_built_on():
    # serve builds the engine on a ComputeThread and runs its loop there: one thread with an OpenMP team
    from mlakit.engine.threads import ComputeThread

    compute = ComputeThread(name="test-serve-compute")
    engine = compute.call(FakeEngine)
    built_on = compute.ident()
    app = build_app(EngineAdapter(engine, sampling_params_cls=SamplingParams), "fake", compute=compute)
    state = app.state.mlakit
    assert not state.loop.alive()  # not started before the app is
    server = ThreadServer(app)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        for i in range(3):
            r = client.completions.create(model="fake", prompt=f"q{i}", max_tokens=4)
            assert r.choices[0].text == fake_completion(f"q{i}", 4)[0]
        assert httpx.get(server.url + "/health").status_code == 200
        assert engine.thread_ids == {built_on} and built_on != threading.get_ident()
    finally:
        server.close()
    assert not state.loop.alive()
    with pytest.raises(RuntimeError, match="stopped"):
        compute.submit(lambda: None)  # the loop's stop closed the thread


def test_a_taken_port_is_refused_before_the_model_loads(capsys):
    import socket

    from mlakit.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "no-such-folder", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlakit serve: error: --port") and len(err.splitlines()) == 1


class FailingEngine(FakeEngine):
    fail = True

    def step(self):
        if self.fail and self.has_unfinished_requests():
            self.fail = False
            raise RuntimeError("boom")
        return super().step()


class RefusingEngine(FakeEngine):
    def add_request(self, request_id, prompt, params):
        if prompt[0] == ord("!"):
            raise RuntimeError("cannot add")
        if prompt[0] == ord("?"):
            raise ValueError("top_k is not what this engine takes")
        return super().add_request(request_id, prompt, params)


def test_add_request_failures_stay_with_their_request():
    server, _ = make_server(RefusingEngine())
    try:
        failed = httpx.post(server.url + "/v1/completions", json={"prompt": "!x", "max_tokens": 2})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "?x", "max_tokens": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_k"
        assert (
            httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code
            == 200
        )
    finally:
        server.close()


def test_a_failing_step_is_500_for_its_requests_and_the_server_lives_on():
    server, engine = make_server(FailingEngine())
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert engine.aborted and engine.used_pages == 0
        again = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert again.status_code == 200 and httpx.get(server.url + "/health").status_code == 200
    finally:
        server.close()


def test_a_bad_model_is_one_line(capsys, tmp_path):
    from support.serve import free_port

    from mlakit.cli import main

    assert main(["serve", "--model", str(tmp_path / "missing"), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mlakit serve: error: model") and "config.json" in err[-1]


def test_chat_uses_the_tokenizers_template_when_it_has_one():
    from support.serve_tiny import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    adapter = EngineAdapter(FakeEngine(), tokenizer=tok, sampling_params_cls=SamplingParams)
    ids = adapter.render_chat([{"role": "user", "content": "hi"}])
    assert ids == tok.encode("<user>hi<assistant>", add_special_tokens=False)
    plain = EngineAdapter(FakeEngine(), sampling_params_cls=SamplingParams)
    assert plain.decode(plain.render_chat([{"role": "user", "content": "hi"}])) == "user: hi\nassistant:"


def test_each_choice_finishes_once_in_a_stream():
    from types import SimpleNamespace as NS

    from mlakit.serve.tracking import Track

    class Metrics:
        def add(self, *a):
            pass

        def observe(self, *a):
            pass

    track = Track("r", None, None, 0.0, 3, Metrics())

    def out(c0, c1, finished):
        return NS(outputs=[c0, c1], finished=finished, num_cached_tokens=0)

    done = NS(index=0, text="ab", token_ids=[1, 2], logprobs=None, finish_reason="length")
    steps = [
        out(
            NS(index=0, text="a", token_ids=[1], logprobs=None, finish_reason=None),
            NS(index=1, text="x", token_ids=[7], logprobs=None, finish_reason=None),
            False,
        ),
        out(done, NS(index=1, text="xy", token_ids=[7, 8], logprobs=None, finish_reason=None), False),
        out(done, NS(index=1, text="xyz", token_ids=[7, 8, 9], logprobs=None, finish_reason="length"), True),
    ]
    deltas = [d for i, o in enumerate(steps) for d in track.advance(o, float(i + 1))]
    finishes = [(d.index, d.finish_reason) for d in deltas if d.finish_reason]
    assert finishes == [(0, "length"), (1, "length")]
    assert "".join(d.text for d in deltas if d.index == 0) == "ab"
    assert "".join(d.text for d in deltas if d.index == 1) == "xyz"

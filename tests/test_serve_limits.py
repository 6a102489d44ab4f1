"""Limits, one rule everywhere: what cannot fit is refused before it costs anything (a 16 MB body while
/health keeps answering, prompts of more characters than the context can hold, tokenizing off the event
loop), the same message from the API, the CLI and the server, and every `mlakit generate` argument
checked before the model loads. Also the access log and the vLLM options the server forwards."""

from __future__ import annotations

import gc
import json
import logging
import threading
import time

import httpx
import pytest
from support.serve import CharTokenizer, FakeEngine, SamplingParams, ThreadServer, start_cli_server
from support.serve_tiny import write_tiny_model

from mlakit.engine import LLM
from mlakit.engine import SamplingParams as RealParams
from mlakit.serve import fields
from mlakit.serve.adapter import EngineAdapter
from mlakit.serve.app import build_app

SIXTEEN_MB = 16 * 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def child(tiny):
    proc, base = start_cli_server(["--model", tiny, "--dtype", "fp32", "--served-model-name", "tiny"])
    try:
        yield proc, base
    finally:
        proc.kill()  # by PID: only the server this module started
        proc.wait(10)


def health_while(url: str, work) -> tuple[list[float], object]:
    """Run `work()` in a thread while timing /health back to back on a second connection; returns
    (each /health's seconds, what `work` returned)."""
    result, times = {}, []
    thread = threading.Thread(target=lambda: result.setdefault("out", work()))
    with httpx.Client(timeout=5) as http:
        http.get(url + "/health")  # the connection is open before the timing starts
        thread.start()
        while thread.is_alive() or not times:
            start = time.perf_counter()
            assert http.get(url + "/health").status_code == 200
            times.append(time.perf_counter() - start)
    thread.join()
    return times, result["out"]


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_16mb_request_is_refused_while_health_answers_in_100ms(child, declared):
    url = child[1]
    body = json.dumps({"model": "tiny", "prompt": "x" * SIXTEEN_MB}).encode()

    def send():
        content = body if declared else (body[i : i + 2**20] for i in range(0, len(body), 2**20))
        with httpx.Client(timeout=60) as http:
            start = time.perf_counter()
            r = http.post(
                url + "/v1/completions", content=content, headers={"content-type": "application/json"}
            )
            return r, time.perf_counter() - start

    times, (r, took) = health_while(url, send)
    print(
        f"16 MB body: {r.status_code} after {took:.2f} s; "
        f"/health x{len(times)}, slowest {max(times) * 1e3:.1f} ms"
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert max(times) < 0.1


def test_a_prompt_past_what_the_context_can_hold_is_refused_before_tokenizing(child):
    # the byte tokenizer's longest entry is "<bos>" (5 characters): 512 tokens hold at most 2,560
    r = httpx.post(child[1] + "/v1/completions", json={"prompt": "y" * 2561, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "2561 characters" in r.json()["error"]["message"]


def test_the_access_log_has_a_line_per_request(child):
    proc, url = child
    httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    deadline = time.monotonic() + 5
    while not any('"POST /v1/completions HTTP/1.1" 200 OK' in line for line in proc.output):
        assert time.monotonic() < deadline, list(proc.output)[-5:]
        time.sleep(0.05)
    line = next(x for x in proc.output if '"POST /v1/completions HTTP/1.1" 200 OK' in x)
    assert line.startswith("INFO:     127.0.0.1:") and line.rstrip().endswith(" ms")


def cli_error(capsys, argv) -> str:
    from mlakit.cli import main

    assert main(argv) == 2
    return capsys.readouterr().err.strip().splitlines()[-1].removeprefix("mlakit generate: error: ")


def api_error(call) -> str:
    with pytest.raises(ValueError) as err:
        call()
    return str(err.value)


def server_error(url: str, body: dict, param: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "keep talking", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    return r.json()["error"]["message"]


@pytest.mark.parametrize("max_tokens", [10**9, 100_000, 501, 0], ids=["1e9", "1e5", "one-past", "zero"])
def test_max_tokens_gets_one_message_from_api_cli_and_server(child, tiny, capsys, max_tokens):
    llm = LLM(tiny, dtype="fp32", num_blocks=8)  # 8 pages of 64: max_model_len 512, as the server's
    api = api_error(lambda: llm.generate("keep talking", RealParams(max_tokens=max_tokens), use_tqdm=False))
    argv = ["generate", "--model", tiny, "--prompt", "keep talking", "--max-tokens", str(max_tokens)]
    assert cli_error(capsys, argv) == api == server_error(child[1], {"max_tokens": max_tokens}, "max_tokens")
    assert not llm.llm_engine.requests and not llm.llm_engine.waiting
    assert api.startswith("max_tokens") and ("512" in api or max_tokens == 0)


def test_logprobs_past_20_get_one_message_from_api_and_server(child):
    api = api_error(lambda: RealParams(logprobs=1000))
    assert (
        api
        == server_error(child[1], {"logprobs": 1000}, "logprobs")
        == ("logprobs must be from 0 to 20 (max_logprobs), got 1000")
    )
    assert server_error(child[1], {"logprobs": 21}, "logprobs") == api_error(lambda: RealParams(logprobs=21))


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--cache-dtype", "fp8"], "cache_dtype='fp8' needs kv_lora_rank divisible by 128"),
        (["--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--max-tokens", "100000"], "max_tokens 100000 is too many"),
        (["--top-p", "0"], "top_p"),
        (["--dtype", "fp64"], "dtype"),
        (["--cache-memory", "lots"], "cache_memory"),
    ],
    ids=["empty-prompt", "fp8-width", "zero", "past-context", "top-p", "dtype", "cache-memory"],
)
def test_generate_checks_every_argument_before_loading(tiny, capsys, monkeypatch, flags, match):
    import mlakit.engine

    def never(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(mlakit.engine, "LLM", never)
    argv = ["generate", "--model", tiny, "--prompt", "hi", *flags]
    assert match in cli_error(capsys, argv)


def test_generate_refuses_a_missing_model_before_loading(capsys, tmp_path):
    assert "config.json" in cli_error(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi"])


class SlowTokenizer(CharTokenizer):
    """Prompts starting with "slow" take a second to tokenize (sleeping releases the GIL, as the
    transformers tokenizers do); counts its calls."""

    calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        SlowTokenizer.calls += 1
        if text.startswith("slow"):
            time.sleep(1.0)
        return super().encode(text, add_special_tokens)


class RecordingEngine(FakeEngine):
    def __init__(self):
        super().__init__()
        self.params = []

    def add_request(self, request_id, prompt, params):
        self.params.append(params)
        return super().add_request(request_id, prompt, params)


@pytest.fixture(scope="module")
def fake():
    engine = RecordingEngine()
    app = build_app(EngineAdapter(engine, tokenizer=SlowTokenizer()), "fake")  # the real SamplingParams
    server = ThreadServer(app)
    # as `mlakit serve` does once started: a full collection over this process's heap (torch,
    # transformers) holds the GIL ~0.2 s, which is not what the timing tests measure
    gc.collect()
    gc.freeze()
    try:
        yield server.url, engine
    finally:
        gc.unfreeze()
        server.close()


def test_tokenizing_runs_off_the_event_loop(fake):
    url = fake[0]
    times, r = health_while(
        url, lambda: httpx.post(url + "/v1/completions", json={"prompt": "slow", "max_tokens": 2})
    )
    assert r.status_code == 200 and max(times) < 0.1 and len(times) > 3


def test_characters_past_the_context_are_refused_without_tokenizing(fake):
    before = SlowTokenizer.calls
    r = httpx.post(
        fake[0] + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "z" * 70_000}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert SlowTokenizer.calls == before


def test_temperature_nan_is_not_a_finite_number(fake):
    r = httpx.post(fake[0] + "/v1/completions", content=b'{"prompt": "a", "temperature": NaN}')
    assert (
        r.status_code == 400
        and r.json()["error"]["message"] == "`temperature` must be a finite number, got nan"
    )


OPTIONS = dict(min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
               include_stop_str_in_output=True, skip_special_tokens=False)  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
def test_vllm_options_reach_the_engine(fake, path):
    url, engine = fake
    prompt = {"prompt": "a"} if "chat" not in path else {"messages": [{"role": "user", "content": "a"}]}
    r = httpx.post(url + path, json={**prompt, "max_tokens": 3, **OPTIONS})
    assert r.status_code == 200, r.text
    assert {k: getattr(engine.params[-1], k) for k in OPTIONS} == OPTIONS


@pytest.mark.parametrize(
    "field,value",
    [("presence_penalty", 3), ("frequency_penalty", "x"), ("repetition_penalty", 0), ("min_tokens", 9),
     ("skip_special_tokens", 1)],
    ids=["presence", "frequency-type", "repetition", "min-over-max", "skip-type"],
)  # fmt: skip
def test_vllm_options_refused_with_the_apis_message(fake, field, value):
    r = httpx.post(fake[0] + "/v1/completions", json={"prompt": "a", "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert r.json()["error"]["message"] == api_error(lambda: RealParams(max_tokens=4, **{field: value}))


def test_access_log_lines_and_the_flag_that_turns_them_off(caplog):
    caplog.set_level(logging.INFO, logger="mlakit.serve.access")
    for enabled in (True, False):
        engine = FakeEngine()
        app = build_app(EngineAdapter(engine, sampling_params_cls=SamplingParams), "fake", access_log=enabled,
                        access_log_skip=("/health",))  # fmt: skip
        server = ThreadServer(app)
        try:
            caplog.clear()
            httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
            httpx.post(server.url + "/v1/completions", json={"prompt": ""})
            httpx.get(server.url + "/health")
        finally:
            server.close()
        lines = [r.getMessage() for r in caplog.records if r.name == "mlakit.serve.access"]
        if not enabled:
            assert lines == []
            continue
        assert len(lines) == 2, lines
        assert '"POST /v1/completions HTTP/1.1" 200 OK' in lines[0] and lines[0].startswith("127.0.0.1:")
        assert '"POST /v1/completions HTTP/1.1" 400 Bad Request' in lines[1] and lines[1].endswith(" ms")


def test_serve_flags_reach_the_app():
    from mlakit.cli import build_parser
    from mlakit.commands.serve import app_kwargs

    args = build_parser().parse_args(["serve", "--max-request-bytes", "5000", "--disable-uvicorn-access-log",
                                      "--disable-access-log-for-endpoints", "/health,/metrics"])  # fmt: skip
    kw = app_kwargs(args)
    assert (kw["max_request_bytes"], kw["access_log"], kw["access_log_skip"]) == (
        5000,
        False,
        ("/health", "/metrics"),
    )


def test_one_prompt_past_the_context_queues_none_of_the_batch(tiny):
    llm = LLM(tiny, dtype="fp32", num_blocks=8)
    params = [RealParams(max_tokens=4), RealParams(max_tokens=10**6)]
    with pytest.raises(ValueError, match="^max_tokens 1000000 is too many"):
        llm.generate(["hi", "hi"], params, use_tqdm=False)
    assert not llm.llm_engine.requests and not llm.llm_engine.waiting


@pytest.mark.parametrize("tokenizer,chars", [("byte", 5), ("char", 128)], ids=["byte-level", "no-vocab"])
def test_characters_per_token_bound(tokenizer, chars):
    from support.serve_tiny import byte_tokenizer

    from mlakit.serve.guard import default_request_bytes, longest_token_chars

    tok = byte_tokenizer() if tokenizer == "byte" else CharTokenizer()
    assert longest_token_chars(tok) == chars  # "<bos>"; a tokenizer without get_vocab: the fallback
    assert default_request_bytes(512 * chars) == 2**20 and default_request_bytes(16384 * 128) == 8 * 2**20


@pytest.fixture(scope="module")
def roomy():
    """The fake engine behind a 64 MiB body limit: what a long-context model's default lets through."""
    app = build_app(
        EngineAdapter(RecordingEngine(), tokenizer=SlowTokenizer()), "fake", max_request_bytes=2**26
    )
    server = ThreadServer(app)
    gc.collect()
    gc.freeze()
    try:
        yield server.url
    finally:
        gc.unfreeze()
        server.close()


@pytest.mark.parametrize("batched", [False, True], ids=["one-list", "list-of-lists"])
def test_megabytes_of_token_ids_are_refused_by_length_before_any_id_is_read(roomy, batched, monkeypatch):
    ids = [7] * 3_000_000  # ~9 MB of JSON: every id was checked in Python on the event loop before
    prompt = [[1, 2], ids] if batched else ids
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    read = []
    monkeypatch.setattr(fields, "token_ids", lambda value, name: read.append(name) or value)

    def send():
        with httpx.Client(timeout=60) as http:
            return http.post(
                roomy + "/v1/completions", content=body, headers={"content-type": "application/json"}
            )

    times, r = health_while(roomy, send)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    message = r.json()["error"]["message"]
    assert message.startswith("prompt has 3000000 tokens; this model's maximum context length is 512")
    assert message.endswith(" (prompt 1)") == batched and not read
    # what is left is json.loads in a thread, which holds the interpreter lock (~25 ms per MB here,
    # the client's thread in this process competing for it too): bounded, not the per-id seconds
    print(f"/health x{len(times)}, slowest {max(times) * 1e3:.1f} ms")
    assert max(times) < 1.0, f"/health slowest {max(times) * 1e3:.1f} ms"


def test_a_refused_value_is_shown_cut_short(roomy):
    stop = ["ab"] * 200_000 + [5]  # one bad entry in a long list: the message shows 200 characters of it
    r = httpx.post(roomy + "/v1/completions", json={"prompt": "hi", "stop": stop, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    message = r.json()["error"]["message"]
    assert len(message) < 400 and "(200,001 items, " in message, message


def test_the_prompt_too_long_among_several_is_named(fake):
    prompts = ["hi", "q" * 600, "there"]  # the byte tokenizer: a token per character, context 512
    r = httpx.post(fake[0] + "/v1/completions", json={"prompt": prompts, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"].endswith("(prompt 1)"), r.text


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_folder_without_a_tokenizer_is_refused_in_one_line_before_loading(tiny, tmp_path, capsys, command):
    import shutil

    from mlakit.cli import main

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{tiny}/{name}", bare / name)
    argv = [command, "--model", str(bare)] + (
        ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    )
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no tokenizer files" in err[0], err

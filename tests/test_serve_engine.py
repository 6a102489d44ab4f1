"""`mlakit serve --model FOLDER` (a tiny fp32 DeepSeek-V3, real engine) in a child process on a free
loopback port, called with the `openai` client: greedy answers equal `LLM.generate`, n, stop strings,
usage and cached tokens, errors, a disconnect freeing its pages, 32 concurrent streams, a bounded soak."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
from support.serve import start_cli_server
from support.serve_tiny import write_tiny_model

from mlakit.engine import LLM, SamplingParams

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="fp32")


@pytest.fixture(scope="module")
def url(tiny):
    proc, base = start_cli_server(["--model", tiny, "--dtype", "fp32", "--served-model-name", "tiny"])
    try:
        yield base
    finally:
        proc.kill()  # by PID: only the server this module started
        proc.wait(10)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def offline(llm, prompts, max_tokens, **kw):
    params = SamplingParams(max_tokens=max_tokens, **GREEDY, **kw)
    return llm.generate(prompts, params, use_tqdm=False)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"mlakit:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(url: str, seconds: float = 30.0) -> None:
    """Until no request runs or waits and requests hold no page (prefix-cache pages count as free)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(
            metric(url, m) == 0
            for m in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ):
            return
        time.sleep(0.1)
    raise AssertionError("the server did not go idle: requests or pages were left behind")


def test_greedy_completions_equal_llm_generate(client, llm):
    prompts = ["Hello there", "MLA caches one latent per token", "x"]
    want = offline(llm, prompts, 12)
    for prompt, out in zip(prompts, want, strict=True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **GREEDY)
        assert r.choices[0].text == out.outputs[0].text
        assert r.choices[0].finish_reason == out.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(out.prompt_token_ids)
        assert r.usage.completion_tokens == len(out.outputs[0].token_ids)
        streamed = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, stream=True, **GREEDY
        )
        assert "".join(c.choices[0].text for c in streamed) == out.outputs[0].text


def test_chat_uses_the_plain_template(client, llm):
    messages = [{"role": "user", "content": "hi"}]
    want = offline(llm, ["user: hi\nassistant:"], 8)[0].outputs[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
    assert r.choices[0].message.content == want.text
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.text


def test_n2_and_stop_strings(client, llm):
    want = offline(llm, ["two of them"], 10)[0].outputs[0]
    r = client.completions.create(model="tiny", prompt="two of them", max_tokens=10, n=2, **GREEDY)
    assert [c.text for c in r.choices] == [want.text] * 2 and r.usage.completion_tokens == 20
    stop = want.text[3:5]
    cut = offline(llm, ["two of them"], 10, stop=[stop])[0].outputs[0]
    r = client.completions.create(model="tiny", prompt="two of them", max_tokens=10, stop=stop, **GREEDY)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut.text, "stop")
    assert stop not in r.choices[0].text


def test_usage_and_cached_tokens_on_a_repeated_prompt(client):
    prompt = "a long shared prompt " * 8  # 168 tokens: two whole pages of 64
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 168
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 128
    assert again.usage.total_tokens == 170


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "other", "prompt": "a"}, 404, "model"),
        ({"prompt": "a", "max_tokens": 600}, 400, "max_tokens"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": [5, 258]}, 400, "prompt"),
        ({"prompt": "a", "top_p": 0}, 400, "top_p"),
        ({"prompt": "a", "n": "2"}, 400, "n"),
    ],
    ids=["model", "max-tokens", "empty", "vocab", "top-p", "n-type"],
)
def test_errors(url, body, status, param):
    r = httpx.post(url + "/v1/completions", json=body)
    assert (r.status_code, r.json()["error"]["param"]) == (status, param)


def wait_metrics(url: str, check, seconds: float = 10.0) -> None:
    """Until `check(name -> value)` holds: the engine publishes after its own steps, not the client's."""
    deadline = time.monotonic() + seconds
    while not check(lambda name: metric(url, name)):
        assert time.monotonic() < deadline, "the metrics never showed the expected state"
        time.sleep(0.02)


def test_disconnect_mid_stream_aborts_and_frees_pages(url):
    # ignore_eos: greedy on the tiny model ends "keep talking" by EOS after 24 tokens, sooner than a
    # loaded machine reads /metrics
    body = {"model": "tiny", "prompt": "keep talking", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url + "/v1/completions", json=body | GREEDY) as r,
    ):
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        wait_metrics(url, lambda m: m("num_requests_running") == 1 and m("kv_cache_usage_perc") > 0)
    wait_idle(url, 10)
    assert httpx.get(url + "/health").status_code == 200


def test_32_concurrent_streams_equal_offline(url, llm):
    prompts = [f"request {i}: " + "abc" * (i % 5) for i in range(32)]
    lens = [4 + i % 9 for i in range(32)]
    want = [offline(llm, [p], n)[0].outputs[0].text for p, n in zip(prompts, lens, strict=True)]

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(prompt, n):
            chunks = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=n, stream=True, **GREEDY
            )
            return "".join([c.choices[0].text async for c in chunks])

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lens, strict=True)))

    got = asyncio.run(main())
    flips = [i for i in range(32) if got[i] != want[i]]
    print(f"32 concurrent streams: {len(flips)} differ from their offline answers {flips}")
    assert not flips
    wait_idle(url, 10)


def test_bounded_soak(url):
    """160 requests (random lengths; a third streamed and dropped mid-way or timed out), 16 at a time."""
    rng = random.Random(0)
    statuses: list[int] = []

    async def one(http: httpx.AsyncClient, i: int):
        prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 200)))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randint(1, 24), "temperature": 1.0}
        kind = rng.choice(["whole", "stream", "drop", "timeout", "n2"])
        if kind == "n2":
            body["n"] = 2
        if kind in ("stream", "drop"):
            body["stream"] = True
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                statuses.append(r.status_code)
                async for line in r.aiter_lines():
                    if kind == "drop" and line.startswith("data:") and rng.random() < 0.3:
                        break
            return
        try:
            r = await http.post(url + "/v1/completions", json=body, timeout=0.05 if kind == "timeout" else 60)
            statuses.append(r.status_code)
        except httpx.TimeoutException:
            pass

    async def main():
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=60) as http:

            async def bounded(i):
                async with limit:
                    await one(http, i)

            await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(160))), 120)

    start = time.monotonic()
    asyncio.run(main())
    print(f"soak: {len(statuses)} answered in {time.monotonic() - start:.1f} s")
    assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
    wait_idle(url, 30)
    assert httpx.get(url + "/health").status_code == 200


def test_the_documented_calls_run_as_written(url, tmp_path):
    """docs/serve.md's curl and openai lines, against this server (its URL and model name swapped in)."""
    import contextlib
    import io
    import os
    import re
    import shutil
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "serve.md"), encoding="utf-8") as f:
        doc = f.read()

    def swap(text: str) -> str:
        return text.replace("http://127.0.0.1:8000", url).replace('"demo"', '"tiny"')

    python = next(b for b in re.findall(r"^```python\n(.*?)^```", doc, re.S | re.M) if "OpenAI(" in b)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(swap(python), "docs/serve.md", "exec"), {"__name__": "__doc__"})
    assert "completion_tokens=16" in printed.getvalue()
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    shell = next(b for b in re.findall(r"^```bash\n(.*?)^```", doc, re.S | re.M) if "curl" in b)
    done = subprocess.run(
        ["bash", "-c", swap(shell)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert (
        done.returncode == 0 and '"object":"text_completion"' in done.stdout and "data: [DONE]" in done.stdout
    )

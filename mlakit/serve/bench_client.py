"""bench-serve's client: streams each request over aiohttp and times its chunks; the runner paces
arrivals (Poisson at --request-rate, or all at once) under --max-concurrency."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import aiohttp

from mlakit.serve.bench_data import BenchRequest
from mlakit.serve.bench_report import Result

TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
REFUSED = (401, 403)


def refused(status: int, keyed: bool) -> str:
    """The one line for a server that refused the request's key (or its lack of one)."""
    if keyed:
        return f"the server refused the key given with --api-key (HTTP {status})"
    return f"the server refused the key: pass --api-key (HTTP {status})"


class StatusError(ValueError):
    """A non-200 answer to a GET or POST; a 401 or 403 says the key was refused."""

    def __init__(self, url: str, status: int, text: str, keyed: bool):
        message = refused(status, keyed) if status in REFUSED else f"{url} answered {status}: {text[:200]}"
        super().__init__(message)
        self.url = url
        self.status = status


class Server:
    """One OpenAI-compatible server: its URL, endpoint, model and key."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, endpoint: str, api_key: str | None):
        self.session = session
        self.base = base_url.rstrip("/")
        self.endpoint = endpoint
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model: str | None = None
        self.ignore_eos = True  # dropped for a server that refuses the field (e.g. `transformers serve`)

    async def get_json(self, path: str) -> dict:
        async with self.session.get(self.base + path, headers=self.headers) as resp:
            return await self._json(path, resp)

    async def post_json(self, path: str, body: dict) -> dict:
        async with self.session.post(self.base + path, json=body, headers=self.headers) as resp:
            return await self._json(path, resp)

    async def _json(self, path: str, resp) -> dict:
        if resp.status != 200:
            raise StatusError(self.base + path, resp.status, await resp.text(), bool(self.headers))
        return await resp.json()

    def payload(self, req: BenchRequest) -> dict:
        body = {
            "model": self.model,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.output_len
        else:
            body["prompt"] = req.prompt
            body["max_tokens"] = req.output_len
        return body


class ServerTokenizer:
    """The served tokenizer, through the server's /tokenizer_info, /tokenize and /detokenize."""

    def __init__(self, server: Server, vocab_size: int):
        self.server = server
        self.vocab_size = vocab_size

    async def encode(self, text: str) -> list[int]:
        return (await self.server.post_json("/tokenize", {"prompt": text, "add_special_tokens": False}))[
            "tokens"
        ]

    async def decode(self, ids: list[int]) -> str:
        return (await self.server.post_json("/detokenize", {"tokens": ids}))["prompt"]


async def send(server: Server, req: BenchRequest) -> Result:
    result = await _send(server, req)
    if result.error.startswith("ServerDisconnectedError"):
        # a kept-alive connection the server had just closed (uvicorn closes idle ones after 5 s): once more
        result = await _send(server, req)
    return result


async def _send(server: Server, req: BenchRequest) -> Result:
    result = Result(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with server.session.post(server.base + server.endpoint, json=server.payload(req),
                                       headers=server.headers) as resp:  # fmt: skip
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                now = time.perf_counter()
                if _has_text(chunk):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                usage = chunk.get("usage")
                if usage:
                    result.output_len = usage.get("completion_tokens", 0)
                    result.prompt_len = usage.get("prompt_tokens", req.prompt_len)
        result.latency = time.perf_counter() - start
        result.output_len = result.output_len or chunks
        result.ok = chunks > 0
        result.error = "" if result.ok else "no tokens came back"
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


def _has_text(chunk: dict) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def run(server: Server, requests: list[BenchRequest], rate: float, concurrency: int | None, seed: int,
              bar) -> tuple[list[Result], float]:  # fmt: skip
    """Every request sent (paced) and awaited; returns the results in order and the wall time."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)

    async def one(req: BenchRequest) -> Result:
        if limit is None:
            result = await send(server, req)
        else:
            async with limit:
                result = await send(server, req)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.ensure_future(one(req)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def progress(total: int, enabled: bool):
    """tqdm on stderr when installed and wanted; else a bar that prints nothing."""
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        return _Quiet()
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)


class _Quiet:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass

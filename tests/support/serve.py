"""A small fake of mlakit.engine.LLMEngine (same methods and output shapes), and servers for tests.

The fake generates one deterministic token per choice per step from a character tokenizer, holds pages
(`block_size` tokens each) while a request runs, and counts whole cached prompt pages, so every path of
the server (streaming, n, stop, usage, aborts, metrics, queue limits) is testable in milliseconds.
"""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

EOS = 256


class CharTokenizer:
    """One token per latin-1 character; id 256 is the end of sequence."""

    chat_template = None
    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) if ord(c) < 256 else ord("?") for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i < 256)

    def __len__(self) -> int:
        return 257


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list | None = None
    stop_token_ids: list | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    finish_reason: str | None
    logprobs: list | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: object
    prompt_token_ids: list
    outputs: list
    num_cached_tokens: int
    finished: bool


@dataclass
class _Req:
    rid: str
    prompt: list
    params: SamplingParams
    tokens: list = field(default_factory=list)  # per choice
    done: list = field(default_factory=list)  # finish reason per choice
    cached: int = 0
    pages: int = 0


def next_token(prompt: list, generated: list) -> int:
    """The fake model: a letter from the prompt's sum and the position."""
    return ord("a") + (sum(prompt) + 7 * len(generated)) % 26


def fake_completion(prompt: str, max_tokens: int, stop=None) -> tuple[str, str]:
    """The text and finish reason the fake engine gives a prompt (what LLM.generate would return)."""
    tok = CharTokenizer()
    ids, out = tok.encode(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(ids, out))
        text = tok.decode(out)
        hit = [text.index(s) for s in stop or () if s in text]
        if hit:
            return text[: min(hit)], "stop"
    return tok.decode(out), "length"


class FakeEngine:
    def __init__(self, max_num_seqs=4, block_size=4, num_blocks=256, max_model_len=512, step_delay=0.0):
        self.tokenizer = CharTokenizer()
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.step_delay = step_delay
        self.used_pages = 0
        self.steps = 0
        self.aborted: list[str] = []
        self._seen_pages: set = set()
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._ids: set = set()
        self.thread_ids: set = set()

    def add_request(self, request_id, prompt, params):
        self.thread_ids.add(threading.get_ident())
        if request_id in self._ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens {params.max_tokens} goes past the context")
        self._ids.add(request_id)
        n = params.n
        self._waiting.append(_Req(request_id, list(prompt), params, [[] for _ in range(n)], [None] * n))

    def abort_request(self, request_id):
        self.thread_ids.add(threading.get_ident())
        if request_id not in self._ids:
            raise ValueError(f"request_id {request_id!r} is unknown")
        for queue in (self._waiting, self._running):
            for r in list(queue):
                if r.rid == request_id:
                    queue.remove(r)
                    self.used_pages -= r.pages
                    self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self) -> dict:
        usage = self.used_pages / self.num_blocks
        return {"num_running": len(self._running), "num_waiting": len(self._waiting), "kv_cache_usage": usage}

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._admit(self._waiting.pop(0))
        outs = [self._advance(r) for r in list(self._running)]
        return outs

    def _admit(self, r: _Req) -> None:
        b = self.block_size
        whole = (len(r.prompt) - 1) // b
        keys = [tuple(r.prompt[: (i + 1) * b]) for i in range(whole)]
        r.cached = b * next((i for i, k in enumerate(keys) if k not in self._seen_pages), whole)
        self._seen_pages.update(keys)
        self._running.append(r)

    def _advance(self, r: _Req) -> RequestOutput:
        for i, out in enumerate(r.tokens):
            if r.done[i] is None:
                out.append(next_token(r.prompt, out))
                r.done[i] = self._finish(r, i)
        pages = -(-(len(r.prompt) + max(len(t) for t in r.tokens)) // self.block_size) * len(r.tokens)
        self.used_pages += pages - r.pages
        r.pages = pages
        finished = all(d is not None for d in r.done)
        if finished:
            self._running.remove(r)
            self.used_pages -= r.pages
        return RequestOutput(r.rid, None, list(r.prompt), [self._output(r, i) for i in range(len(r.tokens))],
                             r.cached, finished)  # fmt: skip

    def _finish(self, r: _Req, i: int) -> str | None:
        text = self.tokenizer.decode(r.tokens[i])
        if any(s in text for s in r.params.stop or ()):
            return "stop"
        return "length" if len(r.tokens[i]) >= r.params.max_tokens else None

    def _output(self, r: _Req, i: int) -> CompletionOutput:
        ids = list(r.tokens[i])
        text = self.tokenizer.decode(ids)
        hits = [text.index(s) for s in r.params.stop or () if s in text]
        text = text[: min(hits)] if hits else text
        k = r.params.logprobs
        alternatives = {ord("A") + j: -2.0 - j for j in range(k or 0)}
        logprobs = None if k is None else [{t: -0.5, **alternatives} for t in ids]
        return CompletionOutput(i, text, ids, r.done[i], logprobs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn serving `app` on 127.0.0.1 in a thread of this process (stopped in `close`)."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_cli_server(args: list[str], timeout: float = 240.0) -> tuple[subprocess.Popen, str]:
    """`python -m mlakit.cli serve ARGS --port FREE` in a child process; returns it and its base URL once
    /health answers (the caller kills it by PID in a finally)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "mlakit.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the server's output (an access line per request) is read as it comes: a full pipe would block it
    proc.output = collections.deque(maxlen=2000)
    threading.Thread(target=lambda: proc.output.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            time.sleep(0.2)
            raise RuntimeError(f"mlakit serve exited with {proc.returncode}: {''.join(proc.output)[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("mlakit serve did not answer /health in time")

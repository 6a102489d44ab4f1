"""The FastAPI app: routes translate HTTP to `Job`s for the one engine loop, and errors to OpenAI's JSON."""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from mlakit.serve import guard, handlers, protocol
from mlakit.serve.access import AccessLog
from mlakit.serve.errors import APIError, bad_api_key, bad_request, model_not_found
from mlakit.serve.loop import EngineLoop
from mlakit.serve.metrics import Metrics

DEFAULT_MAX_WAITING = 1024


@dataclass
class ServerState:
    adapter: object  # EngineAdapter
    loop: EngineLoop
    metrics: Metrics
    model_name: str
    api_key: str | None
    max_waiting: int
    created: int
    max_prompt_chars: int = 0  # the most characters max_model_len tokens can hold (guard.py)
    max_request_bytes: int = 0


def build_app(
    adapter,
    model_name: str,
    api_key: str | None = None,
    max_waiting: int = DEFAULT_MAX_WAITING,
    max_request_bytes: int | None = None,
    access_log: bool = True,
    access_log_skip=(),
    compute=None,
):
    """The app around one engine (through its `EngineAdapter`); the engine loop runs while the app does.
    `max_request_bytes`: the body limit (default `guard.default_request_bytes`); `access_log`: one line
    per request on the `mlakit.serve.access` logger, but for the paths in `access_log_skip`; `compute`:
    the `ComputeThread` the engine was built on, to run the engine loop on (None: a thread of its own)."""
    metrics = Metrics(model_name)
    loop = EngineLoop(adapter, metrics, compute=compute)
    state = ServerState(adapter, loop, metrics, model_name, api_key, max_waiting, int(time.time()))
    state.max_prompt_chars = guard.longest_token_chars(adapter.tokenizer) * adapter.max_model_len
    state.max_request_bytes = max_request_bytes or guard.default_request_bytes(state.max_prompt_chars)

    @asynccontextmanager
    async def lifespan(app):
        state.loop.start()
        yield
        state.loop.stop()

    app = FastAPI(title="mlakit", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.mlakit = state
    if access_log:
        app.add_middleware(AccessLog, skip=access_log_skip)
    _errors(app)
    _routes(app, state)
    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, err):
        return JSONResponse(bad_request(None, str(err)).body(), status_code=400)


def _routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        return Response(status_code=200 if state.loop.alive() else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(state, request)
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "mlakit",
                "root": state.model_name, "max_model_len": state.adapter.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        _authorize(state, request)
        return {"vocab_size": state.adapter.vocab_size, "max_model_len": state.adapter.max_model_len}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        _authorize(state, request)
        body = await _json(request)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise bad_request("prompt", "`prompt` must be a string")
        special = body.get("add_special_tokens", True) is not False
        encode = state.adapter.encode if special else state.adapter.encode_plain
        ids = await asyncio.to_thread(encode, text)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.adapter.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        _authorize(state, request)
        body = await _json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < state.adapter.vocab_size
                                                for t in ids):  # fmt: skip
            raise bad_request("tokens", "`tokens` must be a list of token ids in the vocabulary")
        return {"prompt": state.adapter.decode(ids)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(state, request, chat=True)


def _job(state: ServerState, body, chat: bool) -> handlers.Job:
    """The request checked (cheapest refusals first) and tokenized."""
    if not chat:
        guard.check_token_prompts(body, state.adapter.max_model_len)
    req = protocol.parse(body, chat)
    if req.model is not None and req.model != state.model_name:
        raise model_not_found(req.model)
    guard.check_prompt_chars(req, state.max_prompt_chars, state.adapter.max_model_len)
    return handlers.Job(state, req)


async def _generate(state: ServerState, request: Request, chat: bool):
    _authorize(state, request)
    body = await _json(request)
    # checking a body of many ids and tokenizing a long prompt take seconds: a thread, never the loop
    job = await asyncio.to_thread(_job, state, body, chat)
    req = job.req
    if req.stream:
        events = handlers.stream(state, job, _gone(request))
        headers = {"Cache-Control": "no-cache"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return await handlers.collect(state, job, _gone(request))


async def _json(request: Request):
    return await guard.read_json(request, request.app.state.mlakit.max_request_bytes)


async def _gone(request: Request) -> None:
    """Returns once the client has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
        raise bad_api_key()

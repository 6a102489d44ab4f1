"""The access log: one line per request as uvicorn prints it, with the time it took (to its last byte)."""

from __future__ import annotations

import http
import logging
import time

log = logging.getLogger("mlakit.serve.access")


class AccessLog:
    """ASGI middleware: `127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 OK 12.3 ms` at INFO on
    `mlakit.serve.access` once the response has ended (a stream: at its end or the client's leaving);
    paths in `skip` (e.g. /health, /metrics) are not logged."""

    def __init__(self, app, skip=()):
        self.app = app
        self.skip = frozenset(skip)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.skip:
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]

        async def sent(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            log.info("%s", line(scope, status[0], time.perf_counter() - start))


def line(scope, status: int, seconds: float) -> str:
    host, port = scope.get("client") or ("-", 0)
    path = scope["path"] + (
        "?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else ""
    )
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return (
        f'{host}:{port} - "{scope["method"]} {path} HTTP/{scope.get("http_version", "1.1")}" '
        f"{status} {phrase} {seconds * 1000:.1f} ms"
    )

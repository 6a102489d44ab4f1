"""The one thread that owns the engine: it adds, aborts and steps; handlers only enqueue and await.

Handlers put commands in an inbox and read `Update`s from an asyncio queue filled by this thread
(one `call_soon_threadsafe` per step for all requests of that event loop). No model work, and no
engine call at all, ever runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, wait
from dataclasses import dataclass

from mlakit.serve.errors import APIError, engine_refusal
from mlakit.serve.tracking import Track

log = logging.getLogger("mlakit.serve")


@dataclass
class Update:
    """What changed for one request in one step: the new pieces of each choice, or an error."""

    request_id: str
    deltas: list  # list[tracking.Delta]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False
    error: APIError | None = None
    prompt_logprobs: list | None = None  # the engine's RequestOutput.prompt_logprobs, when asked for


class EngineLoop:
    """`compute`: the `mlakit.engine.threads.ComputeThread` the engine was built on, to run the loop on;
    None: one of its own, started with the loop."""

    def __init__(self, adapter, metrics, idle_wait: float = 0.5, compute=None):
        self.adapter = adapter
        self.metrics = metrics
        self.inflight = 0  # requests between submit and their last update (event-loop side only)
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._tracks: dict[str, Track] = {}
        self._idle_wait = idle_wait
        self._stopping = False
        self._compute = compute
        self._running: Future | None = None  # the loop, as a task of the compute thread

    def start(self) -> None:
        from mlakit.engine.threads import ComputeThread

        if self._compute is None:
            self._compute = ComputeThread(name="mlakit-engine-loop")
        self._running = self._compute.submit(self._run)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._running is not None:
            wait([self._running], timeout)
            self._compute.close(timeout)

    def alive(self) -> bool:
        return self._running is not None and not self._running.done() and self.error is None

    async def generate(self, requests: list[tuple[str, list[int], object]], gone=None):
        """Yields every `Update` of these (request_id, prompt_ids, params) until all have finished.

        `gone`: an awaitable that returns when the client has left. Leaving early (the client gone, a
        cancelled task, a closed generator) aborts the unfinished requests, which frees their pages.
        """
        inbox: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        open_ids = {rid for rid, _, _ in requests}
        self.inflight += len(requests)
        watcher = _watch(gone, inbox)
        try:
            for rid, ids, params in requests:
                self._send(("add", rid, ids, params, loop, inbox, time.monotonic()))
            while open_ids:
                update = await inbox.get()
                if update is _GONE:
                    return
                if update.finished or update.error is not None:
                    open_ids.discard(update.request_id)
                    self.inflight -= 1
                yield update
        finally:
            if watcher is not None:
                watcher.cancel()
            self.inflight -= len(open_ids)
            for rid in open_ids:
                self._send(("abort", rid))

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            # this thread runs every step: its OpenMP team was sized and pinned when it started
            log.info("engine loop: %s", self._compute.line)
            while not self._stopping:
                self._drain()
                # aborted requests are reported (and forgotten) by the engine's next step, so it steps
                # while it has any, not only while a client waits
                if self.adapter.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._publish_stats()
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
        except BaseException as err:  # the loop is gone: /health says so, every waiter gets a 500
            log.exception("engine loop stopped")
            self.error = err
            self._fail_all(APIError(500, f"the engine loop stopped: {err!r}", code="engine_dead"))

    def _drain(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self._abort(command[1])

    def _add(self, rid, ids, params, loop, inbox, arrival) -> None:
        try:
            self.adapter.engine.add_request(rid, ids, params)
        except Exception as err:  # refused (400) or failed (500): this request only, the loop goes on
            if not isinstance(err, ValueError):
                log.exception("add_request of %s failed", rid)
            error = (
                engine_refusal(err)
                if isinstance(err, ValueError)
                else APIError(500, repr(err), code="engine_error")
            )
            _deliver(loop, [(inbox, Update(rid, [], error=error))])
            return
        track = Track(rid, loop, inbox, arrival, len(ids), self.metrics)
        track.hold = max((len(s) - 1 for s in getattr(params, "stop", None) or ()), default=0)
        self._tracks[rid] = track

    def _abort(self, rid: str) -> None:
        if self._tracks.pop(rid, None) is None:
            return
        try:
            self.adapter.engine.abort_request(rid)
        except ValueError:  # finished in the same step the client left
            pass
        except Exception:
            log.exception("abort_request of %s failed", rid)

    def _step(self) -> None:
        try:
            outputs = self.adapter.engine.step()
        except Exception as err:
            log.exception("engine step failed; failing its requests")
            self._fail_all(APIError(500, f"the engine step failed: {err!r}", code="engine_error"))
            return
        now = time.monotonic()
        batches = defaultdict(list)
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:  # aborted while its step ran
                continue
            update = Update(out.request_id, track.advance(out, now), len(out.prompt_token_ids or ()))
            update.cached_tokens = int(out.num_cached_tokens or 0)
            update.finished = bool(out.finished)
            update.prompt_logprobs = getattr(out, "prompt_logprobs", None)
            if update.finished:
                del self._tracks[out.request_id]
            batches[track.loop].append((track.inbox, update))
        # the gauges first: a client that reads /metrics on its first chunk sees this step's state
        self._publish_stats()
        for loop, items in batches.items():
            _deliver(loop, items)

    def _fail_all(self, error: APIError) -> None:
        batches = defaultdict(list)
        for rid, track in list(self._tracks.items()):
            try:
                self.adapter.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            batches[track.loop].append((track.inbox, Update(rid, [], error=error)))
        self._tracks.clear()
        for loop, items in batches.items():
            _deliver(loop, items)

    def _publish_stats(self) -> None:
        stats = self.adapter.stats()
        tracked = len(self._tracks)
        running = stats["running"]
        if running is None:
            running = min(tracked, self.adapter.max_num_seqs)
        waiting = stats["waiting"] if stats["waiting"] is not None else tracked - running
        self.metrics.set("running", running)
        self.metrics.set("waiting", waiting)
        if stats["kv_cache_usage"] is not None:
            self.metrics.set("kv_cache_usage", stats["kv_cache_usage"])


_GONE = object()


def _watch(gone, inbox: asyncio.Queue):
    if gone is None:
        return None

    async def wait():
        await gone
        inbox.put_nowait(_GONE)

    return asyncio.ensure_future(wait())


def _deliver(loop, items) -> None:
    def put_all():
        for inbox, update in items:
            inbox.put_nowait(update)

    with contextlib.suppress(RuntimeError):  # that event loop has closed: nobody is waiting
        loop.call_soon_threadsafe(put_all)

"""Per-request bookkeeping on the engine thread: cumulative outputs → deltas, and the metrics they feed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Delta:
    """The new part of one choice after one step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None  # one {token_id: logprob} per new token, when asked for
    finish_reason: str | None


class Track:
    def __init__(self, request_id: str, loop, inbox, arrival: float, prompt_tokens: int, metrics):
        self.request_id = request_id
        self.loop = loop
        self.inbox = inbox
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.metrics = metrics
        self.first_token: float | None = None
        self.last_token: float | None = None
        self._seen: dict[int, tuple[str, int]] = {}  # choice index -> (text sent, tokens sent)
        self._done: set[int] = set()  # choices whose finish_reason was sent: each ends once
        # text that may still turn out to begin a stop string is held back until it cannot (vLLM's rule)
        self.hold = 0

    def advance(self, out, now: float) -> list[Delta]:
        deltas = [d for c in out.outputs if (d := self._delta(c)) is not None]
        new_tokens = sum(len(d.token_ids) for d in deltas)
        if new_tokens:
            self._timing(out, now)
        self.metrics.add("generation", new_tokens)
        if out.finished:
            self.metrics.observe("e2e", now - self.arrival)
        return deltas

    def _delta(self, c) -> Delta | None:
        if c.index in self._done:
            return None
        sent_text, sent_tokens = self._seen.get(c.index, ("", 0))
        reason = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else None
        text = c.text or ""
        ready = text if reason is not None or not self.hold else text[: max(0, len(text) - self.hold)]
        new_text = ready[len(sent_text) :] if ready.startswith(sent_text) else ""
        ids = list(c.token_ids or ())
        new_ids = ids[sent_tokens:]
        logprobs = list(c.logprobs[sent_tokens:]) if c.logprobs else None
        if not new_text and not new_ids and reason is None:
            return None
        self._seen[c.index] = (sent_text + new_text, len(ids))
        if reason is not None:
            self._done.add(c.index)
        return Delta(c.index, new_text, new_ids, logprobs, reason)

    def _timing(self, out, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
            self.metrics.observe("ttft", now - self.arrival)
            self.metrics.add("prompt", self.prompt_tokens)
            self.metrics.add("prefix_queries", self.prompt_tokens)
            self.metrics.add("prefix_hits", int(out.num_cached_tokens or 0))
        else:
            self.metrics.observe("itl", now - self.last_token)
        self.last_token = now

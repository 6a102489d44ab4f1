"""One generation request: check and tokenize, hand to the engine loop, answer whole or as SSE."""

from __future__ import annotations

import json
import uuid

from mlakit.engine.limits import check_context
from mlakit.serve.errors import APIError, bad_request, engine_refusal, overloaded
from mlakit.serve.protocol import GenerateRequest
from mlakit.serve.responses import Choice, Shaper, Usage

# completions without max_tokens generate OpenAI's default of 16; chat fills the context (as OpenAI)
DEFAULT_COMPLETION_TOKENS = 16


class Job:
    """A checked request: its prompts as token ids, engine params, and how to shape the answer."""

    def __init__(self, state, req: GenerateRequest):
        self.req = req
        self.adapter = state.adapter
        self.n = req.sampling["n"]
        self.prompt_ids = [self._tokenize(p, i) for i, p in enumerate(req.prompts)]
        # echo: each choice starts with its prompt (a token-id prompt decoded, as vLLM)
        self.echo_texts = None
        if req.echo:
            self.echo_texts = [p if isinstance(p, str) else self.adapter.decode(p) for p in req.prompts]
        self.prompt_logprobs: dict[str, list] = {}
        params = self._params(state.adapter.max_model_len)
        base = uuid.uuid4().hex
        self.requests = [(f"{base}-{i}", ids, params) for i, ids in enumerate(self.prompt_ids)]
        self.index_of = {rid: i for i, (rid, _, _) in enumerate(self.requests)}
        self.shaper = Shaper(req.chat, state.model_name, self.adapter.token_text, req.logprobs)
        self._check_room(state)

    def _tokenize(self, prompt, i: int) -> list[int]:
        name = "messages" if self.req.chat else "prompt"
        if self.req.chat:
            ids = self.adapter.render_chat(prompt)
        else:
            ids = self.adapter.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad_request(name, f"`{name}` gives no tokens")
        vocab = self.adapter.vocab_size
        if max(ids) >= vocab:
            raise bad_request(name, f"`{name}` holds token id {max(ids)}; the vocabulary has {vocab}")
        try:  # refused as soon as one prompt is too long, naming it among several
            check_context(len(ids), None, self.adapter.max_model_len)
        except ValueError as err:
            where = f" (prompt {i})" if len(self.req.prompts) > 1 else ""
            raise bad_request(name, f"{err}{where}") from None
        return ids

    def _params(self, context: int):
        longest = max(len(ids) for ids in self.prompt_ids)
        name = "messages" if self.req.chat else "prompt"
        max_tokens = self.req.max_tokens
        try:  # the engine's rule and message (mlakit.engine.limits)
            check_context(longest, max_tokens, context, self.req.max_tokens_field)
        except ValueError as err:
            raise bad_request(name if longest >= context else self.req.max_tokens_field, str(err)) from None
        if max_tokens is None:
            room = context - longest
            max_tokens = room if self.req.chat else min(DEFAULT_COMPLETION_TOKENS, room)
        try:
            logprobs = self.req.logprobs
            # echo with logprobs: the prompt's too (vLLM's prompt_logprobs=logprobs)
            scored = {}
            if self.req.echo and (logprobs is not None or max_tokens == 0):
                # max_tokens 0 scores the prompt (nothing to sample); its entries show only with logprobs
                scored = {"prompt_logprobs": logprobs or 0}
            return self.adapter.make_params(
                **self.req.sampling, max_tokens=max_tokens, logprobs=logprobs, **scored
            )
        except ValueError as err:
            refusal = engine_refusal(err)
            if refusal.param == "max_tokens":
                refusal.param = self.req.max_tokens_field
            raise refusal from None

    def _check_room(self, state) -> None:
        loop = state.loop
        waiting = loop.inflight + len(self.requests) - self.adapter.max_num_seqs
        if waiting > state.max_waiting:
            raise overloaded(waiting, state.max_waiting)
        if not loop.alive():
            raise APIError(503, "the engine loop has stopped", code="engine_dead")

    def choice(self, rid: str, index: int) -> int:
        return self.index_of[rid] * self.n + index

    def note(self, update) -> None:
        if update.prompt_logprobs is not None:
            self.prompt_logprobs[update.request_id] = update.prompt_logprobs

    def echoed(self, rid: str, text: str, ids: list, logprobs) -> tuple[str, list, list]:
        """A choice's text, token ids and logprob entries with its prompt in front (the first entry None)."""
        i = self.index_of[rid]
        prompt = self.prompt_ids[i]
        entries = self.prompt_logprobs.get(rid) or [None] * len(prompt)
        return self.echo_texts[i] + text, prompt + list(ids), list(entries) + list(logprobs or [])


async def collect(state, job: Job, gone) -> dict:
    """The whole answer; the client leaving aborts the requests (`gone` returns)."""
    choices = [Choice() for _ in range(len(job.requests) * job.n)]
    usage = Usage(prompt=sum(len(ids) for ids in job.prompt_ids))
    cached = {}
    async for update in state.loop.generate(job.requests, gone):
        if update.error is not None:
            raise update.error
        cached[update.request_id] = update.cached_tokens
        job.note(update)
        for d in update.deltas:
            c = choices[job.choice(update.request_id, d.index)]
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs or []
            c.finish_reason = d.finish_reason or c.finish_reason
            usage.completion += len(d.token_ids)
    usage.cached = sum(cached.values())
    if job.echo_texts is not None:
        for rid in job.index_of:
            for j in range(job.n):
                c = choices[job.choice(rid, j)]
                c.text, c.token_ids, c.logprobs = job.echoed(rid, c.text, c.token_ids, c.logprobs)
    return job.shaper.response(choices, usage)


async def stream(state, job: Job, gone):
    """Server-sent events: `data: {chunk}` per choice per step, the usage chunk if asked, `[DONE]`."""
    shaper = job.shaper
    total = len(job.requests) * job.n
    if job.req.chat:
        for i in range(total):
            yield _event(shaper.chunk(i, "", [], None, None, 0, role=True))
    usage = Usage(prompt=sum(len(ids) for ids in job.prompt_ids))
    offsets, cached, sent = [0] * total, {}, [False] * total
    updates = state.loop.generate(job.requests, gone)
    try:
        async for update in updates:
            if update.error is not None:
                yield _event(update.error.body())
                break
            cached[update.request_id] = update.cached_tokens
            job.note(update)
            for d in update.deltas:
                i = job.choice(update.request_id, d.index)
                text, ids, lps = d.text, d.token_ids, d.logprobs
                if job.echo_texts is not None and not sent[i]:
                    text, ids, lps = job.echoed(update.request_id, text, ids, lps)  # the first chunk
                sent[i] = True
                yield _event(shaper.chunk(i, text, ids, lps, d.finish_reason, offsets[i]))
                offsets[i] += len(text)
                usage.completion += len(d.token_ids)
        else:
            if job.req.include_usage:
                usage.cached = sum(cached.values())
                yield _event(shaper.usage_chunk(usage))
        yield "data: [DONE]\n\n"
    finally:
        await updates.aclose()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

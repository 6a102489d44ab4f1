"""OpenAI's response and chunk shapes for completions and chat, built from engine deltas."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


@dataclass
class Choice:
    """One choice accumulated over the whole request (the non-streaming answer)."""

    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Usage:
    prompt: int = 0
    completion: int = 0
    cached: int = 0

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }


class Shaper:
    """Builds every JSON object of one response; `token_text` turns a token id into its text."""

    def __init__(self, chat: bool, model: str, token_text, top_logprobs: int | None):
        self.chat = chat
        self.id = new_id(chat)
        self.created = int(time.time())
        self.model = model
        self._token_text = token_text
        self._top = top_logprobs

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[Choice], usage: Usage) -> dict:
        body = self._head("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._choice(i, c) for i, c in enumerate(choices)]
        body["usage"] = usage.body()
        return body

    def _choice(self, index: int, c: Choice) -> dict:
        logprobs = self.logprobs(c.token_ids, c.logprobs, 0)
        head = {"index": index}
        if self.chat:
            head["message"] = {"role": "assistant", "content": c.text}
        else:
            head["text"] = c.text
        return {**head, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def chunk(self, index: int, text: str, ids, logprobs, finish, offset: int, role: bool = False) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        lp = None if role else self.logprobs(ids, logprobs, offset)
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        body["choices"] = [choice]
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.body()
        return body

    def logprobs(self, ids, entries, text_offset: int) -> dict | None:
        """OpenAI's logprobs object for these tokens (chat: `content`; completions: four lists)."""
        if self._top is None:
            return None
        entries = list(entries or [])
        if self.chat:
            return {"content": [self._chat_entry(t, e) for t, e in zip(ids, entries, strict=False)]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(ids, entries, strict=False):
            text = self._token_text(token)
            out["tokens"].append(text)
            if entry is None:  # an echoed prompt's first token: nothing predicts it (null, as OpenAI)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(_finite(entry.get(token)))
                top = _top(entry, self._top)
                out["top_logprobs"].append({self._token_text(t): _finite(v) for t, v in top})
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out

    def _chat_entry(self, token: int, entry: dict) -> dict:
        item = self._token_item(token, entry.get(token))
        item["top_logprobs"] = [self._token_item(t, v) for t, v in _top(entry, self._top)]
        return item

    def _token_item(self, token: int, logprob) -> dict:
        text = self._token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _top(entry: dict, k: int) -> list:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k] if k else []


def _finite(value) -> float:
    # JSON has no -inf; OpenAI's clients read -9999.0 as "impossible"
    value = float(value) if value is not None else -9999.0
    return max(value, -9999.0)

"""What cannot fit is refused before it costs anything: the body's size (413, from Content-Length
before reading, else while reading) and prompts with more characters than `max_model_len` tokens can
hold (400, before tokenizing), token-id prompts longer than the context (400, before any id is read).
Large bodies are parsed, and every request checked and tokenized, off the event loop.
"""

from __future__ import annotations

import asyncio
import json

from mlakit.engine.limits import check_context
from mlakit.serve.errors import bad_request, too_large

# the body limit's floor: room for batches of token-id prompts at any context
MIN_REQUEST_BYTES = 2**20
# bytes per character a JSON body may spend (UTF-8: up to 4)
BYTES_PER_CHAR = 4
# chars per token when the tokenizer does not list its vocabulary (the demo's longest token has 128)
FALLBACK_TOKEN_CHARS = 128
# bodies past this are parsed in a thread (json.loads of 1 MB takes milliseconds)
THREAD_JSON_BYTES = 2**18


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (byte-level entries
    have one character per byte, so they bound the decoded text), added tokens included."""
    vocab = None
    try:
        get = getattr(tokenizer, "get_vocab", None)
        vocab = get() if callable(get) else None
    except TypeError:
        vocab = None
    if not vocab:
        return FALLBACK_TOKEN_CHARS
    return max(1, max(len(t) for t in vocab))


def default_request_bytes(max_prompt_chars: int) -> int:
    """Room for one prompt as long as the context can hold, in any encoding (and at least 1 MiB)."""
    return max(MIN_REQUEST_BYTES, BYTES_PER_CHAR * max_prompt_chars)


async def read_json(request, limit: int):
    """The body parsed as JSON; 413 past `limit` bytes (checked before reading when the client says
    how long it is), 400 when it is not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return await asyncio.to_thread(json.loads, raw) if size > THREAD_JSON_BYTES else json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(None, f"the request body is not valid JSON ({err})", code="invalid_json") from None


def check_prompt_chars(req, max_chars: int, max_model_len: int) -> None:
    """Each prompt (a chat: its messages' text) must have at most `max_chars` characters: more cannot
    give fewer than `max_model_len` tokens."""
    name = "messages" if req.chat else "prompt"
    for p in req.prompts:
        chars = sum(len(m["content"]) for m in p) if req.chat else len(p) if isinstance(p, str) else 0
        if chars > max_chars:
            raise bad_request(
                name,
                f"`{name}` has {chars} characters: more than this model's context of {max_model_len} "
                f"tokens can hold (at most {max_chars // max_model_len} characters per token)",
            )


def check_token_prompts(body, max_model_len: int) -> None:
    """Token-id prompts (a list of ids, or a list of such lists) must be shorter than the context:
    measured by their lengths alone, before any id is checked (a few MB of ids would hold the loop)."""
    value = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(value, list) or not value:
        return
    prompts = [value] if not isinstance(value[0], list | str) else value
    for i, p in enumerate(prompts):
        if isinstance(p, list):
            try:
                check_context(len(p), None, max_model_len)
            except ValueError as err:
                where = "" if p is value else f" (prompt {i})"
                raise bad_request("prompt", f"{err}{where}") from None

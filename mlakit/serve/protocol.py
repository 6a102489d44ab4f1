"""Request bodies of /v1/completions and /v1/chat/completions → one checked `GenerateRequest`.

Every check raises OpenAI's 400 naming the field before anything reaches the engine. Checks that need
the tokenizer (the context length, token ids past the vocabulary) run in `app.py` after tokenizing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlakit.serve import fields
from mlakit.serve.errors import bad_request

# OpenAI fields mlakit does not implement, with the values that mean "off"
_UNSUPPORTED = {
    "logit_bias": {},
    "suffix": "",
    "echo": False,
    "tools": [],
    "tool_choice": "none",
    "response_format": ({"type": "text"},),
}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class GenerateRequest:
    """What a handler hands on: prompts (text, token ids or chat messages) and engine sampling fields."""

    chat: bool
    model: str | None
    prompts: list  # completions: str | list[int] each; chat: one list of messages
    max_tokens: int | None  # None: the default for the endpoint, filled once the prompt is tokenized
    max_tokens_field: str = "max_tokens"  # the name the client sent it under (errors name it)
    sampling: dict = field(default_factory=dict)  # SamplingParams keywords but max_tokens
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # how many top alternatives per token (chat: top_logprobs)
    echo: bool = False  # completions: the prompt comes first in each choice (and its logprobs)


def parse(body, chat: bool) -> GenerateRequest:
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {type(body).__name__}")
    # completions echo the prompt; chat keeps refusing `echo`
    fields.unsupported(body, {k: v for k, v in _UNSUPPORTED.items() if chat or k != "echo"})
    echo = False if chat else fields.boolean(body, "echo")
    best_of = fields.integer(body, "best_of", 1)
    n = fields.integer(body, "n", 1, fields.MAX_N, default=1)
    if best_of is not None and best_of != n:
        raise bad_request("best_of", f"`best_of` is not supported (got {best_of}); use `n`")
    stream = fields.boolean(body, "stream")
    if body.get("prompt_logprobs") is not None:
        # vLLM's extension field; this server returns prompt log-probabilities the OpenAI way only
        raise bad_request(
            "prompt_logprobs",
            "`prompt_logprobs` is not supported by this server: use `echo: true` with `logprobs` on "
            "/v1/completions (the prompt tokens' log-probabilities, OpenAI's format)",
        )
    return GenerateRequest(
        chat=chat,
        model=fields.string(body, "model"),
        prompts=[_messages(body)] if chat else _prompts(body),
        max_tokens=_max_tokens(body, echo),
        max_tokens_field=_max_tokens_field(body),
        sampling=_sampling(body, n),
        stream=stream,
        include_usage=_include_usage(body, stream),
        logprobs=_chat_logprobs(body) if chat else fields.logprobs(body, "logprobs"),
        echo=echo,
    )


def _max_tokens(body: dict, echo: bool) -> int | None:
    """At least 1; 0 only with `echo` (score the prompt, generate nothing: vLLM's rule), the engine's
    message (mlakit.engine.limits)."""
    return fields.max_tokens(body, _max_tokens_field(body), scoring=echo)


def _sampling(body: dict, n: int) -> dict:
    top_k = fields.integer(body, "top_k", -1, default=-1)
    stop_ids = body.get("stop_token_ids")
    return {
        "n": n,
        "temperature": fields.number(body, "temperature", 0.0, None, 1.0),
        "top_p": fields.number(body, "top_p", 0.0, 1.0, 1.0, low_open=True),
        "top_k": top_k,
        "min_p": fields.number(body, "min_p", 0.0, 1.0, 0.0),
        "seed": fields.integer(body, "seed", -(2**63), 2**63 - 1 - fields.MAX_N),
        "stop": fields.stop_strings(body),
        "stop_token_ids": None if stop_ids is None else fields.token_ids(stop_ids, "stop_token_ids"),
        "ignore_eos": fields.boolean(body, "ignore_eos"),
        **fields.vllm_options(body),
    }


def _max_tokens_field(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options", "`stream_options` is only allowed when `stream` is true")
    if not isinstance(options, dict):
        raise bad_request(
            "stream_options",
            f"`stream_options` must be an object, got {fields.shown(options)}",
        )
    return fields.boolean(options, "include_usage")


def _chat_logprobs(body: dict) -> int | None:
    wanted = fields.boolean(body, "logprobs")
    top = fields.logprobs(body, "top_logprobs")
    if top is not None and not wanted:
        raise bad_request("top_logprobs", "`top_logprobs` needs `logprobs` set to true")
    return (top or 0) if wanted else None


def _prompts(body: dict) -> list:
    """A string, a list of token ids, a list of strings or a list of token-id lists → list of prompts."""
    value = body.get("prompt")
    if value is None:
        raise bad_request("prompt", "`prompt` is required", code="missing_required_parameter")
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        items = [fields.token_ids(value, "prompt")]
    elif isinstance(value, list) and value:
        items = [p if isinstance(p, str) else fields.token_ids(p, "prompt") for p in value]
    else:
        raise bad_request(
            "prompt",
            f"`prompt` must be a string, token ids or a list of them, got {fields.shown(value)}",
        )
    if any(isinstance(p, str) and not p for p in items):
        raise bad_request("prompt", "`prompt` is empty")
    return items


def _messages(body: dict) -> list[dict]:
    value = body.get("messages")
    if value is None:
        raise bad_request("messages", "`messages` is required", code="missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad_request("messages", f"`messages` must be a non-empty list, got {fields.shown(value)}")
    return [_message(m, i) for i, m in enumerate(value)]


def _message(message, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise bad_request(
            where,
            f"`{where}` must be an object with a `role` in {_ROLES}, got {fields.shown(message)}",
        )
    content = message.get("content")
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
            raise bad_request(f"{where}.content", "only text content parts are supported")
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad_request(
            f"{where}.content",
            f"`{where}.content` must be a string, got {fields.shown(content)}",
        )
    return {"role": message["role"], "content": content}

"""One check per kind of request field; each raises OpenAI's 400 naming the field (`param`)."""

from __future__ import annotations

import math

from mlakit.engine.limits import check_logprobs, check_max_tokens
from mlakit.serve.errors import bad_request

MAX_N = 128
# vLLM's sampling options beyond OpenAI's, handed to SamplingParams as sent (it checks them: its
# message is the 400's); only those a request sets, so an engine without them still serves the rest
VLLM_OPTIONS = ("min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "include_stop_str_in_output", "skip_special_tokens")  # fmt: skip


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# an error message shows at most this much of the value it refuses (a bad id in a 200K-id list)
SHOWN_CHARS = 200


def shown(value) -> str:
    """repr(value), cut to SHOWN_CHARS with what was left out said."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(value):,} items, " if isinstance(value, list | dict | str) else ""
    return f"{text[:SHOWN_CHARS]}... ({size}{len(text):,} characters)"


def _is_number(value) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


def integer(body: dict, name: str, low: int | None = None, high: int | None = None, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad_request(name, f"`{name}` must be an integer, got {shown(value)}", code="invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"from {low} to {high}"
        raise bad_request(name, f"`{name}` must be {bounds}, got {value}")
    return value


def number(body: dict, name: str, low: float, high: float | None, default, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise bad_request(name, f"`{name}` must be a finite number, got {shown(value)}", code="invalid_type")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        left = "(" if low_open else "["
        right = "inf)" if high is None else f"{high}]"
        raise bad_request(name, f"`{name}` must be in {left}{low}, {right}, got {value}")
    return float(value)


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"`{name}` must be a boolean, got {shown(value)}", code="invalid_type")
    return value


def string(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_request(name, f"`{name}` must be a string, got {shown(value)}", code="invalid_type")
    return value


def stop_strings(body: dict) -> list[str] | None:
    value = body.get("stop")
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_request("stop", f"`stop` must be a non-empty string or a list of them, got {shown(value)}")
    return list(items) or None


def token_ids(value, name: str) -> list[int]:
    """A non-empty list of non-negative ints (the vocabulary bound is checked by the caller)."""
    if not isinstance(value, list) or not value or not all(_is_int(t) and t >= 0 for t in value):
        raise bad_request(
            name,
            f"`{name}` must be a non-empty list of token ids (ints >= 0), got {shown(value)}",
        )
    return value


def unsupported(body: dict, defaults: dict) -> None:
    """A field mlakit does not implement, set to something other than its neutral value, is a 400."""
    for name, neutral in defaults.items():
        value = body.get(name)
        if value is not None and value != neutral and not (isinstance(neutral, tuple) and value in neutral):
            raise bad_request(name, f"`{name}` is not supported by this server (got {shown(value)})")


def max_tokens(body: dict, name: str, scoring: bool = False):
    """`max_tokens` / `max_completion_tokens`: the shared rule (mlakit.engine.limits), its message."""
    return _shared(body, name, lambda v: check_max_tokens(v, scoring, name))


def logprobs(body: dict, name: str):
    """`logprobs` (completions) or `top_logprobs` (chat): 0..MAX_LOGPROBS, the shared rule."""
    return _shared(body, name, lambda v: check_logprobs(v, name))


def _shared(body: dict, name: str, check):
    value = body.get(name)
    if value is None:
        return None
    try:
        check(value)
    except ValueError as err:
        code = "invalid_type" if not _is_int(value) else "invalid_value"
        raise bad_request(name, str(err), code=code) from None
    return value


def vllm_options(body: dict) -> dict:
    return {name: body[name] for name in VLLM_OPTIONS if body.get(name) is not None}

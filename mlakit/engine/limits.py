"""The limits a request must meet, one function each, shared by the API, the CLI and the server.

`SamplingParams` checks what it can alone (`max_tokens`, `logprobs`); `LLMEngine.add_request`, the CLI
and the server check the prompt and `max_tokens` against the model's context with `check_context`, so
the same request gets the same message everywhere.
"""

from __future__ import annotations

from mlakit.cache.quant import FP8_GROUP

# vLLM's default max_logprobs: the most top alternatives per token (the chosen token comes on top)
MAX_LOGPROBS = 20


def check_max_tokens(value, scoring: bool = False, name: str = "max_tokens") -> None:
    """An integer >= 1, or None (the rest of the context); 0 only when the prompt is scored
    (`prompt_logprobs`): then nothing is generated."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < (0 if scoring else 1):
        why = "" if scoring else " (0 only to score the prompt: prompt_logprobs, or echo on /v1/completions)"
        raise ValueError(f"{name} must be at least {0 if scoring else 1}{why}, got {value}")


def check_logprobs(value, name: str = "logprobs") -> None:
    """None or 0..MAX_LOGPROBS top alternatives."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be from 0 to {MAX_LOGPROBS} (max_logprobs), got {value}")


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int, name: str = "max_tokens"):
    """The prompt must leave room for one token, and prompt + max_tokens must fit `max_model_len`
    (vLLM's and OpenAI's rule: refused, never cut short silently)."""
    if prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {prompt_tokens} tokens; this model's maximum context length is {max_model_len} "
            "tokens (max_model_len), prompt and output together"
        )
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"{name} {max_tokens} is too many: this model's maximum context length is {max_model_len} "
            f"tokens and the prompt has {prompt_tokens} (at most {max_model_len - prompt_tokens} more)"
        )


def check_cache_dtype(cache_dtype, kv_lora_rank: int) -> None:
    """fp8 pages need the latent width to be whole groups of FP8_GROUP."""
    if cache_dtype == "fp8" and kv_lora_rank % FP8_GROUP:
        raise ValueError(
            f"cache_dtype='fp8' needs kv_lora_rank divisible by {FP8_GROUP} (one fp32 scale per {FP8_GROUP} "
            f"latent values, FlashMLA's page format); this model's kv_lora_rank is {kv_lora_rank}: "
            "use cache_dtype='int8' or None"
        )

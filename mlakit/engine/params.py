"""SamplingParams, RequestOutput, CompletionOutput: vLLM's names and fields, checked at the boundary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# temperatures below this sample greedily (vLLM's epsilon): dividing logits by less overflows to NaN
_SAMPLING_EPS = 1e-5
# vLLM's default max_logprobs: the most top alternatives per token (the actual token comes on top)
MAX_PROMPT_LOGPROBS = 20
# a request's generator seed (torch.Generator.manual_seed takes 64 bits; seed + i for its n completions)
SEED_RANGE = (-(2**63), 2**64 - 1)


def _int(name: str, value, low: int | None = None, none: bool = False):
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    """How one request samples. `temperature` below 1e-5 (0 included): greedy (vLLM's epsilon; a smaller
    one would divide the logits into NaN). `top_k` 0 or -1: off. `seed`: the request's
    own generator (the same tokens whatever else is in the batch). `stop`: strings cut from the text;
    `stop_token_ids`: tokens that end it (kept in `token_ids`, not in `text`). `logprobs=k`: the chosen
    token's and the top-k log-probabilities of every generated token. `prompt_logprobs=k` (0 to 20): the
    same for every prompt token but the first (`RequestOutput.prompt_logprobs`; 0: the actual token only);
    with `max_tokens=0` the prompt is scored and nothing generated."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        self.n = _int("n", self.n, 1)
        self.max_tokens = _int("max_tokens", self.max_tokens, 0)
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k, -1)
        self.min_p = _float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.seed = _int("seed", self.seed, none=True)
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1] - (self.n - 1):
            raise ValueError(
                f"seed must fit a 64-bit generator seed ({SEED_RANGE[0]}..{SEED_RANGE[1]} for seed + n - 1), "
                f"got {self.seed}"
            )
        self.stop = _stop_list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = [_int("stop_token_ids", t, 0) for t in self.stop_token_ids]
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        self.logprobs = _int("logprobs", self.logprobs, 0, none=True)
        self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, 0, none=True)
        if self.prompt_logprobs is not None and self.prompt_logprobs > MAX_PROMPT_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be at most {MAX_PROMPT_LOGPROBS} (vLLM's max_logprobs), "
                f"got {self.prompt_logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stop)


@dataclass
class CompletionOutput:
    """One of a request's `n` completions; `text` and `token_ids` are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request as it stands after a step; `num_cached_tokens`: prompt tokens read from the prefix cache
    (whole pages); `prompt_logprobs` (when asked): one entry per prompt token, the first None, each a
    dict token id -> log-probability of the actual token and the top-k (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None

"""SamplingParams, RequestOutput, CompletionOutput: vLLM's names and fields, checked at the boundary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from mlakit.engine.limits import check_logprobs, check_max_tokens

# temperatures below this sample greedily (vLLM's epsilon): dividing logits by less overflows to NaN
_SAMPLING_EPS = 1e-5
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
    token's and the top-k log-probabilities of every generated token (0 to 20, vLLM's max_logprobs).
    `prompt_logprobs=k` (0 to 20): the same for every prompt token but the first
    (`RequestOutput.prompt_logprobs`; 0: the actual token only).
    `max_tokens`: at least 1 (0 only with `prompt_logprobs`: the prompt is scored, nothing generated),
    None: the rest of the context; the engine refuses a prompt + `max_tokens` past `max_model_len`
    (mlakit.engine.limits). vLLM's meanings:
    `min_tokens` (EOS and stop tokens masked, stop strings not checked, until that many are generated),
    `presence_penalty` / `frequency_penalty` (-2..2, OpenAI's: subtracted per generated token present /
    per occurrence), `repetition_penalty` (> 0, 1 off; over prompt and generated tokens: positive
    logits divided by it, negative ones multiplied), `include_stop_str_in_output` (the stop string or
    stop token's text kept), `skip_special_tokens` (special tokens left out of `text`). Unknown keywords
    are a ValueError naming them."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __new__(cls, *args, **kwargs):
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            accepted = ", ".join(f.name for f in fields(cls))
            raise ValueError(
                f"SamplingParams got unknown keyword(s) {', '.join(unknown)}; accepted: {accepted}"
            )
        return super().__new__(cls)

    def __post_init__(self):
        self.n = _int("n", self.n, 1)
        check_max_tokens(self.max_tokens, scoring=self.prompt_logprobs is not None)
        self._check_options()
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
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs, "prompt_logprobs")

    def _check_options(self) -> None:
        """vLLM's options beyond OpenAI's sampling fields."""
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

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

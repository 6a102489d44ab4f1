"""Request and Sequence: tensor-free state of what a client asked for and how far each completion got."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlakit.engine.params import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    """One completion: its tokens (prompt + generated), how many are in the cache, its slot."""

    request: Request
    index: int  # which of the request's n completions
    tokens: list[int]  # prompt then generated ids
    prompt_len: int
    status: str = WAITING
    computed: int = 0  # tokens in the cache (the slot's length)
    slot: int | None = None
    hashes: list[int] = field(default_factory=list)  # chain hashes of its whole pages, as far as known
    registered: int = 0  # whole pages already in the prefix index
    shared: list[int] = field(default_factory=list)  # pages held for it before admission (a fork)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    detok: object = None  # incremental detokenizer state
    generator: object = None  # torch.Generator of a seeded request
    cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission (-1: not yet)
    admitted: int = -1  # admission order (preemption takes the latest)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    seqs: list[Sequence] = field(default_factory=list)
    pending: list[Sequence] = field(default_factory=list)  # siblings waiting for the prompt to be computed
    num_cached_tokens: int = 0
    reported_finished: bool = False
    # params.prompt_logprobs: one entry per prompt token (the first None), filled as prefill goes
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def scoring(self) -> bool:
        """Prompt log-probabilities asked for and not all computed yet."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) > 1 and lps[-1] is None

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.finished for s in self.seqs)

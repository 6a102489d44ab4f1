"""What the engine reports (outputs, stats) and checks of its keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass

from mlakit.engine import load
from mlakit.engine.params import CompletionOutput, RequestOutput
from mlakit.engine.request import Request


@dataclass
class EngineStats:
    """What a server exports as metrics (vLLM's names)."""

    num_running: int  # requests with a completion in the running queue
    num_waiting: int  # unfinished requests with none running
    kv_cache_usage: float  # fraction of pages held by requests (pages only the prefix cache keeps: free)
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (each admission)
    prefix_cache_hits: int  # of which found
    prompt_tokens: int  # prompt tokens of admitted requests (first admission)
    generation_tokens: int  # tokens sampled
    num_preemptions: int
    # modules whose bf16 GEMMs run on oneDNN-prepacked weights (mlakit/engine/packed.py; 0: plain GEMMs)
    packed_modules: int = 0
    # the last step's mode, "compiled" or "eager" (before any step: compiled if a bucket is), the seconds
    # the warm-up compiled and timed for, the token counts that run compiled ("2-16", ...) and the steps
    # that ran compiled since the warm-up
    step_mode: str = "eager"
    compile_seconds: float = 0.0
    compiled_buckets: tuple[str, ...] = ()
    compiled_steps: int = 0


def output_of(req: Request, done: bool) -> RequestOutput:
    outs = [
        CompletionOutput(
            s.index,
            s.text,
            list(s.output_ids),
            s.finish_reason,
            None if s.logprobs is None else list(s.logprobs),
            s.stop_reason,
        )
        for s in req.seqs
    ]
    lps = None if req.prompt_logprobs is None else list(req.prompt_logprobs)
    return RequestOutput(
        req.request_id, req.prompt, list(req.prompt_ids), outs, req.num_cached_tokens, done, lps
    )


def eos_of(tokenizer, config) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos


def check_args(cache_dtype, block_size, max_num_seqs, max_num_batched_tokens, prefix, seed) -> None:
    if cache_dtype not in load.CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be None, 'fp8' or 'int8', got {cache_dtype!r}")
    for name, v in (
        ("block_size", block_size),
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not isinstance(prefix, bool):
        raise ValueError(f"enable_prefix_caching must be a boolean, got {prefix!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")

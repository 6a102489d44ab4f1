"""mlakit.engine: a generation engine for MLA models (continuous batching over one paged latent cache).

    from mlakit.engine import LLM, SamplingParams
    llm = LLM("demo")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)

`LLM(model, *, tokenizer=None, dtype=None, device=None, cache_dtype=None, block_size=64, num_blocks=None,
cache_memory=None, max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=True, seed=0)`;
`LLM.generate(prompts, sampling_params)` and `LLM.chat(messages, sampling_params)` (the server's chat
rendering); `SamplingParams` takes vLLM's names (penalties, `min_tokens`, ...) and refuses any other by
name; the limits every entry point shares are in `mlakit.engine.limits`.
`LLM.llm_engine` is the `LLMEngine` a server drives:

- `add_request(request_id, prompt, params)`, `abort_request(request_id)`, `step() -> list[RequestOutput]`
  (the requests that changed in this step; a finished one is reported once, then forgotten),
  `has_unfinished_requests()`;
- `tokenizer`: the model's tokenizer (transformers; None when a model instance came without one);
- `max_model_len`: the most tokens (prompt + output) one sequence can hold (the model's positions and
  the cache's pages); a longer prompt is refused by `add_request`;
- `eos_token_id`;
- `stats` (`EngineStats`): `num_running`, `num_waiting` (requests), `kv_cache_usage` (fraction of pages
  requests hold; pages only the prefix cache keeps count as free), `prefix_cache_queries` and
  `prefix_cache_hits` (prompt tokens looked up / found, cumulative), `prompt_tokens`,
  `generation_tokens` (cumulative), `num_preemptions`;
- `check()`: the page and reference-count invariants (raises AssertionError).

docs/engine.md describes the step, the scheduler, the prefix cache and preemption.
"""

from mlakit.engine.engine import EngineStats, LLMEngine
from mlakit.engine.llm import LLM
from mlakit.engine.params import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]

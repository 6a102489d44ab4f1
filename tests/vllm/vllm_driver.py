"""Run vLLM on a model folder for the tests: `python vllm_driver.py SPEC.json OUT.json`.

A separate process per call (vLLM resolves its platform once per process). SPEC holds "model" and
"runs": each run builds one `vllm.LLM` (in this process unless tp > 1), sends its "batches" of token-id
prompts one generate() call after the other (a later batch finds the earlier ones' prefixes cached),
and records per request: the greedy tokens, their logprobs, the prompt logprobs, cached tokens and
TTFT; per run: vLLM's prefix-cache counters, the attention implementations the model holds, and
mlakit's path counts. A run that vLLM refuses records the error text instead.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def _layers(model):
    names = sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")})
    try:
        from mlakit.vllm.backend import MlakitMLAImpl

        counts, worst = dict(MlakitMLAImpl.counts), dict(MlakitMLAImpl.worst)
    except ImportError:
        counts, worst = {}, {}
    return {"impls": names, "counts": counts, "worst": worst}


def _metric(metrics, name: str) -> float:
    return float(sum(getattr(m, "value", 0) for m in metrics if m.name == name))


def run(model: str, spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = dict(
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 1024),
        max_num_batched_tokens=spec.get("budget", 2048),
        max_num_seqs=spec.get("max_num_seqs", 16),
        enable_chunked_prefill=spec.get("chunked", False),
        enable_prefix_caching=spec.get("prefix", False),
        tensor_parallel_size=spec.get("tp", 1),
        disable_log_stats=False,
        seed=0,
    )
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("backend"):
        kwargs["attention_config"] = {"backend": spec["backend"]}
    try:  # per-run path counts (the class keeps them per process)
        from mlakit.vllm.backend import MlakitMLAImpl

        MlakitMLAImpl.counts.update(dict.fromkeys(MlakitMLAImpl.counts, 0))
        MlakitMLAImpl.worst.clear()
    except ImportError:
        pass
    t0 = time.perf_counter()
    try:
        llm = LLM(model, **kwargs)
    except Exception as e:  # a refusal is a result
        return {"error": f"{type(e).__name__}: {e}"}
    load_s = time.perf_counter() - t0
    batches = []
    for i, batch in enumerate(spec["batches"]):
        # vLLM computes a request with prompt logprobs in full (no prefix-cache hit): later batches,
        # which are there to hit the cache, ask for none unless told
        want = spec.get("prompt_logprobs", [True])[min(i, len(spec.get("prompt_logprobs", [True])) - 1)]
        params = SamplingParams(
            max_tokens=spec.get("max_tokens", 8),
            temperature=0,
            logprobs=0,
            prompt_logprobs=0 if want else None,
            detokenize=False,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        rows = []
        for prompt, o in zip(batch, outs, strict=True):
            c = o.outputs[0]
            rows.append(
                {
                    "tokens": list(c.token_ids),
                    "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)],
                    "prompt_logprobs": [
                        d[t].logprob for d, t in zip(o.prompt_logprobs[1:], prompt[1:], strict=True)
                    ]
                    if o.prompt_logprobs
                    else [],
                    "cached": o.num_cached_tokens or 0,
                    "ttft_s": getattr(o.metrics, "first_token_latency", None),
                }
            )
        batches.append(rows)
    metrics = llm.get_metrics()
    # by module reference, not __main__'s: -tp 2 pickles it to the worker processes
    import vllm_driver

    layers = llm.apply_model(vllm_driver._layers)
    out = {
        "batches": batches,
        "load_s": load_s,
        "prefix_cache_hits": _metric(metrics, "vllm:prefix_cache_hits"),
        "prefix_cache_queries": _metric(metrics, "vllm:prefix_cache_queries"),
        "layers": layers,
    }
    del llm
    gc.collect()
    return out


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    results = {name: run(spec["model"], r) for name, r in spec["runs"].items()}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

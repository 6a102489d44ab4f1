"""mlakit generate: complete one prompt with the engine (`mlakit.engine.LLM`) and print the text."""

from __future__ import annotations

import sys
import time

from mlakit.commands import emit_json
from mlakit.commands.args import add_step_mode


def register(sub) -> None:
    p = sub.add_parser(
        "generate", help="complete a prompt with the generation engine (demo model or a folder)"
    )
    p.add_argument("--model", default="demo", help="'demo' (built-in random DeepSeek-V3-shaped) or a folder")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="completions of the prompt")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default=None, help="bf16 | fp32 (default: bf16 where native, else fp32)")
    p.add_argument("--cache-dtype", default=None, choices=["fp8", "int8"])
    p.add_argument(
        "--cache-memory", default=None, help="cache size, e.g. 1GiB (default: a share of free memory)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="compute threads (default: every core this process may use)"
    )
    add_step_mode(p)
    p.add_argument("--json", action="store_true", help="print the RequestOutput as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from mlakit.engine import LLM
    from mlakit.engine.threads import check_threads, enter_compute_thread, plan_threads

    start = time.perf_counter()
    threads = check_threads(args.threads)
    params, tokenizer = check(args)
    plan_threads(threads)
    pinning = enter_compute_thread()  # this thread runs the steps
    print(f"mlakit generate: loading {args.model} ({pinning}) ...", file=sys.stderr)
    llm = LLM(
        args.model,
        tokenizer=tokenizer,
        dtype=args.dtype,
        cache_dtype=args.cache_dtype,
        cache_memory=args.cache_memory,
        enforce_eager=args.enforce_eager,
    )
    loaded = time.perf_counter()
    (out,) = llm.generate(args.prompt, params, use_tqdm=True)
    took = time.perf_counter() - loaded
    tokens = sum(len(c.token_ids) for c in out.outputs)
    if args.json:
        emit_json(
            {
                "prompt": out.prompt,
                "prompt_tokens": len(out.prompt_token_ids),
                "outputs": [
                    {
                        "index": c.index,
                        "text": c.text,
                        "token_ids": c.token_ids,
                        "finish_reason": c.finish_reason,
                    }
                    for c in out.outputs
                ],
                "load_s": loaded - start,
                "generate_s": took,
            }
        )
    else:
        for c in out.outputs:
            print(c.text)
    print(
        f"mlakit generate: {len(out.prompt_token_ids)} prompt tokens, {tokens} generated in {took:.2f} s "
        f"(load {loaded - start:.1f} s)",
        file=sys.stderr,
    )
    return 0


def check(args):
    """Every argument checked before the model loads (seconds to minutes): the sampling flags, the
    prompt, the dtypes and sizes, the model's family and cache format, and prompt + --max-tokens against
    the model's positions (the engine checks its cache's limit again, with the same message).
    Returns (SamplingParams, the tokenizer, loaded once)."""
    from mlakit.engine import SamplingParams, load
    from mlakit.engine.limits import check_cache_dtype, check_context

    if not args.prompt:
        raise ValueError("--prompt is empty; expected some text")
    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    load.resolve_dtype(args.dtype, None)
    if args.cache_memory is not None:
        load.parse_bytes(args.cache_memory)
    config, tokenizer = _config_and_tokenizer(args.model)
    from mlakit.config import MLAConfig

    check_cache_dtype(args.cache_dtype, MLAConfig.from_hf(config).kv_lora_rank)
    ids = tokenizer(args.prompt)["input_ids"]
    if not ids:
        raise ValueError("--prompt gives no tokens; expected some text")
    check_context(len(ids), params.max_tokens, getattr(config, "max_position_embeddings", None) or 2**20)
    return params, tokenizer


def _config_and_tokenizer(model: str):
    """The model's transformers config and tokenizer, read from local files (no weights)."""
    import os

    if model == "demo":
        from transformers import DeepseekV3Config

        from mlakit.engine.demo import DEMO, demo_tokenizer

        return DeepseekV3Config(**DEMO), demo_tokenizer()
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"--model {model!r} is not 'demo' nor a folder with a config.json")
    from transformers import AutoConfig, AutoTokenizer

    from mlakit.engine.load import TOKENIZER_FILES, has_tokenizer_files
    from mlakit.hf.families import FAMILIES

    config = AutoConfig.from_pretrained(model, local_files_only=True)
    if getattr(config, "model_type", None) not in {f.model_type for f in FAMILIES.values()}:
        raise ValueError(
            f"--model {model!r}: model_type {config.model_type!r} is not an MLA family mlakit knows"
        )
    if not has_tokenizer_files(model):
        raise ValueError(f"--model {model!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return config, AutoTokenizer.from_pretrained(model, local_files_only=True)

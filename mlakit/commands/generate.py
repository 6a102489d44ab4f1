"""mlakit generate: complete one prompt with the engine (`mlakit.engine.LLM`) and print the text."""

from __future__ import annotations

import sys
import time

from mlakit.commands import emit_json


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
    p.add_argument("--json", action="store_true", help="print the RequestOutput as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from mlakit.engine import LLM, SamplingParams

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
    start = time.perf_counter()
    print(f"mlakit generate: loading {args.model} ...", file=sys.stderr)
    llm = LLM(args.model, dtype=args.dtype, cache_dtype=args.cache_dtype, cache_memory=args.cache_memory)
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

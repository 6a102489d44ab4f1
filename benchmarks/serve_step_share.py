"""What the server costs beside the engine: `mlakit serve`'s app in this process on the demo model, N
streaming `openai` clients at once, and the engine's step time against the wall time they took.

    PYTHONPATH=. python benchmarks/serve_step_share.py --concurrency 32 --max-num-batched-tokens 8192

All prompts are sent together as token ids, so the engine sees the same batch as offline; the share of
wall time outside `step()` is everything the server adds (HTTP, JSON, SSE, the loop hand-off).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from support.serve import ThreadServer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import openai

    from mlakit.engine import LLMEngine
    from mlakit.serve.adapter import EngineAdapter
    from mlakit.serve.app import build_app

    engine = LLMEngine("demo", max_num_seqs=args.concurrency, cache_memory="1GiB",
                       max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    steps = []
    step = engine.step

    def timed():
        start = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - start)
        return out

    engine.step = timed
    server = ThreadServer(build_app(EngineAdapter(engine), "demo"))
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(args.input_len)] for _ in range(args.concurrency)]

    async def run() -> float:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=3600)

        async def one(prompt):
            body = {"ignore_eos": True}
            stream = await client.completions.create(model="demo", prompt=prompt, max_tokens=args.output_len,
                                                     temperature=0, stream=True, extra_body=body)  # fmt: skip
            return len([c async for c in stream])

        start = time.perf_counter()
        await asyncio.gather(*(one(q) for q in prompts))
        return time.perf_counter() - start

    try:
        wall = asyncio.run(run())
    finally:
        server.close()
    tokens = args.concurrency * args.output_len
    busy = sum(steps)
    load = os.getloadavg()[0]
    shape = f"{args.concurrency} streams x {args.input_len}+{args.output_len} tokens"
    print(f"{shape}, {args.threads} thread(s), "
          f"load {load:.1f}: wall {wall:.1f} s, engine steps {busy:.1f} s ({len(steps)} steps), "
          f"{tokens / wall:.1f} output tok/s served vs {tokens / busy:.1f} in the steps alone; "
          f"outside the engine: {1 - busy / wall:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()

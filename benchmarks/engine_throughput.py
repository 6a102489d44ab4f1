"""The engine on the demo model against transformers' generate(): output tokens/s, time to first token
with a shared prefix, how many 4K-token sequences fit in 2 GiB, the host's share of a step, the decode
TPOT while 2,048-token prompts arrive (`arrivals`) and the short workload at concurrency 8 and 32 (`short`).

    python benchmarks/engine_throughput.py            # full size (64 requests, 512 +- 256, 128 out)
    python benchmarks/engine_throughput.py --quick    # small sizes that finish in minutes on a CPU
    python benchmarks/engine_throughput.py --parts arrivals,short --quick --threads 1

Uses only the engine's public API (LLM, LLMEngine.add_request/step), so it runs A/B against an older tree:
`PYTHONPATH=OLD_TREE python benchmarks/engine_throughput.py ...`.

Prints the machine, the dtype (bf16 where the CPU has native bf16 matmuls, else fp32) and every figure;
`--json FILE` saves them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time

import torch

from mlakit.engine import LLM, LLMEngine, SamplingParams
from mlakit.engine.demo import DEMO, demo_model
from mlakit.engine.load import native_16bit


def machine() -> dict:
    cpu = platform.processor()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line)
    except (OSError, StopIteration):
        pass
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(x for x in f if x.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "threads": torch.get_num_threads(),
        "load": os.getloadavg(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def workload(n: int, mean: int, spread: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1000, 120000) for _ in range(rng.randint(mean - spread, mean + spread))]
        for _ in range(n)
    ]


def engine_throughput(llm, prompts, out_len: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    eng = llm.llm_engine
    eng.timings = dict.fromkeys(eng.timings, 0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=True)
    took = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "seconds": took,
        "output_tokens": tokens,
        "tokens_per_s": tokens / took,
        "timings": dict(eng.timings),
    }


def hf_throughput(model, prompts, out_len: int, batch: int) -> dict:
    pad = DEMO["eos_token_id"]
    start, tokens = time.perf_counter(), 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), pad)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, p in enumerate(chunk):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
                pad_token_id=pad,
            )
            tokens += (out.shape[1] - width) * len(chunk)
    took = time.perf_counter() - start
    return {"batch": batch, "seconds": took, "output_tokens": tokens, "tokens_per_s": tokens / took}


def hf_continuous(model, prompts, out_len: int) -> dict:
    """transformers' own continuous batching (generate_batch), if it runs this model."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=out_len, do_sample=False, eos_token_id=-1, pad_token_id=DEMO["eos_token_id"]
    )
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            res = model.generate_batch(inputs=prompts, generation_config=cfg)
    except Exception as e:  # report what happens, whatever it is
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    took = time.perf_counter() - start
    tokens = sum(len(getattr(r, "generated_tokens", []) or []) for r in res.values())
    out = {"seconds": took, "output_tokens": tokens, "tokens_per_s": tokens / took}
    if tokens == 0:
        out["error"] = "returned no tokens"
    return out


def ttft(llm_kw, prefix: int, suffix: int, count: int, caching: bool) -> dict:
    """Mean and median time to first token of `count` requests sharing a `prefix`-token prefix (a system
    prompt): one request with the prefix runs first (not timed), then the `count` are submitted at once
    (a fresh engine each time; without prefix caching the first request helps nothing)."""
    llm = LLM("demo", enable_prefix_caching=caching, **llm_kw)
    eng = llm.llm_engine
    common = workload(1, prefix, 0, seed=1)[0]
    tails = workload(count + 1, suffix, 0, seed=2)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([common + tails[-1]], one, use_tqdm=False)
    start, first = time.perf_counter(), {}
    for i, t in enumerate(tails[:count]):
        eng.add_request(f"t{i}", common + t, one)
    while eng.has_unfinished_requests():
        for out in eng.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
    times = sorted(first.values())
    return {
        "prefix_caching": caching,
        "mean_s": sum(times) / len(times),
        "median_s": times[len(times) // 2],
        "cached_tokens": eng.stats.prefix_cache_hits,
    }


def host_share(llm_kw, rows: int = 64, out_len: int = 16) -> dict:
    """Host time (schedule, plan, sample) against model time over decode steps of `rows` running requests."""
    llm = LLM("demo", **llm_kw)
    eng = llm.llm_engine
    for i, p in enumerate(workload(rows, 32, 0, seed=3)):
        eng.add_request(f"h{i}", p, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    eng.step()  # the prompts
    eng.timings = dict.fromkeys(eng.timings, 0.0)
    while eng.has_unfinished_requests():
        eng.step()
    t = dict(eng.timings)
    host = t["schedule"] + t["plan"] + t["sample"]
    return {
        "rows": rows,
        "steps": t["steps"],
        "host_s": host,
        "model_s": t["model"],
        "share": host / (host + t["model"]),
    }


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def arrivals(llm_kw, tokens: int, conc: int = 8, prompt_len: int = 2048, arrival_out: int = 2) -> dict:
    """The decode latency of `conc` running requests (32-token prompts, ignore_eos) over `tokens` tokens
    each, first alone, then while `prompt_len`-token prompts (max_tokens `arrival_out`) arrive: a new one
    each time the previous one has its first token (finished its prefill), so some prompt is always being
    prefilled. Per step: time.perf_counter around step(); per request: the arrival time of each token;
    inter-token latency (ITL) = the gap between a request's consecutive tokens."""
    eng = LLMEngine("demo", **llm_kw)
    ids = [f"d{i}" for i in range(conc)]
    sp = SamplingParams(temperature=0, max_tokens=2 * tokens + 64, ignore_eos=True)
    for rid, p in zip(ids, workload(conc, 32, 0, seed=4), strict=True):
        eng.add_request(rid, p, sp)
    seen, last = dict.fromkeys(ids, 0), {}

    def step() -> tuple[float, list]:
        t0 = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        gaps = []
        for o in outs:
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            if o.request_id in seen and n > seen[o.request_id]:
                if o.request_id in last:
                    gaps.append((o.request_id, now - last[o.request_id]))
                seen[o.request_id], last[o.request_id] = n, now
        return now - t0, outs, gaps

    while min(seen.values()) < 4:  # the prompts, then a few decode steps (warm)
        step()

    def phase(arrive: bool) -> dict:
        itl, steps, count, added = {r: [] for r in ids}, [], 0, 0
        pending = None  # the arriving prompt still in prefill
        prompts = workload(4 * tokens + 8, prompt_len, 0, seed=5 + arrive)
        while min(len(v) for v in itl.values()) < tokens:
            if arrive and pending is None:
                pending = f"a{added}"
                one = SamplingParams(temperature=0, max_tokens=arrival_out, ignore_eos=True)
                eng.add_request(pending, prompts[added], one)
                added += 1
            took, outs, gaps = step()
            steps.append(took)
            for rid, g in gaps:
                if len(itl[rid]) < tokens:
                    itl[rid].append(g)
            for o in outs:
                if o.request_id == pending and o.outputs and o.outputs[0].token_ids:
                    pending, count = None, count + 1
        flat = [g for v in itl.values() for g in v]
        return {
            "steps": len(steps),
            "step_mean_ms": 1e3 * sum(steps) / len(steps),
            "step_median_ms": 1e3 * _quantile(steps, 0.5),
            "itl_mean_ms": 1e3 * sum(flat) / len(flat),
            "itl_median_ms": 1e3 * _quantile(flat, 0.5),
            "itl_p90_ms": 1e3 * _quantile(flat, 0.9),
            "prompts_added": added,
            "prompts_prefilled": count,
        }

    alone = phase(False)
    busy = phase(True)
    return {
        "concurrency": conc,
        "tokens_per_request": tokens,
        "arriving_prompt": prompt_len,
        "max_num_batched_tokens": llm_kw["max_num_batched_tokens"],
        "without": alone,
        "with": busy,
        "ratio_median": busy["itl_median_ms"] / alone["itl_median_ms"],
        "ratio_p90": busy["itl_p90_ms"] / alone["itl_median_ms"],
        "ratio_mean": busy["itl_mean_ms"] / alone["itl_mean_ms"],
    }


def short(llm_kw, conc: int, prompts: int, input_len: int = 128, output_len: int = 32) -> dict:
    """Output tokens/s of `prompts` random `input_len`-token requests (`output_len` out, ignore_eos),
    `conc` in flight at a time (a new one added as one finishes), one engine step at a time."""
    eng = LLMEngine("demo", **llm_kw)
    rng = random.Random(0)
    queue = [[rng.randrange(1000, 100_000) for _ in range(input_len)] for _ in range(prompts)]
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    eng.add_request("warm", queue[0][:16], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    start, running, generated, i = time.perf_counter(), 0, 0, 0
    while queue or eng.has_unfinished_requests():
        while queue and running < conc:
            eng.add_request(f"s{i}", queue.pop(), sp)
            running, i = running + 1, i + 1
        for out in eng.step():
            if out.finished:
                running -= 1
                generated += len(out.outputs[0].token_ids)
    took = time.perf_counter() - start
    return {"concurrency": conc, "requests": prompts, "seconds": took, "tokens_per_s": generated / took}


def memory(cache_bytes: int, seq_len: int) -> dict:
    """Concurrent seq_len-token sequences in `cache_bytes`: the engine's latent pages (bf16, fp8), the
    allocator counting whole pages, against per-head K/V at the same widths (bf16)."""
    from transformers import DeepseekV3Config

    from mlakit.cache.quant import token_layout
    from mlakit.config import MLAConfig

    cfg = MLAConfig.from_hf(DeepseekV3Config(**DEMO))
    layers, block = cfg.num_layers, 64
    out = {}
    for name, quant in (("bf16 latent", None), ("fp8 latent", "fp8")):
        row = token_layout(cfg, torch.bfloat16, quant).row_bytes
        pages = cache_bytes // (row * block * layers)
        out[name] = {"bytes_per_token": row * layers, "sequences": pages // -(-seq_len // block)}
    kv = cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 2 * layers
    out["bf16 per-head K/V"] = {"bytes_per_token": kv, "sequences": cache_bytes // (kv * seq_len)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="16 requests of 128 +- 64 tokens, 32 out; prefix 512"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--parts",
        default="throughput,ttft,memory,host",
        help="which parts to run, of throughput,ttft,memory,host,arrivals,short",
    )
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="the engine's step budget (tokens)"
    )
    ap.add_argument("--arrival-tokens", type=int, default=None, help="arrivals: tokens per decoding request")
    ap.add_argument(
        "--plain-weights",
        action="store_true",
        help="bf16 GEMMs on the plain weights (no oneDNN prepacking: mlakit/engine/packed.py), for A/B",
    )
    args = ap.parse_args()
    if args.plain_weights:
        import mlakit.engine.runner

        mlakit.engine.runner.PACK = False
    if args.threads:
        torch.set_num_threads(args.threads)
    q = args.quick
    n, mean, spread, out_len = (16, 128, 64, 32) if q else (64, 512, 256, 128)
    prefix, ttft_count = (512, 8) if q else (2048, 32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = native_16bit(device)
    res = {"machine": machine(), "dtype": str(dtype), "quick": q, "requests": n}
    res["packed_weights"] = not args.plain_weights
    res.update(prompt=f"{mean}+-{spread}", output_tokens=out_len)
    print(json.dumps(res))
    llm_kw = dict(dtype=dtype, cache_memory="2GiB", max_num_seqs=64)
    llm_kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    parts = args.parts.split(",")
    if "throughput" in parts:
        throughput(res, llm_kw, n, mean, spread, out_len, args.skip_hf, device, dtype)
    if "ttft" in parts:
        res["ttft"] = [ttft(llm_kw, prefix, 32, ttft_count, c) for c in (False, True)]
        for r in res["ttft"]:
            print("ttft", json.dumps(r))
        res["ttft_ratio"] = res["ttft"][0]["mean_s"] / res["ttft"][1]["mean_s"]
        print(f"ttft without / with prefix caching: {res['ttft_ratio']:.2f}x (target >= 5x)")
    if "memory" in parts:
        res["memory_2GiB_4K"] = memory(2 * 2**30, 4096)
        print("concurrent 4K sequences in 2 GiB", json.dumps(res["memory_2GiB_4K"]))
    if "host" in parts:
        res["host_64"] = host_share(llm_kw)
        print("host share at 64 running requests", json.dumps(res["host_64"]))
    if "arrivals" in parts:
        r = res["arrivals"] = arrivals(llm_kw, args.arrival_tokens or (8 if q else 32))
        print("arrivals", json.dumps(r))
        a, b = r["without"], r["with"]
        print(f"decode at concurrency {r['concurrency']}, budget {r['max_num_batched_tokens']}: step "
              f"{a['step_median_ms']:.0f} ms median alone; ITL median {a['itl_median_ms']:.0f} ms alone, "
              f"{b['itl_median_ms']:.0f} ms (p90 {b['itl_p90_ms']:.0f}) with {r['arriving_prompt']}-token "
              f"prompts arriving ({b['prompts_prefilled']} prefilled): {r['ratio_median']:.2f}x median, "
              f"{r['ratio_mean']:.2f}x mean (target <= 1.5x)")  # fmt: skip
    if "short" in parts:
        res["short"] = [short(llm_kw, c, c * (1 if q else 2)) for c in (8, 32)]
        for r in res["short"]:
            print(f"short 128 x 32 at concurrency {r['concurrency']}: {r['tokens_per_s']:.1f} output tok/s",
                  json.dumps(r))  # fmt: skip
    res["machine"]["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


def throughput(res, llm_kw, n, mean, spread, out_len, skip_hf, device, dtype) -> None:
    prompts = workload(n, mean, spread)
    llm = LLM("demo", **llm_kw)
    engine_throughput(llm, prompts[:2], 2)  # warm up
    res["engine"] = engine_throughput(llm, prompts, out_len)
    t = res["engine"]["timings"]
    host = t["schedule"] + t["plan"] + t["sample"]
    res["host_share"] = host / (host + t["model"])
    print("engine", json.dumps(res["engine"]), f"host share {res['host_share']:.1%}")
    del llm
    if not skip_hf:
        model = demo_model(dtype, device)
        batches = (8, 32) if n >= 32 else (8, n)  # --quick: 16 requests, batches of 8 and 16
        res["transformers"] = [hf_throughput(model, prompts, out_len, b) for b in batches]
        for r in res["transformers"]:
            print("transformers generate", json.dumps(r))
        res["transformers_cb"] = hf_continuous(model, prompts[:4], 4)
        print("transformers generate_batch", json.dumps(res["transformers_cb"]))
        best = max(r["tokens_per_s"] for r in res["transformers"])
        res["speedup"] = res["engine"]["tokens_per_s"] / best
        print(f"engine / best transformers: {res['speedup']:.2f}x (target >= 3x)")
        del model


if __name__ == "__main__":
    main()

"""`mlakit serve --model demo` under `mlakit bench-serve` at concurrency 1, 8 and 32, against the engine
offline at the same load, with and without a shared prefix, and `transformers serve` on the same weights.

    PYTHONPATH=. python benchmarks/serve.py --quick          # prompts 128, outputs 32, prefix 512
    PYTHONPATH=. python benchmarks/serve.py                  # prompts 512, outputs 128, prefix 2,048

Every server is a child process on a free loopback port, killed (by PID) at the end. Prints one table
per server, the ratios against the targets, and writes everything with the machine to --json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from support.serve import free_port  # noqa: E402

FULL = dict(input_len=512, output_len=128, prefix_len=2048, per_client=2, hf_prompts=8)
QUICK = dict(input_len=128, output_len=32, prefix_len=512, per_client=1, hf_prompts=4)


def start(cmd: list[str], port: int, env: dict, timeout: float = 600.0) -> subprocess.Popen:
    import httpx

    log = os.path.join(tempfile.gettempdir(), f"mlakit-bench-serve-{port}.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log) as f:
                raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}: {f.read()[-1500:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} did not answer /health in {timeout:.0f} s")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(30)


def bench(port: int, conc: int, prompts: int, input_len: int, output_len: int, env: dict, *extra) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "mlakit.cli", "bench-serve", "--base-url", f"http://127.0.0.1:{port}",
               "--num-prompts", str(prompts), "--input-len", str(input_len), "--output-len", str(output_len),
               "--max-concurrency", str(conc), "--json", out.name, "--no-progress", *extra]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": (done.stderr or done.stdout).strip().splitlines()[-1]}
        return json.load(open(out.name))


def offline(conc: int, prompts: int, input_len: int, output_len: int, cache: str, budget: int | None) -> dict:
    """The engine alone: `prompts` random-token requests, `conc` in flight at a time, tokens/s."""
    import random

    from mlakit.engine import LLMEngine, SamplingParams

    extra = {} if budget is None else {"max_num_batched_tokens": budget}
    engine = LLMEngine("demo", max_num_seqs=max(conc, 1), cache_memory=cache, **extra)
    rng = random.Random(0)
    queue = [[rng.randrange(1000, 100_000) for _ in range(input_len)] for _ in range(prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start, running, generated, i = time.perf_counter(), 0, 0, 0
    while queue or engine.has_unfinished_requests():
        while queue and running < conc:
            engine.add_request(f"r{i}", queue.pop(), params)
            running, i = running + 1, i + 1
        for out in engine.step():
            if out.finished:
                running -= 1
                generated += len(out.outputs[0].token_ids)
    duration = time.perf_counter() - start
    return {"output_throughput": generated / duration, "duration": duration, "total_output_tokens": generated}


def save_demo(folder: str) -> None:
    from mlakit.engine.demo import demo_model, demo_tokenizer
    from mlakit.engine.load import native_16bit

    demo_model(native_16bit("cpu")).save_pretrained(folder)
    demo_tokenizer().save_pretrained(folder)


def run_mlakit(cfg: dict, concs: list[int], env: dict, cache: str, budget: int | None) -> dict:
    serve = [sys.executable, "-m", "mlakit.cli", "serve", "--model", "demo", "--cache-memory", cache]
    serve += [] if budget is None else ["--max-num-batched-tokens", str(budget)]
    port = free_port()
    proc = start(serve + ["--port", str(port)], port, env)
    try:
        rows = {
            c: bench(port, c, c * cfg["per_client"], cfg["input_len"], cfg["output_len"], env) for c in concs
        }
        prefix = bench(port, 1, 4, 32, 4, env, "--prefix-len", str(cfg["prefix_len"]))
    finally:
        stop(proc)
    port = free_port()
    proc = start(serve + ["--port", str(port), "--no-prefix-caching"], port, env)
    try:
        no_prefix = bench(port, 1, 4, 32, 4, env, "--prefix-len", str(cfg["prefix_len"]))
    finally:
        stop(proc)
    return {"rows": rows, "prefix": prefix, "no_prefix": no_prefix}


def run_transformers(cfg: dict, concs: list[int], env: dict, folder: str) -> dict:
    """`transformers serve FOLDER` (its default mode), each concurrency capped at hf_prompts prompts."""
    port = free_port()
    cmd = ["transformers", "serve", folder, "--port", str(port), "--device", "cpu"]
    try:
        proc = start(cmd, port, env)
    except (RuntimeError, OSError) as err:
        return {"error": f"`{' '.join(cmd)}` did not start: {err}"}
    try:
        rows = {}
        for c in concs:
            n = min(c * cfg["per_client"], max(cfg["hf_prompts"], c))
            rows[c] = bench(port, c, n, cfg["input_len"], cfg["output_len"], env, "--tokenizer", folder)
        return {"rows": rows}
    finally:
        stop(proc)


def line(name: str, c: int, r: dict) -> str:
    if "error" in r:
        return f"{name:<22} {c:>4}  error: {r['error'][:150]}"
    cells = [
        f"{r['completed']:>5}",
        f"{r['output_throughput']:>10.1f}",
        f"{r['median_ttft_ms']:>10.0f}",
        f"{r['median_tpot_ms']:>9.0f}",
        f"{r['median_itl_ms']:>9.0f}",
        f"{r['median_e2el_ms']:>10.0f}",
    ]
    return f"{name:<22} {c:>4} " + " ".join(cells)  # fmt: skip


def report(result: dict, concs: list[int]) -> None:
    if "mlakit" not in result:
        for c, r in result.get("transformers", {}).get("rows", {}).items():
            print(line("transformers serve", c, r))
        print(result.get("transformers", {}).get("error", ""))
        return
    print(f"{'server':<22} {'conc':>4} {'reqs':>5} {'out tok/s':>10} {'TTFT p50':>10} {'TPOT p50':>9} "
          f"{'ITL p50':>9} {'E2EL p50':>10}   (ms)")  # fmt: skip
    for c in concs:
        print(line("mlakit serve", c, result["mlakit"]["rows"][c]))
        print(f"{'engine offline':<22} {c:>4} {'':>5} {result['offline'][c]['output_throughput']:>10.1f}")
    for c, r in result.get("transformers", {}).get("rows", {}).items():
        print(line("transformers serve", c, r))
    if "error" in result.get("transformers", {}):
        print("transformers serve:", result["transformers"]["error"])
    for c in concs:
        served = result["mlakit"]["rows"][c].get("output_throughput", 0.0)
        share = 1 - served / result["offline"][c]["output_throughput"]
        print(f"server overhead at concurrency {c}: {share:.1%} of the engine's offline output tokens/s "
              "(target < 10%)")  # fmt: skip
    hf = [
        r["output_throughput"]
        for r in result.get("transformers", {}).get("rows", {}).values()
        if "error" not in r
    ]
    if hf and "error" not in result["mlakit"]["rows"][max(concs)]:
        ratio = result["mlakit"]["rows"][max(concs)]["output_throughput"] / max(hf)
        print(f"output tokens/s at concurrency {max(concs)} / best transformers serve figure: {ratio:.1f}x "
              "(target >= 3x)")  # fmt: skip
    p, q = result["mlakit"]["prefix"], result["mlakit"]["no_prefix"]
    if "error" not in p and "error" not in q:
        size = result["config"]["prefix_len"]
        print(f"TTFT p50 with a {size}-token shared prefix: {p['median_ttft_ms']:.0f} ms "
              f"cached, {q['median_ttft_ms']:.0f} ms with --no-prefix-caching: "
              f"{q['median_ttft_ms'] / p['median_ttft_ms']:.1f}x (target >= 5x)")  # fmt: skip


def machine() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), cpu)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_at_start": os.getloadavg(),
        "python": platform.python_version(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="prompts 128, outputs 32, prefix 512, fewer requests")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--threads", type=int, default=1, help="OMP/torch threads of every server and the engine")
    p.add_argument("--cache-memory", default="1GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's step budget")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--only-transformers", action="store_true", help="only the transformers serve rows")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cfg = dict(QUICK if args.quick else FULL)
    concs = [int(c) for c in args.concurrency.split(",")]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=os.getcwd(), TQDM_DISABLE="1")
    import torch

    torch.set_num_threads(args.threads)
    cfg["max_num_batched_tokens"] = args.max_num_batched_tokens
    result = {"config": cfg, "concurrency": concs, "threads": args.threads, "machine": machine()}
    if not args.only_transformers:
        result["mlakit"] = run_mlakit(cfg, concs, env, args.cache_memory, args.max_num_batched_tokens)
        size = (cfg["input_len"], cfg["output_len"], args.cache_memory, args.max_num_batched_tokens)
        result["offline"] = {c: offline(c, c * cfg["per_client"], *size) for c in concs}
    if not args.skip_transformers:
        with tempfile.TemporaryDirectory() as folder:
            save_demo(folder)
            result["transformers"] = run_transformers(cfg, concs, env, folder)
    result["machine"]["load_at_end"] = os.getloadavg()
    where = result["machine"]
    print(f"machine: {where['cpu']}, {args.threads} thread(s), load at start {where['load_at_start']}")
    report(result, concs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

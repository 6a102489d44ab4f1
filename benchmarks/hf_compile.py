"""Compile time and compiled decode speed of a tiny transformers DeepSeek-V3, unpatched vs patched.

    PYTHONPATH=. python benchmarks/hf_compile.py                  # inductor, 256-token prompt
    PYTHONPATH=. python benchmarks/hf_compile.py --backend eager --prompt 64 --steps 8

Each model prefills a StaticCache eagerly, then `torch.compile(model.forward, fullgraph=True)` runs
the decode steps: the first compiled step's wall time is the compile time (dynamo + backend), the
median of the later steps is the time per token. Each model runs in a fresh process with inductor's
caches off, so that both pay the same one-time costs and neither reuses the other's graphs. A gate
compares the first step's logits of both before printing.
The target: the patched compile within 1.5x of the unpatched one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from hf_decode import DTYPES, build_model, machine_name
from transformers import StaticCache

import mlakit.hf

GATE_REL = 1e-3  # fp32 logits of two exact algorithms
TARGET = 1.5


def step_inputs(prompt: int, width: int, step: int, token: int) -> dict:
    """Inputs of decode step `step`: one token, the 2D mask zero-padded to the cache's length (its
    shape never changes, so neither does the graph) and the token's position."""
    mask = F.pad(torch.ones(1, prompt + step + 1, dtype=torch.long), (0, width - prompt - step - 1))
    return dict(
        input_ids=torch.tensor([[token]]), attention_mask=mask, position_ids=torch.tensor([[prompt + step]])
    )


def run(model, args, tokens: list[int]) -> dict:
    """Prefill eagerly, compile, decode; (compile seconds, per-token seconds, first step's logits)."""
    width = args.prompt + len(tokens)
    cache = StaticCache(model.config, max_cache_len=width)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(1, model.config.vocab_size, (1, args.prompt), generator=g)
    torch._dynamo.reset()
    forward = torch.compile(model.forward, fullgraph=True, backend=args.backend)
    times, logits = [], []
    with torch.inference_mode():
        model(prompt, cache=cache)
        for i, token in enumerate(tokens):
            t0 = time.perf_counter()
            out = forward(**step_inputs(args.prompt, width, i, token), cache=cache).logits[0, -1]
            times.append(time.perf_counter() - t0)
            logits.append(out.float())
    return dict(compile_s=times[0], s_per_token=statistics.median(times[1 + args.warmup :]), logits=logits[0])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens prefilled eagerly (default 256)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps (default 16)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling one (default 2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="processes per model, medians reported (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the rows, machine and versions as JSON")
    p.add_argument("--variant", choices=("unpatched", "patched"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prompt < 1 or args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("prompt, steps and repeats must be >= 1, warmup >= 0")
    return args


def measure(args) -> None:
    """One model in this process (`--variant`): writes its row and first logits to `--out`."""
    # a graph cached on disk by an earlier run must not speed this compile up
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    n = 1 + args.warmup + args.steps
    model = build_model(DTYPES[args.dtype], args.prompt + n + 1)
    if args.variant == "patched":
        mlakit.hf.patch(model)
    tokens = torch.randint(1, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    torch.save(run(model, args, tokens.tolist()), args.out)


def median_row(done: list[dict]) -> dict:
    """The median compile and per-token seconds over repeated processes (each row's own figures)."""
    return dict(
        compile_s=statistics.median(r["compile_s"] for r in done),
        s_per_token=statistics.median(r["s_per_token"] for r in done),
        compile_s_each=[r["compile_s"] for r in done],
        logits=done[0]["logits"],
    )


def spawn(variant: str, argv: list[str], folder: str) -> dict:
    out = os.path.join(folder, f"{variant}.pt")
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--variant", variant, "--out", out]
    subprocess.run(cmd, check=True)
    return torch.load(out)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.variant:
        return measure(args)
    machine = machine_name()
    print(f"tiny DeepSeek-V3 ({args.dtype}, hidden 512, 32 heads, latent 256, 2 layers) on {machine}")
    print(f"torch.compile(fullgraph=True, backend={args.backend!r}), StaticCache, prompt {args.prompt}")
    runs = {"unpatched": [], "patched": []}
    with tempfile.TemporaryDirectory() as folder:
        # alternated, so that a change in the machine's load falls on both
        for _ in range(args.repeats):
            for name, rows in runs.items():
                rows.append(spawn(name, argv, folder))
    rows = {name: median_row(done) for name, done in runs.items()}
    want, got = rows["unpatched"].pop("logits"), rows["patched"].pop("logits")
    rel = ((got - want).abs().max() / want.abs().max()).item()
    if not rel <= GATE_REL:
        raise SystemExit(f"gate failed: patched first-step logits differ by {rel:.2e} (relative)")
    ratio = rows["patched"]["compile_s"] / rows["unpatched"]["compile_s"]
    print(f"{'':>10} {'compile s':>10} {'ms/token':>9}  compile s of each process")
    for name, row in rows.items():
        each = ", ".join(f"{t:.1f}" for t in row["compile_s_each"])
        print(f"{name:>10} {row['compile_s']:>10.1f} {1e3 * row['s_per_token']:>9.2f}  {each}")
    verdict = "meets" if ratio <= TARGET else "misses"
    print(f"compile ratio patched/unpatched {ratio:.2f} ({verdict} the {TARGET}x target), gate {rel:.1e}")
    if args.json:
        import transformers

        meta = dict(machine=machine, torch=torch.__version__, transformers=transformers.__version__)
        out = dict(meta, backend=args.backend, dtype=args.dtype, prompt=args.prompt, gate_rel_error=rel)
        with open(args.json, "w") as f:
            json.dump(dict(out, compile_ratio=ratio, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()

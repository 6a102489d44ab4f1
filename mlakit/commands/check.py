"""mlakit check: a preset's layer at full width, prefill + decode in both paths, difference and time."""

from __future__ import annotations

import time

from mlakit.commands import emit_json, plural
from mlakit.commands.args import check_memory, count_type, resolve_model
from mlakit.commands.check_time import MAX_MINUTES, PROGRESS_SECONDS, check_duration, say
from mlakit.commands.memory import check_run_bytes
from mlakit.commands.time_limit import add_time_limit_arg, check_max_minutes

DTYPES = ("bf16", "fp32")
VALUE_BYTES = {"fp32": 4, "bf16": 2}
MAX_DECODE_STEPS = 4096
# ops.materialize.DEFAULT_WORKSPACE_TOKENS, kept here so that the command loads without torch (tested equal)
WORKSPACE_TOKENS = 4096  # each step is one timed call per path; more is a benchmark, not a check


def register(sub) -> None:
    p = sub.add_parser(
        "check", help="run both paths on a preset's full-width layer; print difference and time"
    )
    p.add_argument("--model", default="deepseek-v3", help="preset name, config.json or model folder")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument(
        "--prefill", type=count_type("prefill", 1), default=256, help="prompt tokens, 1K = 1024 (256)"
    )
    p.add_argument(
        "--decode-steps",
        type=count_type("decode-steps", 0, MAX_DECODE_STEPS),
        default=8,
        help=f"decode steps after the prefill, at most {MAX_DECODE_STEPS} (default 8)",
    )
    p.add_argument("--batch", type=count_type("batch", 1), default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, help="torch threads (default: chosen as mlakit bench does: load and a probe)"
    )
    add_time_limit_arg(p, MAX_MINUTES)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run_path(layer, cfg, mode, prompt, steps, dtype, verbose=False):
    """Prefill then decode in one mode; returns outputs and seconds of each phase (said on stderr
    as each phase ends when `verbose`)."""
    import torch

    from mlakit.cache.contiguous import LatentCache

    batch = prompt.shape[0]
    cache = LatentCache(cfg, batch, prompt.shape[1] + len(steps), dtype=dtype)
    outs = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        outs.append(layer(prompt, cache, mode=mode))
        t1 = time.perf_counter()
        if verbose:
            say(f"{mode}: prefill of {plural(prompt.shape[1], 'token')} done in {t1 - t0:.1f} s")
        for x in steps:
            outs.append(layer(x, cache, mode=mode))
        t2 = time.perf_counter()
        if verbose and steps:
            say(f"{mode}: {plural(len(steps), 'decode step')} done in {t2 - t1:.1f} s")
    return outs, t1 - t0, (t2 - t1) / max(1, len(steps))


def dsa_bytes(cfg, batch: int, prefill: int, steps: int, value_bytes: int) -> int:
    """What a DSA layer adds to `check_run_bytes` (0 for dense MLA): the indexer keys of both caches,
    the prefill's selection and the dense-masked path's key mask of one key block (index scores are
    scored a block of queries at a time within the score budget, counted in its slack)."""
    if not cfg.is_sparse:
        return 0
    tokens = prefill + steps
    picked = batch * prefill * min(cfg.index_topk, tokens)
    return (
        2 * batch * tokens * cfg.index_head_dim * value_bytes  # indexer keys, one cache per path
        + 3 * picked * 8  # the selection (long), clamped rows and the hidden mask beside it
        + batch * prefill * (min(tokens, WORKSPACE_TOKENS) + 1)  # sparse-materialize: one
        # key block's selected keys [B, S, t+1] bool
    )


def _probe_seconds(layer, cfg, prefill: int, dtype) -> float:
    """Seconds of one batch-1 prefill of `prefill` tokens in each path (what the estimate scales)."""
    import torch

    prompt = torch.randn(1, prefill, cfg.hidden_size, dtype=dtype)
    return sum(sum(run_path(layer, cfg, mode, prompt, [], dtype)[1:]) for mode in ("absorb", "materialize"))


def rel_diff(a: list, b: list) -> float:
    num = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))
    den = max(float(y.float().abs().max()) for y in b)
    return num / max(den, 1e-30)


def run(args) -> int:
    check_max_minutes(args.max_minutes)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    for name in ("prefill", "decode_steps", "batch"):
        if getattr(args, name) < (0 if name == "decode_steps" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    cfg = resolve_model(args.model, "check")
    need = check_run_bytes(cfg, args.batch, args.prefill, args.decode_steps, VALUE_BYTES[args.dtype])
    need += dsa_bytes(cfg, args.batch, args.prefill, args.decode_steps, VALUE_BYTES[args.dtype])
    check_memory(need, f"{cfg.name} at batch {args.batch}, prefill {args.prefill:,}", "--batch or --prefill")
    import torch

    from mlakit.attention import MLAAttention
    from mlakit.bench.machine_state import measure_state

    state = measure_state(args.threads)  # bench's choice: 1 thread when the cores are busy
    torch.set_num_threads(state.threads)
    check_duration(cfg, args, state)  # the GEMM rate's lower bound: refused before the layer is built
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    layer = MLAAttention(cfg, dtype=dtype).eval()
    build_s = time.perf_counter() - t0
    seconds = check_duration(cfg, args, state, lambda n: _probe_seconds(layer, cfg, n, dtype))
    verbose = seconds >= PROGRESS_SECONDS
    prompt = torch.randn(args.batch, args.prefill, cfg.hidden_size, dtype=dtype)
    steps = [torch.randn(args.batch, 1, cfg.hidden_size, dtype=dtype) for _ in range(args.decode_steps)]
    result = {"model": cfg.name, "dtype": args.dtype, "batch": args.batch, "prefill": args.prefill}
    result["decode_steps"] = args.decode_steps
    result["threads"] = torch.get_num_threads()
    result["threads_reason"] = state.reason
    outs = {}
    for mode in ("absorb", "materialize"):
        outs[mode], prefill_s, decode_s = run_path(layer, cfg, mode, prompt, steps, dtype, verbose)
        result[mode] = {"prefill_ms": prefill_s * 1e3, "decode_ms_per_step": decode_s * 1e3}
    result["max_rel_diff"] = rel_diff(outs["absorb"], outs["materialize"])
    result["build_s"] = build_s
    if args.json:
        emit_json(result)
        return 0
    print(
        f"{cfg.name}: {plural(cfg.num_heads, 'head')}, latent {cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}, "
        f"{args.dtype}, batch {args.batch}, prefill {args.prefill} + "
        f"{plural(args.decode_steps, 'decode step')}, {plural(result['threads'], 'thread')}"
    )
    print(f"threads: {result['threads_reason']}")
    print(f"{'path':<12} {'prefill ms':>11} {'decode ms/step':>15}")
    for mode in ("absorb", "materialize"):
        r = result[mode]
        print(f"{mode:<12} {r['prefill_ms']:>11.1f} {r['decode_ms_per_step']:>15.2f}")
    print(f"max |absorb - materialize| / max |materialize| = {result['max_rel_diff']:.2e}")
    return 0

"""mlakit serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the generation engine."""

from __future__ import annotations

import gc
import os
import socket
import sys

from mlakit.commands.args import add_step_mode, count_type


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API (completions, chat, models, metrics)")
    p.add_argument(
        "--model", default="demo", help="demo (built-in random DeepSeek-V3-shaped model) or a FOLDER"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=count_type("port", 0, 65535), default=8000)
    p.add_argument(
        "--served-model-name", default=None, help="the name clients send (default: --model as given)"
    )
    p.add_argument("--cache-dtype", choices=("fp8", "int8"), default=None, help="quantized latent pages")
    p.add_argument("--max-num-seqs", type=count_type("max-num-seqs", 1, 1 << 16), default=None)
    p.add_argument(
        "--max-num-batched-tokens", type=count_type("max-num-batched-tokens", 1, 1 << 24), default=None
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument(
        "--api-key",
        default=os.environ.get("MLAKIT_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 (default: $MLAKIT_API_KEY, else none)",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="weights and compute dtype")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads (torch's intra-op pool; default: every core this process may use)",
    )
    p.add_argument("--cache-memory", default=None, help="bytes or e.g. 2GiB for the latent pages")
    add_step_mode(p)
    p.add_argument(
        "--max-waiting-requests",
        type=count_type("max-waiting-requests", 0, 1 << 20),
        default=1024,
        help="past this many requests waiting for a batch slot, new ones get 503 (Retry-After: 1)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=count_type("max-request-bytes", 1, 1 << 40),
        default=None,
        help="request bodies past this get 413 (default: 4 bytes x the characters max_model_len tokens can "
        "hold, at least 1 MiB)",
    )
    p.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access line per request on stderr (vLLM's flag)",
    )
    p.add_argument(
        "--disable-access-log-for-endpoints",
        default="",
        help="comma-separated paths left out of the access log, e.g. /health,/metrics (vLLM's flag)",
    )
    p.set_defaults(func=run)  # fmt: skip


def engine_kwargs(args) -> dict:
    """The engine keywords the flags set; unset flags leave the engine's defaults."""
    kw = {"enable_prefix_caching": not args.no_prefix_caching, "enforce_eager": args.enforce_eager}
    for flag in ("cache_dtype", "max_num_seqs", "max_num_batched_tokens", "dtype", "cache_memory"):
        value = getattr(args, flag)
        if value is not None:
            kw[flag] = value
    return kw


def _check_tokenizer(model: str) -> None:
    """The server tokenizes and detokenizes: a weights-only folder is refused before it loads."""
    import os

    from mlakit.engine.load import TOKENIZER_FILES, has_tokenizer_files

    if model != "demo" and os.path.isdir(model) and not has_tokenizer_files(model):
        raise ValueError(
            f"--model {model!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); mlakit serve "
            "needs the model's tokenizer beside its weights"
        )


def run(args) -> int:
    from mlakit.engine.threads import (
        ComputeThread,
        check_threads,
        keep_off_compute_cores,
        plan_threads,
        set_threads,
        usable_cores,
    )

    threads = check_threads(args.threads)
    _check_extra()
    _check_port(args.host, args.port)
    import uvicorn

    from mlakit.engine import LLMEngine
    from mlakit.serve.adapter import EngineAdapter
    from mlakit.serve.app import build_app

    _check_tokenizer(args.model)
    threads = set_threads(threads)
    # the engine loop thread runs the steps on `threads` threads pinned one per core where cores are left
    # over, and this thread (the HTTP event loop) moves to those. With no core left the team is not
    # pinned: a pinned thread cannot get out of the HTTP thread's way (or another job's), and its partner
    # spins at every barrier meanwhile (2 threads on 2 shared cores: short8 17.2 tok/s pinned, 27.8 not)
    plan_threads(threads, bind=threads < usable_cores())
    # the engine is built and stepped on one thread: a second thread with an OpenMP team of its own
    # (this one, had it built the engine) throttles the team's spinning (threads.ComputeThread)
    compute = ComputeThread()
    engine = compute.call(LLMEngine, args.model, **engine_kwargs(args))
    pinning = keep_off_compute_cores()
    name = args.served_model_name or args.model
    mode = _step_mode(engine.stats)
    app = build_app(EngineAdapter(engine), name, compute=compute, **app_kwargs(args))
    if not args.disable_uvicorn_access_log:
        _log_access()
    # the startup heap (model, tokenizer) leaves the collector's view, as vLLM does: a full collection
    # over it held the GIL ~0.2 s, stalling every request
    gc.collect()
    gc.freeze()
    print(
        f"mlakit serve: {name} at http://{args.host}:{args.port}/v1, {threads} compute threads "
        f"({pinning}; {engine.malloc}), {mode} (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    loop = "uvloop" if _has("uvloop") else "asyncio"
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", loop=loop, timeout_graceful_shutdown=5
    )
    return 0


def _step_mode(stats) -> str:
    """'eager steps' or 'compiled steps for 2-16, 17-128 tokens, eager otherwise'."""
    if not stats.compiled_buckets:
        return "eager steps"
    return f"compiled steps for {', '.join(stats.compiled_buckets)} tokens, eager otherwise"


def app_kwargs(args) -> dict:
    skip = tuple(p.strip() for p in args.disable_access_log_for_endpoints.split(",") if p.strip())
    return {
        "api_key": args.api_key,
        "max_waiting": args.max_waiting_requests,
        "max_request_bytes": args.max_request_bytes,
        "access_log": not args.disable_uvicorn_access_log,
        "access_log_skip": skip,
    }


def _log_access() -> None:
    """The access lines on stderr, as uvicorn prints its own (`INFO:     ...`)."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    log = logging.getLogger("mlakit.serve.access")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _check_extra() -> None:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if not _has(m)]
    if missing:
        raise ValueError(f"serve needs {', '.join(missing)}: pip install 'mlakit[serve]'")


def _check_port(host: str, port: int) -> None:
    """Refuse a port that is taken before the model is built (minutes on a big model)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r}: {err.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as err:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({err.strerror})") from None

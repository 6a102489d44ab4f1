"""The fused absorbed-decode kernel on a GPU: correctness vs the torch path, then speed side by side.

DeepSeek-V3 widths (latent 512, rope 64, nope 128, v 128), 64-token pages scattered over the pool,
one new token per row, every row at the full context. For each latent format (bf16, fp8 656 B),
head count, batch and context: the kernel's result against mlakit's torch absorb path, then the
median time per call (CUDA events, L2 flushed before each call), bytes/s against the HBM peak and
FLOP/s of

- `triton core`: `mlakit.kernels.absorb_decode` (folded queries → latent output, lse);
- `triton full`: `mlakit.kernels.absorb_paged` (fold W_UK, kernel, unfold W_UV);
- `torch full`:  `mlakit.ops.paged.absorb_chunked` over the same pages (the reference path);
- `flashmla`, `sglang triton`, `vllm triton`: their MLA decode kernels on the same pages, when importable.

Then a CUDA graph: the planned decode step of an N-layer stack if the cache has `plan()`, otherwise
the kernel alone, captured, replayed and checked against an eager call. Prints a table, writes JSON.

    python benchmarks/gpu_decode.py                 # < 5 min on one H200
    python benchmarks/gpu_decode.py --quick         # B 1 and 128 at 8K, 16 heads
    TRITON_INTERPRET=1 python benchmarks/gpu_decode.py --device cpu   # the script itself, tiny, on a CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_decode_baselines  # noqa: E402

from mlakit import MLAConfig  # noqa: E402
from mlakit.cache.quant import dequantize, field_view, quantize, token_layout  # noqa: E402
from mlakit.ops.paged import absorb_chunked  # noqa: E402

# HBM peak by device name (bytes/s); the first matching key wins
HBM_PEAK = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H800", 3.35e12), ("A100", 2.0e12))
BLOCK = 64  # tokens per page (FlashMLA's)
FORMATS = {"bf16": None, "fp8": "fp8"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--contexts", default="4096,8192,32768")
    p.add_argument("--heads", default="16,128", help="query heads per GPU: 16 (TP8 of V3), 128 (all of V3)")
    p.add_argument("--formats", default="bf16,fp8")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--layers", type=int, default=4, help="layers of the captured decode step")
    p.add_argument("--quick", action="store_true", help="B 1,128 at 8K, 16 heads, 5 repeats")
    p.add_argument(
        "--configs",
        default="16x16x4x2,32x32x8x2,16x32x8x2",
        help="other kernel tiles to time (block_m x block_n x warps x stages), '' for none",
    )
    p.add_argument(
        "--timeout", type=int, default=290, help="seconds before the run stops and writes what it has"
    )
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the script under the interpreter, tiny")
    p.add_argument("--json", default="gpu_decode.json")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.heads, args.repeats, args.configs = "1,128", "8192", "16", 5, ""
    if args.device == "cpu":
        args.batches, args.contexts, args.heads, args.repeats, args.layers = "2", "192", "16", 2, 2
        args.configs = "16x32x4x2"
    return args


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Timer:
    """Median seconds of `fn()` over repeats: CUDA events around each call with L2 flushed before it
    (a 256 MB write), or perf_counter on a CPU."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats
        self.flush = (
            torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
        )

    def __call__(self, fn) -> float:
        fn()  # warm-up (compiles on the first call)
        times = []
        for _ in range(self.repeats):
            if self.flush is None:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
                continue
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)


def hbm_peak(device: torch.device) -> dict:
    """{"name", "table": peak from the name or None, "measured": a 2 GB copy's read+write rate}."""
    if device.type != "cuda":
        return {"name": platform.processor() or "cpu", "table": None, "measured": None}
    name = torch.cuda.get_device_name(device)
    table = next((v for k, v in HBM_PEAK if k in name), None)
    buffers = [torch.empty(1 << 31, dtype=torch.uint8, device=device) for _ in range(2)]
    seconds = Timer(device, 5)(lambda: buffers[1].copy_(buffers[0]))
    buffers.clear()
    return {"name": name, "table": table, "measured": 2 * (1 << 31) / seconds}


class Pool:
    """The largest batch × context of one format as scattered pages; smaller shapes slice its table."""

    def __init__(self, fmt: str, batch: int, context: int, device: torch.device, seed: int = 0):
        self.cfg = MLAConfig.preset("deepseek-v3")
        self.layout = token_layout(self.cfg, torch.bfloat16, FORMATS[fmt])
        per_row = -(-context // BLOCK)
        blocks = batch * per_row
        g = torch.Generator(device=device).manual_seed(seed)
        self.pages = torch.zeros(blocks, BLOCK, self.layout.row_bytes, dtype=torch.uint8, device=device)
        rows = self.pages.view(-1, self.layout.row_bytes)
        for start in range(0, rows.shape[0], 1 << 20):
            self._fill(rows[start : start + (1 << 20)], g)
        perm = torch.randperm(blocks, generator=g, device=device)
        self.table = perm.view(batch, per_row).to(torch.int32)

    def _fill(self, rows: torch.Tensor, g: torch.Generator) -> None:
        n, lay = rows.shape[0], self.layout
        latent = torch.randn(n, lay.latent.count, generator=g, device=rows.device)
        if lay.quant is None:
            field_view(rows, lay.latent).copy_(latent)
        else:
            values, scale = quantize(latent, lay.quant)
            field_view(rows, lay.latent).copy_(values)
            field_view(rows, lay.scale).copy_(scale)
        field_view(rows, lay.rope).copy_(torch.randn(n, lay.rope.count, generator=g, device=rows.device))

    def reader(self, table: torch.Tensor, context: int):
        """read(start, stop) for absorb_chunked: the pages' rows gathered and dequantized (the torch path)."""
        rows, lay = self.pages.view(-1, self.layout.row_bytes), self.layout

        def read(start: int, stop: int):
            t = torch.arange(start, stop, device=table.device)
            flat = (table[:, t // BLOCK].long() * BLOCK + t % BLOCK).reshape(-1)
            latent = field_view(rows, lay.latent).index_select(0, flat)
            if lay.quant is not None:
                latent = dequantize(latent, field_view(rows, lay.scale).index_select(0, flat), torch.bfloat16)
            rope = field_view(rows, lay.rope).index_select(0, flat)
            return latent.view(table.shape[0], stop - start, -1), rope.view(table.shape[0], stop - start, -1)

        return read


def make_queries(cfg: MLAConfig, batch: int, heads: int, device: torch.device, seed: int = 1) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    dn, dr, dv, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    return {
        "q_nope": rnd(batch, 1, heads, dn),
        "q_pe": rnd(batch, 1, heads, dr),
        "w_uk": rnd(heads, dn, lat, scale=lat**-0.5),
        "w_uv": rnd(heads, dv, lat, scale=lat**-0.5),
    }


def traffic(pool: Pool, batch: int, heads: int, context: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode call over the core: every cached row read once, queries in,
    latent outputs out; scores over L + dr and the weighted sum over L per head and key."""
    lat, rope = pool.layout.latent.count, pool.layout.rope.count
    bytes_ = (
        batch * context * pool.layout.row_bytes  # the cached rows
        + batch * heads * (lat + rope) * 2  # folded queries, bf16
        + batch * heads * lat * 4  # latent outputs, fp32
    )
    flops = 2 * batch * heads * context * (lat + rope) + 2 * batch * heads * context * lat
    return bytes_, flops


def check_and_time(pool, fmt, batch, context, heads, timer, extra_configs, baselines) -> list[dict]:
    """One shape: the kernel against the torch path (out and lse), then every backend's time."""
    from mlakit.kernels import KernelConfig, absorb_decode, absorb_paged
    from mlakit.ops.absorb import fold_queries

    cfg, device = pool.cfg, pool.pages.device
    table = pool.table[:batch, : -(-context // BLOCK)].contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    x = make_queries(cfg, batch, heads, device)
    scale = cfg.softmax_scale
    args = (x["q_nope"], x["q_pe"])
    weights = (x["w_uk"], x["w_uv"])
    cpu_lens = lens.long().cpu()  # the torch path reads lengths on the host: copied once, not per call
    out, lse = absorb_paged(*args, pool.pages, table, lens, *weights, scale, layout=pool.layout)
    want, want_lse = absorb_chunked(*args, pool.reader(table, context), cpu_lens, *weights, scale)
    err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    lse_err = (lse - want_lse.to(lse.device)).abs().max().item()
    q_lat = fold_queries(x["q_nope"], x["w_uk"])
    core = (q_lat, x["q_pe"], pool.pages, table, lens, pool.layout, scale)
    fns = {
        "triton core": lambda: absorb_decode(*core),
        "triton full": lambda: absorb_paged(
            *args, pool.pages, table, lens, *weights, scale, layout=pool.layout
        ),
        "torch full": lambda: absorb_chunked(*args, pool.reader(table, context), cpu_lens, *weights, scale),
    }
    for text in extra_configs:
        kc = KernelConfig(*(int(v) for v in text.split("x")))
        fns[f"triton core {text}"] = lambda kc=kc: absorb_decode(*core, config=kc)
    for name, make in baselines.items():
        try:
            fn = make(q_lat, x["q_pe"], pool, table, lens, scale, fmt)
            if fn is not None:
                fns[name] = fn
        except Exception as e:  # a missing or incompatible baseline is a row with its error
            fns[name] = e
    bytes_, flops = traffic(pool, batch, heads, context)
    rows = []
    for name, fn in fns.items():
        row = {"format": fmt, "batch": batch, "context": context, "heads": heads, "backend": name}
        if name == "triton full":
            # the torch path dequantizes fp8 into bf16 (2^-9 per scale): a looser bar there
            row |= {"max_rel_err_vs_torch": err, "max_lse_err_vs_torch": lse_err}
            row["correct"] = err <= (5e-2 if fmt == "fp8" else 2e-2) and lse_err <= 5e-2
        try:
            if isinstance(fn, Exception):
                raise fn
            seconds = timer(fn)
            row |= {"ms": seconds * 1e3, "bytes_per_s": bytes_ / seconds, "flop_per_s": flops / seconds}
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return rows


def graph_check(pool, heads: int, layers: int, repeats: int) -> dict:
    """CUDA graphs: the kernel alone, and the planned N-layer decode step when the cache has plan()."""
    from mlakit.cache.paged import PagedLatentCache

    device = pool.pages.device
    out = {}
    if device.type == "cuda":
        out["kernel"] = _guard(lambda: kernel_graph(pool, heads, repeats))
    if hasattr(PagedLatentCache, "plan"):
        import gpu_decode_graph

        cfg = pool.cfg if device.type == "cuda" else tiny_stack_config()
        out["step"] = _guard(
            lambda: gpu_decode_graph.planned_step_graph(
                cfg, heads, layers, repeats, device, pool.layout.quant
            )
        )
    else:
        out["step"] = "skipped: no cache.plan() in this mlakit"
    return out


def tiny_stack_config() -> MLAConfig:
    return MLAConfig(hidden_size=64, num_heads=16, q_lora_rank=32, kv_lora_rank=256, qk_nope_head_dim=16,
                     qk_rope_head_dim=16, v_head_dim=16)  # fmt: skip


def _guard(fn):
    try:
        return fn()
    except Deadline:
        raise
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def kernel_graph(pool, heads: int, repeats: int) -> dict:
    """The kernel alone captured, replayed, compared with an eager call; it must follow kv_lens."""
    from mlakit.kernels import absorb_decode
    from mlakit.ops.absorb import fold_queries

    device = pool.pages.device
    batch, context = min(32, pool.table.shape[0]), min(8192, pool.table.shape[1] * BLOCK)
    table = pool.table[:batch, : context // BLOCK].contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    x = make_queries(pool.cfg, batch, heads, device)
    q_lat = fold_queries(x["q_nope"], x["w_uk"])
    core = (q_lat, x["q_pe"], pool.pages, table, lens, pool.layout, pool.cfg.softmax_scale)
    eager = absorb_decode(*core)
    graph, captured = capture(lambda: absorb_decode(*core))
    graph.replay()
    same = torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    lens.fill_(context - 100)  # the graph reads the lengths from the device: nothing was baked in
    graph.replay()
    follows = torch.equal(captured[0], absorb_decode(*core)[0])
    lens.fill_(context)
    seconds = Timer(device, repeats)(graph.replay)
    return {
        "batch": batch,
        "context": context,
        "heads": heads,
        "replay_equals_eager": same,
        "replay_follows_kv_lens": follows,
        "replay_ms": seconds * 1e3,
    }


def capture(fn):
    """(graph, outputs) of `fn` captured on a side stream after one warm-up call there (compiles)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def print_table(rows: list[dict], peak: float | None) -> None:
    cols = ("fmt", 5, "<"), ("H", 4, ">"), ("B", 4, ">"), ("T", 6, ">"), ("backend", 24, "<"), ("ms", 9, ">")
    cols += ("GB/s", 8, ">"), ("%HBM", 5, ">"), ("TFLOP/s", 8, ">")
    print(" ".join(f"{name:{align}{width}s}" for name, width, align in cols))
    for r in rows:
        key = f"{r['format']:5s} {r['heads']:4d} {r['batch']:4d} {r['context']:6d} {r['backend']:24s}"
        if "error" in r:
            print(f"{key} {r['error'][:60]}")
            continue
        pct = f"{100 * r['bytes_per_s'] / peak:5.1f}" if peak else "    -"
        note = ""
        if "correct" in r:
            note = f"  err {r['max_rel_err_vs_torch']:.1e} {'ok' if r['correct'] else 'WRONG'}"
        print(f"{key} {r['ms']:9.3f} {r['bytes_per_s'] / 1e9:8.1f} {pct} {r['flop_per_s'] / 1e12:8.1f}{note}")


class Deadline(Exception):
    pass


def run(args, device: torch.device, doc: dict) -> None:
    peak = doc["device"] = hbm_peak(device)
    ref_peak = peak["table"] or peak["measured"]
    timer = Timer(device, args.repeats)
    batches, contexts, heads_list = ints(args.batches), ints(args.contexts), ints(args.heads)
    extra = [c for c in args.configs.split(",") if c]
    baselines, skipped = gpu_decode_baselines.available()
    doc["skipped"] = skipped
    for line in skipped:
        print(f"skipped: {line}")
    for fmt in args.formats.split(","):
        try:
            pool = Pool(fmt, max(batches), max(contexts), device)
        except Exception as e:
            doc["errors"].append(f"pool {fmt}: {type(e).__name__}: {e}")
            continue
        for heads in heads_list:
            for batch in batches:
                for context in contexts:
                    try:
                        doc["rows"].extend(
                            check_and_time(pool, fmt, batch, context, heads, timer, extra, baselines)
                        )
                    except Deadline:
                        raise
                    except Exception as e:
                        doc["errors"].append(f"{fmt} H{heads} B{batch} T{context}: {type(e).__name__}: {e}")
                        traceback.print_exc()
        if fmt == args.formats.split(",")[0]:
            doc["graph"] = graph_check(pool, heads_list[0], args.layers, args.repeats)
        del pool
        print_table([r for r in doc["rows"] if r["format"] == fmt], ref_peak)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    from mlakit.kernels import available

    device = torch.device(args.device)
    if not available(device):
        print(
            f"skipped: the kernel cannot run on {device} (Triton missing, or TRITON_INTERPRET unset on a CPU)"
        )
        return 0
    doc = {"args": vars(args), "torch": torch.__version__, "rows": [], "errors": [], "graph": None}
    doc["triton"] = __import__("triton").__version__

    def on_alarm(signum, frame):
        raise Deadline(f"stopped after {args.timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    try:
        run(args, device, doc)
    except Deadline as e:
        doc["errors"].append(str(e))
        print(e)
    finally:
        signal.alarm(0)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    print(f"graph: {doc['graph']}")
    for e in doc["errors"]:
        print(f"error: {e}")
    print(f"wrote {args.json} ({doc['device']['name'] if 'device' in doc else device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

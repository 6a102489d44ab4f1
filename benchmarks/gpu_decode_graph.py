"""The planned decode step of an N-layer MLA stack as one CUDA graph, the kernel inside.

`cache.plan(1, mode="absorb")` once on the host; then every layer reads the plan's device tensors
(positions, rope tables, write rows, block table, kv_lens) and launches the kernel — nothing read
back — so the whole step captures. The replay is checked against the eager step (bit for bit: the
step writes the same rows again) and timed against it, for the Triton and the torch backends.
"""

from __future__ import annotations

import time

import torch

from mlakit import MLAAttention, MLAConfig, PagedLatentCache

BLOCK = 64


def build_stack(cfg: MLAConfig, layers: int, batch: int, context: int, quant, device, seed: int = 0):
    """(layers, cache): bf16 layers with small random weights, a paged cache of `context` tokens a row."""
    torch.manual_seed(seed)
    stack = []
    for i in range(layers):
        layer = MLAAttention(cfg, layer_idx=i, device=device, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() == 2:
                    p.normal_(0, p.shape[1] ** -0.5)
        stack.append(layer)
    blocks = batch * (-(-(context + 1) // BLOCK) + 1)
    cache = PagedLatentCache(
        cfg,
        blocks,
        BLOCK,
        max_batch=batch,
        num_layers=layers,
        dtype=torch.bfloat16,
        quant=quant,
        device=device,
    )
    plan = cache.plan(context, mode="absorb")
    for i in range(layers):
        c_kv = torch.randn(batch, context, cfg.kv_lora_rank, device=device, dtype=torch.bfloat16)
        k_pe = torch.randn(batch, context, cfg.qk_rope_head_dim, device=device, dtype=torch.bfloat16)
        cache.write(plan, i, c_kv, k_pe)
    cache.commit(plan)
    return stack, cache


def step(stack, plan, hidden: torch.Tensor) -> torch.Tensor:
    h = hidden
    with torch.no_grad():
        for layer in stack:
            h = h + layer(h, plan)
    return h


def planned_step_graph(cfg: MLAConfig, heads: int, layers: int, repeats: int, device, quant=None) -> dict:
    """Capture, replay, compare and time one planned decode step (B 32, 8K context) per backend."""
    cfg = cfg.replace(num_heads=heads)
    batch, context = 32, 8192
    if device.type != "cuda":
        batch, context = 2, 100  # the script itself, under the interpreter
    stack, cache = build_stack(cfg, layers, batch, context, quant, device)
    hidden = torch.randn(batch, 1, cfg.hidden_size, device=device, dtype=torch.bfloat16) * 0.1
    result = {"what": f"planned decode step, {layers} layers", "batch": batch, "context": context}
    result["heads"] = heads
    for backend in ("triton", "torch"):
        for layer in stack:
            layer.absorb_backend = backend
        plan = cache.plan(1, mode="absorb")
        eager = step(stack, plan, hidden)
        result[f"{backend}_plan_backend"] = plan.backend
        result[f"{backend}_eager_ms"] = _time(lambda plan=plan: step(stack, plan, hidden), device, repeats)
        if device.type == "cuda":
            graph, out = _capture(lambda plan=plan: step(stack, plan, hidden))
            graph.replay()
            torch.cuda.synchronize()
            result[f"{backend}_replay_equals_eager"] = bool(torch.equal(out, eager))
            result[f"{backend}_replay_ms"] = _time(graph.replay, device, repeats)
        cache.discard(plan)
    return result


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles the kernels and warms the allocator outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _time(fn, device, repeats: int) -> float:
    """Median ms of fn() (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]

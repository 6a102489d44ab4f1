"""DeepSeek Sparse Attention decode at DeepSeek-V3.2 widths: mlakit's sparse absorb against dense absorb and
against transformers' DeepseekV32Attention, with the indexer's share of the step.

    PYTHONPATH=. python benchmarks/sparse_decode.py [--quick] [--threads N] [--json PATH]

1. Core (one layer, batch 1, bf16 cache): the attention over a cached context of 32K and 128K tokens,
   sparse (indexer scores over every cached indexer key + top-k + absorb over the 2,048 gathered
   latents) against mlakit's dense absorb over the whole latent cache; the projections are the same
   for both and are timed once and added to each step.
2. Layer (16K cached, batch 1): mlakit's DSA layer step (MLAAttention, bf16) against transformers'
   DeepseekV32Attention step (eager, its own DynamicCache with the indexer keys; fp32 weights, its
   fastest dtype on a CPU without native bf16 GEMMs), both over the same random latents and indexer keys.

A correctness gate compares each sparse step with the fp32 dense masked form over the same selection
before timing. The multiply-add model's prediction (mlakit.cost.sparse) is printed beside each ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from mlakit import MLAConfig
from mlakit.cost import dsa_decode_summary
from mlakit.indexer import Indexer
from mlakit.ops import absorb
from mlakit.ops.sparse import index_scores, select_topk, sparse_absorb
from mlakit.rope import RotaryTable

# mlakit's layer step at the transformers context: bf16 (weights and cache) and fp32 (transformers' dtype)
LAYER_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GATE_REL = 2e-2  # bf16 cache, fp32 compute: the two forms round differently, never by this much


def timed(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def random_context(cfg: MLAConfig, cached: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Latents, rope keys and indexer keys of `cached` tokens, and one decode query."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    h, hi = cfg.num_heads, cfg.index_n_heads
    return {
        "c_kv": r(1, cached, cfg.kv_lora_rank),
        "k_pe": r(1, cached, cfg.qk_rope_head_dim),
        "k_idx": r(1, cached, cfg.index_head_dim),
        "q_nope": r(1, 1, h, cfg.qk_nope_head_dim),
        "q_pe": r(1, 1, h, cfg.qk_rope_head_dim),
        "q_idx": r(1, 1, hi, cfg.index_head_dim),
        "w": torch.randn(1, 1, hi, generator=g),
        "w_uk": torch.randn(h, cfg.qk_nope_head_dim, cfg.kv_lora_rank, generator=g) / cfg.kv_lora_rank**0.5,
        "w_uv": torch.randn(h, cfg.v_head_dim, cfg.kv_lora_rank, generator=g) / cfg.kv_lora_rank**0.5,
        "kv_lens": torch.tensor([cached]),
    }


def sparse_step(cfg, c, scale):
    scores = index_scores(c["q_idx"], c["w"], c["k_idx"], c["kv_lens"])
    idx = select_topk(scores, cfg.index_topk)
    args = (c["q_nope"], c["q_pe"], c["c_kv"], c["k_pe"], c["kv_lens"], c["w_uk"], c["w_uv"], scale)
    return sparse_absorb(*args, indices=idx), idx


def indexer_step(cfg, c):
    return select_topk(index_scores(c["q_idx"], c["w"], c["k_idx"], c["kv_lens"]), cfg.index_topk)


def dense_step(c, scale):
    args = (c["q_nope"], c["q_pe"], c["c_kv"], c["k_pe"], c["kv_lens"], c["w_uk"], c["w_uv"], scale)
    return absorb(*args)


def gate(cfg, c, scale) -> float:
    """The sparse step against fp32 dense absorb over the selected rows gathered by hand."""
    (out, _), idx = sparse_step(cfg, c, scale)
    rows = idx[0, 0]
    assert bool((rows >= 0).all()) and rows.unique().numel() == rows.numel()
    c_sel, k_sel = c["c_kv"][:, rows].float(), c["k_pe"][:, rows].float()
    q = (c["q_nope"].float(), c["q_pe"].float())
    want, _ = absorb(*q, c_sel, k_sel, torch.tensor([rows.numel()]), c["w_uk"], c["w_uv"], scale)
    rel = ((out.float() - want).abs().max() / want.abs().max()).item()
    if not rel < GATE_REL:
        raise SystemExit(
            f"gate failed: sparse absorb vs absorb over the gathered rows, relative error {rel:.3g}"
        )
    return rel


def core_case(cfg, cached, dtype, repeats, projections_s):
    c = random_context(cfg, cached, dtype)
    scale = cfg.softmax_scale
    with torch.inference_mode():
        rel = gate(cfg, c, scale)
        sparse = statistics.median(timed(lambda: sparse_step(cfg, c, scale), repeats))
        index = statistics.median(timed(lambda: indexer_step(cfg, c), repeats))
        dense = statistics.median(timed(lambda: dense_step(c, scale), repeats))
    model = dsa_decode_summary(cfg, cached)
    return {
        "cached": cached,
        "sparse_core_ms": sparse * 1e3,
        "indexer_ms": index * 1e3,
        "dense_core_ms": dense * 1e3,
        "projections_ms": projections_s * 1e3,
        "core_speedup": dense / sparse,
        "step_speedup": (dense + projections_s) / (sparse + projections_s),
        "indexer_share_of_sparse_step": index / (sparse + projections_s),
        "indexer_share_of_sparse_core": index / sparse,
        "model_core_speedup": model["core"]["ratio"],
        "model_step_speedup": model["all_terms"]["ratio"],
        "model_indexer_share": model["core"]["indexer_share"],
        "gate_rel_error": rel,
    }


def projection_time(cfg: MLAConfig, dtype: torch.dtype, repeats: int) -> float:
    """The projections of one decode token (MLA's and the indexer's), mlakit's Linear, `dtype` weights."""
    from mlakit import MLAAttention

    dense_cfg = cfg.replace(
        index_n_heads=None, index_head_dim=None, index_topk=None, indexer_rope_interleave=None
    )
    layer = MLAAttention(dense_cfg, dtype=dtype).eval()
    indexer = Indexer(cfg, dtype=dtype).eval()
    rope = RotaryTable(cfg)
    x = torch.randn(1, 1, cfg.hidden_size).to(dtype)
    cos, sin = rope.cos_sin(torch.tensor([[100]]))
    o_in = torch.zeros(1, 1, layer.o_proj.in_features, dtype=dtype)

    def run():
        q_resid = layer.q_a_layernorm(layer.q_a_proj(x))
        layer.q_b_proj(q_resid)
        layer.kv_a_proj_with_mqa(x)
        indexer(x, q_resid, cos, sin)
        layer.o_proj(o_in)

    with torch.inference_mode():
        return statistics.median(timed(run, repeats))


def layer_step(cfg, cached, dtype, repeats) -> float:
    """mlakit's DSA layer (MLAAttention, `dtype` weights and cache): one decode step at `cached` tokens."""
    from mlakit import LatentCache, MLAAttention

    torch.manual_seed(0)
    layer = MLAAttention(cfg, dtype=dtype).eval()
    cache = LatentCache(cfg, 1, cached + 1, dtype=dtype)
    c = random_context(cfg, cached, dtype)
    with torch.inference_mode():
        cache.append(c["c_kv"], c["k_pe"])
        cache._i_rows[0, :cached] = c["k_idx"][0]  # the indexer keys of the same tokens
        x = torch.randn(1, 1, cfg.hidden_size).to(dtype)

        ran = {}

        def step():
            _, ran["plan"] = layer.step(x, cache)
            cache.lengths -= 1

        seconds = statistics.median(timed(step, repeats))
    if ran["plan"].mode != "sparse-absorb":
        raise SystemExit(f"the layer ran {ran['plan'].mode!r}, expected sparse-absorb")
    return seconds


def hf_case(cfg, cached, repeats, mlakit_step_ms):
    """transformers' DeepseekV32Attention decode step at `cached` tokens (fp32, eager)."""
    import transformers
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    config = transformers.DeepseekV32Config(num_hidden_layers=1, max_position_embeddings=cached + 8)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = m.DeepseekV32Attention(config, layer_idx=0).eval()
    rotary = m.DeepseekV32RotaryEmbedding(config)
    cache = transformers.DynamicCache(config=config)
    c = random_context(cfg, cached, torch.float32)
    with torch.inference_mode():
        cache.update(c["c_kv"][:, None], c["k_pe"][:, None], 0)
        cache.layers[0].update_indexer(c["k_idx"])
        x = torch.randn(1, 1, cfg.hidden_size)
        pe = rotary(x, torch.tensor([[cached]]))
        mask = torch.zeros(1, 1, 1, cached + 1)

        def step():
            attn(hidden_states=x, position_embeddings=pe, attention_mask=mask, cache=cache)
            cache.crop(-1)

        hf = statistics.median(timed(step, repeats))
    return {"cached": cached, "transformers_step_ms": hf * 1e3, "mlakit_step_ms": mlakit_step_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats per case (default 5)")
    ap.add_argument("--contexts", default="32768,131072", help="cached tokens of the core cases")
    ap.add_argument("--hf-context", type=int, default=16384, help="cached tokens of the transformers case")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else 5
    cfg = MLAConfig.preset("deepseek-v3.2")
    dtype = torch.bfloat16
    threads = torch.get_num_threads()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {threads} threads"
    widths = f"H {cfg.num_heads}, H_I {cfg.index_n_heads}, k {cfg.index_topk}"
    print(f"DSA decode, DeepSeek-V3.2 widths ({widths}), bf16 cache")
    print(f"torch {torch.__version__}; machine: {machine}; load {os.getloadavg()[0]:.1f}")
    proj = projection_time(cfg, dtype, repeats)
    rows = []
    for cached in (int(v) for v in args.contexts.split(",") if v):
        r = core_case(cfg, cached, dtype, repeats, proj)
        rows.append(r)
        print(
            f"T {cached:>7,}: sparse core {r['sparse_core_ms']:.1f} ms (indexer {r['indexer_ms']:.1f} ms), "
            f"dense absorb core {r['dense_core_ms']:.1f} ms -> {r['core_speedup']:.1f}x "
            f"(model {r['model_core_speedup']:.1f}x); with projections ({r['projections_ms']:.1f} ms) "
            f"{r['step_speedup']:.1f}x (model {r['model_step_speedup']:.1f}x); indexer "
            f"{r['indexer_share_of_sparse_step']:.0%} of the sparse step, "
            f"{r['indexer_share_of_sparse_core']:.0%} of its core (model {r['model_indexer_share']:.0%})"
        )
    hf_rows = []
    if args.hf_context:
        mine = {
            name: layer_step(cfg, args.hf_context, dt, repeats) * 1e3 for name, dt in LAYER_DTYPES.items()
        }
        h = hf_case(cfg, args.hf_context, max(1, repeats // 2), mine)
        hf_rows.append(h)
        theirs = h["transformers_step_ms"]
        print(
            f"T {args.hf_context:>7,}: transformers DeepseekV32Attention step {theirs:.0f} ms (fp32, eager); "
            + ", ".join(
                f"mlakit MLAAttention {n} {ms:.1f} ms -> {theirs / ms:.0f}x" for n, ms in mine.items()
            )
            + " (sparse-absorb)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine, "torch": torch.__version__, "core": rows, "hf": hf_rows}, f, indent=2
            )


if __name__ == "__main__":
    main()

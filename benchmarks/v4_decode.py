"""DeepSeek-V4 decode at V4-Flash widths: mlakit's V4Attention against transformers' DeepseekV4Attention
(eager, its own cache) and against mlakit's own DeepSeek-V3.2 DSA layer at the same context.

    PYTHONPATH=. python benchmarks/v4_decode.py [--quick] [--threads N] [--contexts 8K,64K,128K] [--json PATH]

One layer of each type (window, CSA, HCA), bf16 weights and cache, batch 1, one new token over a
cached context. Both V4 caches are filled with the same random state (window entries, compressed
entries, indexer keys) instead of a prefill; a correctness gate compares the first step of both before
timing. Each timed step is undone (mlakit: an exact rollback; transformers: its cache layer's state put
back) so every repeat sees the same context. The DSA layer is MLAAttention at DeepSeek-V3.2 widths over
a LatentCache holding the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from mlakit.v4 import V4Attention, V4Cache, V4Config
from mlakit.v4.config import CSA, HCA, SLIDING

KINDS = (SLIDING, CSA, HCA)
GATE_REL = 3e-2  # bf16 weights and cache on both sides; the two round differently, never by this much


def timed(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def hf_config():
    import transformers

    c = transformers.DeepseekV4Config(
        num_hidden_layers=3,
        layer_types=list(KINDS),
        rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
    )
    c._attn_implementation = "eager"
    return c


def layers(kind_idx: int, dtype):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    torch.manual_seed(kind_idx)
    cfg = hf_config()
    ref = DeepseekV4Attention(cfg, kind_idx).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name.endswith(("sinks", "position_bias")) else 0.02))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    freqs = {n: b.clone() for n, b in ref.named_buffers() if n.endswith("inv_freq")}
    ref = ref.to(dtype)
    # transformers' rotary buffers follow the module's dtype; keep them fp32, as a bf16 checkpoint
    # loaded by from_pretrained does and as mlakit does, so both rotate by the same angles
    for name, b in freqs.items():
        owner, _, attr = name.rpartition(".")
        setattr(ref.get_submodule(owner), attr, b)
    ours = V4Attention(V4Config.from_hf(cfg), layer_idx=kind_idx).to(dtype).eval()
    ours.load_state_dict(ref.state_dict())
    return cfg, ref, ours


def random_state(cfg: V4Config, kind: str, cached: int, dtype, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = cached // cfg.ratio(kind) if kind != SLIDING else 0
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return {
        "window": r(cfg.sliding_window - 1, cfg.head_dim),  # positions cached-127 .. cached-1
        "entries": r(n, cfg.head_dim),
        "index": r(n, cfg.index_head_dim) if kind == CSA else None,
    }


def fill_ours(ours: V4Attention, state: dict, cached: int, dtype) -> V4Cache:
    cfg, idx = ours.cfg, ours.layer_idx
    cache = V4Cache(cfg, 1, cached + 64, dtype=dtype, layers=[idx])
    st = cache.state[idx]
    w = cfg.sliding_window
    for i, p in enumerate(range(cached - w + 1, cached)):
        st["window"][p % cache.ring(SLIDING)] = state["window"][i]
    n = state["entries"].shape[0]
    if n:
        st["store"][:n] = state["entries"]
    if state["index"] is not None:
        st["index_store"][:n] = state["index"]
    cache.lengths[0] = cached
    cache.high[0] = cached
    return cache


def fill_theirs(hf_cfg, kind_idx: int, state: dict, cached: int):
    import transformers

    cache = transformers.DynamicCache(config=hf_cfg)
    layer = cache.layers[kind_idx]
    win = state["window"][None, None]
    layer.lazy_initialization(win, win)
    layer.keys = layer.values = win
    layer.cumulative_length = cached
    if hasattr(layer, "compressed_kv"):
        layer.compressed_kv["compressor"] = state["entries"][None]
        layer.entry_count["compressor"] = state["entries"].shape[0]
        if state["index"] is not None:
            layer.compressed_kv["indexer"] = state["index"][None]
            layer.entry_count["indexer"] = state["index"].shape[0]
    for other in range(len(cache.layers)):  # the layers this benchmark does not run hold nothing
        if other != kind_idx:
            cache.layers[other].cumulative_length = 0
    return cache


def snapshot(layer) -> dict:
    saved = {k: v for k, v in vars(layer).items() if not isinstance(v, dict)}
    saved.update({k: dict(v) for k, v in vars(layer).items() if isinstance(v, dict)})
    return saved


def hf_step_fn(hf_cfg, ref, cache, x, cached):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rot = DeepseekV4RotaryEmbedding(hf_cfg)
    pos = torch.tensor([[cached]])
    emb = {
        k: tuple(t.to(x.dtype) for t in rot(x, position_ids=pos, layer_type=k)) for k in ("main", "compress")
    }
    mask = torch.zeros(1, 1, 1, hf_cfg.sliding_window, dtype=x.dtype)
    layer = cache.layers[ref.layer_idx]
    saved = snapshot(layer)

    def step():
        out = ref(x, emb, pos, mask, cache=cache)[0]
        layer.__dict__.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in saved.items()})
        return out

    return step


def ours_step_fn(ours, cache, x, cached):
    def step():
        plan = cache.plan(1)
        out = ours(x, plan)
        cache.commit(plan)
        cache.rollback(0, cached)
        return out

    return step


def dsa_step_ms(cached: int, repeats: int, dtype) -> float:
    """mlakit's DeepSeek-V3.2 DSA layer (MLAAttention + LatentCache), one decode step at `cached`."""
    from mlakit import LatentCache, MLAAttention, MLAConfig

    cfg = MLAConfig.preset("deepseek-v3.2")
    torch.manual_seed(0)
    layer = MLAAttention(cfg, dtype=dtype).eval()
    cache = LatentCache(cfg, 1, cached + 1, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        cache.append(
            torch.randn(1, cached, cfg.kv_lora_rank, generator=g).to(dtype),
            torch.randn(1, cached, cfg.qk_rope_head_dim, generator=g).to(dtype),
        )
        cache._i_rows[0, :cached] = torch.randn(cached, cfg.index_head_dim, generator=g).to(dtype)
        x = torch.randn(1, 1, cfg.hidden_size).to(dtype)

        def step():
            layer(x, cache)
            cache.lengths -= 1

        return statistics.median(timed(step, repeats)) * 1e3


def case(kind_idx: int, cached: int, repeats: int, dtype) -> dict:
    hf_cfg, ref, ours = layers(kind_idx, dtype)
    kind = KINDS[kind_idx]
    state = random_state(ours.cfg, kind, cached, dtype)
    x = (torch.randn(1, 1, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(7))).to(dtype)
    picked = []
    if kind == CSA:
        ours.compressor.indexer.register_forward_hook(lambda m, a, out: picked.append(("ours", out)))
        ref.compressor.indexer.register_forward_hook(lambda m, a, out: picked.append(("hf", out)))
    with torch.inference_mode():
        mine = ours_step_fn(ours, fill_ours(ours, state, cached, dtype), x, cached)
        theirs = hf_step_fn(hf_cfg, ref, fill_theirs(hf_cfg, kind_idx, state, cached), x, cached)
        a, b = mine().float(), theirs().float()
        rel = float((a - b).abs().max() / b.abs().max())
        agree = _agreement(picked) if picked else 1.0
        # bf16 rounds the indexer's scores differently on the two sides: near-ties may swap a few picks
        if not (rel < GATE_REL or (agree >= 0.97 and rel < 0.15)):
            raise SystemExit(
                f"{kind} at {cached}: mlakit and transformers differ by {rel:.3e} (gate {GATE_REL}), "
                f"{agree:.1%} of the CSA selection shared"
            )
        ours_ms = statistics.median(timed(mine, repeats)) * 1e3
        hf_ms = statistics.median(timed(theirs, repeats)) * 1e3
    return {
        "kind": kind,
        "cached": cached,
        "gate_rel": rel,
        "selection_shared": agree,
        "mlakit_ms": ours_ms,
        "transformers_ms": hf_ms,
    }


def _agreement(picked) -> float:
    """Share of transformers' CSA picks that mlakit also picked (the first step of each side)."""
    idx, valid = next(out for who, out in picked if who == "ours")
    hf = next(out for who, out in picked if who == "hf")
    if idx is None:
        mine = set(torch.nonzero(valid[0, -1]).flatten().tolist())
    else:
        mine = set(idx[0, -1][valid[0, -1]].tolist())
    theirs = {i for i in hf[0, -1].tolist() if i >= 0}
    return len(mine & theirs) / max(len(theirs), 1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def parse_contexts(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        mult = {"K": 1024, "M": 1 << 20}.get(part[-1:], 1)
        out.append(int(part.rstrip("KM")) * mult)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8K only, 3 repeats")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", default="8K,64K,128K")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [8192] if args.quick else parse_contexts(args.contexts)
    repeats = 3 if args.quick else args.repeats
    dtype = torch.bfloat16
    rows = []
    where = _cpu_name()
    print(f"V4-Flash widths, bf16, batch 1, {args.threads} thread(s), {where}; load {os.getloadavg()}")
    head = f"{'layer':<30} {'cached':>8} {'mlakit ms':>10} {'transformers ms':>16} {'speedup':>8}"
    print(head + f" {'DSA V3.2 ms':>12} {'gate':>9} {'shared':>7}")
    for cached in contexts:
        dsa = dsa_step_ms(cached, repeats, dtype)
        for i in range(len(KINDS)):
            r = case(i, cached, repeats, dtype)
            r["dsa_v32_ms"] = dsa
            rows.append(r)
            print(
                f"{r['kind']:<30} {cached:>8,} {r['mlakit_ms']:>10.2f} {r['transformers_ms']:>16.2f} "
                f"{r['transformers_ms'] / r['mlakit_ms']:>7.1f}x {dsa:>12.2f} {r['gate_rel']:>9.1e} "
                f"{r['selection_shared']:>7.1%}"
            )
    if args.json:
        meta = {
            "machine": _cpu_name(),
            "threads": args.threads,
            "torch": torch.__version__,
            "load": os.getloadavg(),
            "dtype": "bf16",
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

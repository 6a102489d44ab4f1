"""fp8 and int8 latent caches against the exact cache: decode-output error on a grid of contexts.

A DeepSeek-V3-wide layer with seeded weights (N(0, 1/fan_in), norm gains 1 ± 0.3) computes in fp32;
its cache is filled with the projected latents of random hidden states (positions 0..T-1), then it
decodes one token per row through an exact, an fp8 and an int8 PagedLatentCache. Printed per cell:
max |err| / max |exact| (the tests' measure) and ||err|| / ||exact||, of the layer's output.

    PYTHONPATH=$PWD python benchmarks/quant_error.py
"""

from __future__ import annotations

import argparse
import json

import torch

from mlakit import MLAAttention, MLAConfig
from mlakit.cache.paged import PagedLatentCache
from mlakit.cache.quant import dequantize, quantize


def seeded_layer(cfg: MLAConfig, seed: int) -> MLAAttention:
    layer = MLAAttention(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return layer.eval()


def filled(layer, quant, hidden, block_size=64) -> PagedLatentCache:
    cfg = layer.cfg
    batch, context, _ = hidden.shape
    cache = PagedLatentCache(
        cfg, batch * (context // block_size + 2), block_size, max_batch=batch, quant=quant
    )
    cache.append(*latents(layer, hidden))
    return cache


def latents(layer, hidden) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache entries of hidden [B,T,D] at positions 0..T-1: the kv half of `layer.project`."""
    cfg = layer.cfg
    with torch.no_grad():
        latent = layer.kv_a_proj_with_mqa(hidden)
        c_kv, k_pe = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        cos, sin = layer.rope.cos_sin(torch.arange(hidden.shape[1]).expand(hidden.shape[:2]))
        return layer.kv_a_layernorm(c_kv), layer.rope.apply(k_pe, cos, sin)


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    err = (got - want).double()
    return (err.abs().max() / want.abs().max()).item(), (err.norm() / want.double().norm()).item()


def latent_error(layer, hidden, quant) -> float:
    """||dequant(quant(c)) - c|| / ||c|| over the normalized latents themselves."""
    c_kv, _ = latents(layer, hidden)
    flat = c_kv.reshape(-1, c_kv.shape[-1])
    back = dequantize(*quantize(flat, quant), torch.float32)
    return ((back - flat).norm() / flat.norm()).item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--contexts", default="1,16,256,2048")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = MLAConfig.resolve(args.model)
    rows = []
    print(
        f"{cfg.name}, fp32 compute, batch {args.batch}, decode of 1 token; error of the layer output vs exact"
    )
    head = ("context", "seed", "mode", "fp8 max", "fp8 norm", "int8 max", "int8 norm")
    print("".join(f"{h:>{w}}" for h, w in zip(head, (8, 5, 12, 10, 10, 10, 10), strict=True)))
    for seed in range(args.seeds):
        layer = seeded_layer(cfg, seed)
        for context in [int(c) for c in args.contexts.split(",")]:
            g = torch.Generator().manual_seed(1000 * seed + context)
            hidden = torch.randn(args.batch, context, cfg.hidden_size, generator=g)
            step = torch.randn(args.batch, 1, cfg.hidden_size, generator=g)
            caches = {q: filled(layer, q, hidden) for q in (None, "fp8", "int8")}
            for mode in ("absorb", "materialize"):
                with torch.no_grad():
                    outs = {}
                    for q, cache in caches.items():
                        outs[q] = layer(step, cache, mode=mode)
                        cache.lengths[:] = context  # drop the decoded token again
                cell = {q: errors(outs[q], outs[None]) for q in ("fp8", "int8")}
                rows.append({"context": context, "seed": seed, "mode": mode} | {q: cell[q] for q in cell})
                print(
                    f"{context:>8}{seed:>5}{mode:>12}{cell['fp8'][0]:>10.2e}{cell['fp8'][1]:>10.2e}"
                    f"{cell['int8'][0]:>10.2e}{cell['int8'][1]:>10.2e}"
                )
        if seed == 0:
            lat = {q: latent_error(layer, hidden, q) for q in ("fp8", "int8")}
    worst = {q: max(r[q][0] for r in rows) for q in ("fp8", "int8")}
    print(f"worst max-relative: fp8 {worst['fp8']:.2e} (bound 6e-2), int8 {worst['int8']:.2e} (bound 2e-2)")
    print(f"latent round trip, ||err||/||c||: fp8 {lat['fp8']:.2e}, int8 {lat['int8']:.2e}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows, "latent": lat}, f, indent=1)


if __name__ == "__main__":
    main()

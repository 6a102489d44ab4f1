"""Context-parallel and tensor-parallel MLA under torchrun.

    torchrun --nproc-per-node 2 examples/cp_torchrun.py [--model minicpm3-4b] [--context 300]

gloo on CPU; NCCL when CUDA is present (one GPU per rank, LOCAL_RANK picks it). Every rank builds the
same seeded fp32 layer; the sequence's latent cache is spread over the ranks in round-robin blocks,
prefilled in chunks and decoded; then the heads are split instead (tensor parallel, cache replicated).
Rank 0 compares both with the single-process layer and prints what each rank holds.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.distributed import ContextParallelMLA, TensorParallelMLA


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="minicpm3-4b", help="preset name (default minicpm3-4b)")
    p.add_argument("--context", type=int, default=300, help="prompt tokens (default 300)")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=128, help="prompt tokens per forward call")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait")
    return p.parse_args()


def setup(timeout_s: float) -> torch.device:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def run_calls(layer, cache, prompt, steps, chunk) -> torch.Tensor:
    with torch.inference_mode():
        outs = [layer(prompt[:, a : a + chunk], cache) for a in range(0, prompt.shape[1], chunk)]
        outs += [layer(x, cache) for x in steps]
    return torch.cat(outs, dim=1)  # [1, context + steps, D]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def main() -> None:
    args = parse()
    device = setup(args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MLAConfig.preset(args.model)
    torch.manual_seed(0)
    layer = MLAAttention(cfg).eval().to(device)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randn(1, args.context, cfg.hidden_size, generator=gen).to(device)
    steps = [torch.randn(1, 1, cfg.hidden_size, generator=gen).to(device) for _ in range(args.decode_steps)]
    total = args.context + args.decode_steps

    cp = ContextParallelMLA(layer, block_size=args.block_size)
    cp_cache = cp.new_cache(1, total)
    cp_out = run_calls(cp, cp_cache, prompt, steps, args.chunk)
    tp = TensorParallelMLA.from_layer(layer)
    tp_cache = LatentCache(cfg, 1, total, device=device)
    tp_out = run_calls(tp, tp_cache, prompt, steps, args.chunk)
    held = torch.tensor([int(cp_cache.local.lengths.sum()), int(tp_cache.lengths.sum())], device=device)
    every = [torch.empty_like(held) for _ in range(world)]
    dist.all_gather(every, held)

    if rank == 0:
        want = run_calls(layer, LatentCache(cfg, 1, total, device=device), prompt, steps, args.chunk)
        print(
            f"{cfg.name}, {world} ranks ({dist.get_backend()}), {args.context} + {args.decode_steps} tokens"
        )
        print(f"context parallel: max rel err {rel_err(cp_out, want):.2e}")
        print(f"tensor parallel:  max rel err {rel_err(tp_out, want):.2e}")
        per_token = cfg.latent_dim * 4
        for r, h in enumerate(every):
            cp_tok, tp_tok = h.tolist()
            print(
                f"rank {r}: CP holds {cp_tok} tokens ({cp_tok * per_token} B), "
                f"TP holds {tp_tok} tokens ({tp_tok * per_token} B)"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

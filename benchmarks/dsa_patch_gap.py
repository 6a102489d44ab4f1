"""Patched vs unpatched tiny random DeepSeek-V3.2 models, printed, never asserted:
the prefill-logit gap and whether greedy tokens agree, in fp32 and bf16, for indexers that tie
(`--index-heads 1`: many keys score exactly 0.0 after the ReLU) or rarely tie (8 heads).

    PYTHONPATH=. python benchmarks/dsa_patch_gap.py [--dtype bfloat16] [--index-heads 1] [--new 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

import mlakit.hf as mhf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_hf_dsa import PAD, TINY  # noqa: E402

CASES = [(8, 40, 0), (32, 80, 1), (64, 100, 2)]  # (index_topk, prompt tokens, seed)


def model(topk: int, heads: int, seed: int, dtype):
    config = transformers.DeepseekV32Config(**dict(TINY, index_n_heads=heads), index_topk=topk)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = transformers.DeepseekV32ForCausalLM(config).eval().to(dtype)
    m.generation_config.pad_token_id = PAD
    m.generation_config.eos_token_id = None
    return m


def run(m, ids, new: int):
    with torch.no_grad():
        logits = m(ids).logits.float()
        tokens = m.generate(ids, max_new_tokens=new, do_sample=False)[:, ids.shape[1] :]
    return logits, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--index-heads", type=int, default=1)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {args.index_heads} index head(s), {args.new} new tokens")
    print(f"{'index_topk':>10} {'prompt':>7} {'prefill gap':>12} {'scale':>7} {'same tokens':>12}")
    for topk, n, seed in CASES:
        m = model(topk, args.index_heads, seed, dtype)
        ids = torch.randint(4, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))
        want, want_tokens = run(m, ids, args.new)
        mhf.patch(m)
        got, got_tokens = run(m, ids, args.new)
        gap = (got - want).abs().max().item()
        same = bool(torch.equal(got_tokens, want_tokens))
        print(f"{topk:>10} {n:>7} {gap:>12.3g} {want.abs().max().item():>7.3g} {same!s:>12}")


if __name__ == "__main__":
    main()

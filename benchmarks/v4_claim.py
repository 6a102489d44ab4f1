"""The article's claim, from mlakit's cost model: V4-Pro against V3.2 (and V3) per decoded token.

*From MHA to MLA* quotes the DeepSeek-V4 paper: at 1M context V4-Pro needs about 27% of V3.2's per-token
inference FLOPs and about 10% of its KV cache. This prints mlakit's figures from the published
configs at 8K, 128K and 1M, for a bf16 and an fp8 cache, and the terms behind the difference.

    python benchmarks/v4_claim.py [--json]
"""

from __future__ import annotations

import argparse
import json

from mlakit.cost.v4 import compare, model_cost
from mlakit.v4.config import V4Config

CONTEXTS = {"8K": 8192, "128K": 131072, "1M": 1 << 20}
# published active parameters per token (model cards): what a whole-model FLOP count adds, 2 per param
ACTIVE = {"deepseek-v4-pro": 49e9, "deepseek-v3.2": 37e9, "deepseek-v3": 37e9}


def table(dtype: str) -> list[dict]:
    pro = V4Config.preset("deepseek-v4-pro")
    rows = []
    for label, t in CONTEXTS.items():
        c = compare(pro, t, 1, dtype)
        for name, r in c.items():
            whole = r["flops"] + 2 * ACTIVE[name]
            rows.append({"context": label, "model": name, **r, "flops_with_active_params": whole})
        base = next(r for r in rows if r["context"] == label and r["model"] == "deepseek-v3.2")
        for r in rows:
            if r["context"] == label:
                r["whole_vs_v3.2"] = r["flops_with_active_params"] / base["flops_with_active_params"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = {dtype: table(dtype) for dtype in ("bf16", "fp8")}
    pro = V4Config.preset("deepseek-v4-pro")
    out["terms_at_1M"] = {k: v["macs"] for k, v in model_cost(pro, 1 << 20)["terms"].items()}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for dtype in ("bf16", "fp8"):
        print(f"cache {dtype}; FLOPs per decoded token over every attention layer (2 per multiply-add)")
        print(
            f"{'context':>7} {'model':<16} {'GFLOPs':>10} {'vs V3.2':>8} {'+2·active':>10} {'vs V3.2':>8}"
            f" {'cache/seq':>11} {'vs V3.2':>8}"
        )
        for r in out[dtype]:
            print(
                f"{r['context']:>7} {r['model']:<16} {r['flops'] / 1e9:>10,.1f} {r['flops_vs_v3.2']:>8.1%} "
                f"{r['flops_with_active_params'] / 1e9:>10,.1f} {r['whole_vs_v3.2']:>8.1%} "
                f"{r['cache_bytes_per_sequence'] / 1e9:>9.2f}GB {r['cache_vs_v3.2']:>8.1%}"
            )
    print("V4-Pro multiply-adds per decoded token at 1M, by term (all 61 layers):")
    for k, v in out["terms_at_1M"].items():
        print(f"  {k:<18} {v / 1e9:>9.2f} G")


if __name__ == "__main__":
    main()

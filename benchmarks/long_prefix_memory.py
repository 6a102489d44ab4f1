"""Peak memory of a prefill chunk over a long cached prefix (the target case: 512 new tokens over 64K cached,
DeepSeek-V3 widths, bf16, must not raise peak memory by 2 GB; one shot would need ~5.4 GB of K/V).

Each setting runs in a fresh subprocess: build the layer and a PagedLatentCache holding the prefix,
reset the kernel's peak-RSS counter (/proc/self/clear_refs), then run one forward in materialize
mode. Two numbers per setting:

- rss: peak resident memory during the forward minus resident memory before it (VmHWM - VmRSS);
- tensors: peak bytes of tensor storage alive during the forward (a tracemalloc for torch: every
  storage an op creates, counted until it is freed).

A CPU without bf16 matrix units needs hours for the real 64K forward (~3 TFLOP), so `--dry` (the
default at 64K) replaces the matrix products (mm, addmm, bmm, baddbmm, SDPA) by empty tensors of
their output's shape, dtype and strides: every other op, copy and allocation runs for real.
`--check` measures a smaller context both ways to show that the dry run sees the same peak.

    PYTHONPATH=$PWD python benchmarks/long_prefix_memory.py
    PYTHONPATH=$PWD python benchmarks/long_prefix_memory.py --check
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PRODUCTS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


class Tracker(TorchDispatchMode):
    """Peak bytes of storage created inside the block; with dry=True, matrix products are not computed."""

    def __init__(self, dry: bool):
        super().__init__()
        self.dry, self.live, self.peak, self._seen = dry, 0, 0, set()

    def _free(self, key, size):
        self.live -= size
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _shaped_like(func, args, kwargs) if self.dry and func in PRODUCTS else func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self._seen:
                st = t.untyped_storage()
                self._seen.add(st.data_ptr())
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, st.data_ptr(), st.nbytes())
        return out


def _shaped_like(func, args, kwargs):
    """Empty tensors shaped as func's outputs, found by running it on meta tensors (no data)."""
    meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
    out = func(*meta[0], **meta[1])
    return tree_map(
        lambda t: (
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) if isinstance(t, torch.Tensor) else t
        ),
        out,
    )


def status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args) -> dict:
    """One measurement, in this (fresh) process."""
    from mlakit import MLAAttention, MLAConfig
    from mlakit.cache.paged import PagedLatentCache

    torch.manual_seed(0)
    cfg = MLAConfig.resolve(args.model)
    dtype = DTYPES[args.dtype]
    with torch.no_grad():
        layer = MLAAttention(cfg, dtype=dtype).eval()
        layer.workspace_tokens = args.workspace
        size = args.block_size
        blocks = -(-(args.context + args.new) // size)
        cache = PagedLatentCache(cfg, blocks, size, max_batch=1, dtype=dtype)
        for start in range(0, args.context, 8192):
            n = min(8192, args.context - start)
            c = torch.randn(1, n, cfg.kv_lora_rank, dtype=dtype)
            cache.append(c, torch.randn(1, n, cfg.qk_rope_head_dim, dtype=dtype))
        x = torch.randn(1, args.new, cfg.hidden_size, dtype=dtype)
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = status_kb("VmRSS")
        t0 = time.perf_counter()
        with Tracker(args.dry) as tracker:
            out = layer(x, cache, mode="materialize")
        seconds = time.perf_counter() - t0
        rss_peak = status_kb("VmHWM")
    assert out.shape == (1, args.new, cfg.hidden_size)
    return {
        "rss_delta_mb": (rss_peak - before) / 1024,
        "tensor_peak_mb": tracker.peak / 2**20,
        "seconds": seconds,
        "cache_mb": cache.pages.numel() / 2**20,
    }


def run_child(args, **changes) -> dict:
    argv = [sys.executable, __file__, "--child"]
    for key, value in (vars(args) | changes).items():
        if key in ("child", "check", "json", "workspaces"):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else [f"--no-{key.replace('_', '-')}"]
        else:
            argv += [flag, str(value)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"child failed: {' '.join(argv)}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def kv_one_shot_gb(args) -> float:
    """K [T, H, dn+dr] and V [T, H, dv] of the whole context, as one shot would expand them."""
    from mlakit import MLAConfig

    cfg = MLAConfig.resolve(args.model)
    per_token = cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * DTYPES[args.dtype].itemsize
    return (args.context + args.new) * per_token / 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--workspace", type=int, default=4096, help="(child) workspace_tokens")
    p.add_argument("--workspaces", default="2048,4096,8192,16384", help="workspace_tokens values to measure")
    p.add_argument("--dry", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--check", action="store_true", help="dry vs real at --context 8192, fp32")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.check:
        args.context, args.dtype = 8192, "fp32"
    print(
        f"{args.model}: {args.new} new tokens over {args.context} cached, {args.dtype}, "
        f"block {args.block_size}; one shot would expand {kv_one_shot_gb(args):.2f} GB of K/V"
    )
    print(f"{'workspace':>10}{'run':>6}{'rss delta MB':>14}{'tensors MB':>12}{'seconds':>9}")
    results = []
    for ws in [int(w) for w in args.workspaces.split(",")]:
        for dry in [True, False] if args.check else [args.dry]:
            r = run_child(args, workspace=ws, dry=dry) | {"workspace": ws, "dry": dry}
            results.append(r)
            kind = "dry" if dry else "real"
            print(
                f"{ws:>10}{kind:>6}{r['rss_delta_mb']:>14.0f}{r['tensor_peak_mb']:>12.0f}{r['seconds']:>9.1f}"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()

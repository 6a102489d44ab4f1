"""Compile the kernels for a GPU without one: Triton's front end, its optimizer and ptxas, offline.

The interpreter runs the kernel's arithmetic on the CPU but not the GPU compiler, which rejects
things the interpreter accepts (dot shapes, layout conversions, dtype casts). This builds both
stages for an NVIDIA target and reads ptxas' register and spill report.

    python -m mlakit.kernels.compile_check               # sm_90, every latent format, the table's tiles
    python -m mlakit.kernels.compile_check --arch 80 --block-m 32 --block-n 16 --warps 8
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

from mlakit.kernels.configs import KernelConfig, pick_config

# latent format → (Triton type of the latent, of the rope key, QUANT, scales per token)
FORMATS = {
    "bf16": ("bf16", "bf16", 0, 1),
    "fp8": ("fp8e4nv", "bf16", 1, 4),
    "int8": ("i8", "bf16", 2, 1),
    "fp32": ("fp32", "fp32", 0, 1),
}


def compile_stage1(fmt: str, cfg: KernelConfig, arch: int = 90, latent: int = 512, rope: int = 64):
    """The compiled stage-1 kernel for DeepSeek-V3 widths (by default) on sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from mlakit.kernels.absorb_decode import _stage1

    lat, rp, quant, scales = FORMATS[fmt]
    sig = {"q_lat_ptr": f"*{rp}", "q_pe_ptr": f"*{rp}", "lat_ptr": f"*{lat}", "scale_ptr": "*fp32"}
    sig |= {"rope_ptr": f"*{rp}", "table_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*fp32"}
    sig |= {"lse_ptr": "*fp32", "qk_scale": "fp32"} | {name: "i32" for name in _int_args(_stage1)}
    block_g = 4 if quant == 1 else 1
    consts = dict(BLOCK_SIZE=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_L=latent)
    consts |= dict(BLOCK_R=rope, QUANT=quant, NUM_SCALES=scales, BLOCK_G=block_g)
    consts |= dict(SCALE_GROUP=latent // block_g, COMPUTE_F32=fmt == "fp32", IEEE=fmt == "fp32")
    sig |= dict.fromkeys(consts, "constexpr")
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    src = ASTSource(JITFunction(_stage1), sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _int_args(fn) -> list[str]:
    """The plain integer parameters of a kernel: neither pointers, nor the scale, nor constexprs."""
    params = inspect.signature(fn).parameters.values()
    return [
        p.name
        for p in params
        if not p.name.endswith("_ptr") and p.name != "qk_scale" and "constexpr" not in str(p.annotation)
    ]


def compile_stage2(arch: int = 90, latent: int = 512, splits: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from mlakit.kernels.absorb_decode import _stage2

    sig = {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "o_ptr": "*bf16", "lse_ptr": "*fp32", "L": "i32"}
    sig["NS"] = "i32"
    consts = {"BLOCK_NS": splits, "BLOCK_L": latent}
    sig |= dict.fromkeys(consts, "constexpr")
    src = ASTSource(JITFunction(_stage2), sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def ptxas_report(kernel, arch: int = 90) -> dict:
    """{"registers", "spill_stores", "spill_loads"} from ptxas -v on the kernel's PTX."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(
        p for p in (os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")) if os.path.exists(p)
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        suffix = "a" if arch >= 90 else ""
        run = subprocess.run(
            [ptxas, f"-arch=sm_{arch}{suffix}", "-v", path, "-o", os.devnull], capture_output=True, text=True
        )
    text = run.stderr
    found = {
        "registers": re.search(r"Used (\d+) registers", text),
        "spill_stores": re.search(r"(\d+) bytes spill stores", text),
        "spill_loads": re.search(r"(\d+) bytes spill loads", text),
    }
    return {k: int(m.group(1)) if m else None for k, m in found.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--heads", type=int, default=16, help="head count the config table is read for")
    p.add_argument("--block-m", type=int)
    p.add_argument("--block-n", type=int)
    p.add_argument("--warps", type=int)
    p.add_argument("--stages", type=int)
    args = p.parse_args(argv)
    for fmt in args.formats.split(","):
        key = {"bf16": "16bit"}.get(fmt, fmt)
        base = pick_config(args.heads, args.heads, key, interpret=False)
        cfg = KernelConfig(
            args.block_m or base.block_m,
            args.block_n or base.block_n,
            args.warps or base.num_warps,
            args.stages or base.num_stages,
        )
        report = ptxas_report(compile_stage1(fmt, cfg, args.arch), args.arch)
        print(f"stage1 {fmt:5s} sm_{args.arch} {cfg}: {report}")
    print(f"stage2 sm_{args.arch}: {ptxas_report(compile_stage2(args.arch), args.arch)}")


if __name__ == "__main__":
    main()

"""The fused CPU decode cores (mlakit/csrc/) and the choice between them and the torch path.

Two fused cores, one per cache dtype, the same contract (`fused_latent`):

- "fused-avx512bf16" (latent_decode.cpp): CPUs with AVX512-BF16 (AMD Zen 4 and later, Intel Cooper
  Lake, Sapphire Rapids and later) and bf16 caches: bf16 products, fp32 scores, softmax and sums.
- "fused-avx2-fp32" (latent_decode_f32.cpp): x86 CPUs with AVX2 and FMA and fp32 caches (what mlakit
  keeps where the CPU has no native bf16, and what an fp32 model asks for elsewhere): everything in
  fp32. Measured against the torch path at decode, which gathers the latents and runs small bmm's:
  1.6-2.5x on AMD EPYC Zen 1 (AVX2 only), 1.6-2.7x on Zen 4 (AVX-512, where it still runs 256-bit).

Both read the cache in place (strided, or a pool of rows by row id: pages), split the key range for
parallel work and merge the parts by log-sum-exp. Each is compiled once, on first use, with the
system's C++ compiler against torch's own headers (torch.utils.cpp_extension's include paths and ABI
flag), in a subprocess bounded by BUILD_TIMEOUT_S, into a cache folder keyed by the source, the flags
and the torch version. Wherever one cannot build or run (no compiler, another ISA, autograd,
torch.compile, other widths or dtypes) the torch path runs: nothing fails for want of it.

MLAKIT_CPU_CORE=torch (or 0/off) never builds or uses either; MLAKIT_CPU_CORE_DIR moves the build cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CORES = ("auto", "fused", "torch")
CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCE = CSRC / "latent_decode.cpp"
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-DTORCH_API_INCLUDE_EXTENSION_H")
FLAGS = COMMON_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma")
# seconds one compile may take (it took 35-50 s on a loaded 2-core machine)
BUILD_TIMEOUT_S = 240


@dataclass(frozen=True)
class Core:
    """One fused core: its name in reports, the cache dtype it takes, how it is built and called."""

    name: str
    dtype: torch.dtype
    source: Path
    flags: tuple[str, ...]
    library: str  # the built file's name
    ops: str  # its torch.ops namespace
    what: str  # for the build's messages
    extra: tuple[Path, ...] = ()  # more sources (and the headers they share), built into the same library
    group_rows: int = 256  # query rows per work item at most (RG in its source): S x H rows cut in groups


BF16 = Core(
    "fused-avx512bf16",
    torch.bfloat16,
    SOURCE,
    FLAGS,
    "mlakit_cpu_core.so",
    "mlakit_cpu",
    "",
    (
        CSRC / "prefill_attention.cpp",
        CSRC / "vnni_linear.cpp",
        CSRC / "rows.cpp",
        CSRC / "decode_layer.cpp",
        CSRC / "bf16_tiles.h",
        CSRC / "prefetch.h",
    ),
)
F32 = Core(
    "fused-avx2-fp32",
    torch.float32,
    CSRC / "latent_decode_f32.cpp",
    COMMON_FLAGS + ("-mavx2", "-mfma"),
    "mlakit_cpu_f32.so",
    "mlakit_cpu_f32",
    "fp32 ",
    (CSRC / "prefetch.h",),
    group_rows=64,
)
CORE_FOR = {torch.bfloat16: BF16, torch.float32: F32}

_state: dict = {"loaded": None, "why": None}  # the bf16 core's
_states = {BF16.library: _state, F32.library: {"loaded": None, "why": None}}


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 dot products (AVX512-BF16 or AMX-BF16): not only AVX-512."""
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)  # torch >= 2.3
    caps = probe() if probe is not None else {}
    return caps.get("architecture") == "x86_64" and bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def cpu_has_avx2() -> bool:
    """Whether this CPU runs the fp32 core: x86-64 with AVX2 and FMA."""
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)
    caps = probe() if probe is not None else {}
    return caps.get("architecture") == "x86_64" and bool(caps.get("avx2") and caps.get("fma3"))


def check_core(core: str) -> None:
    if core not in CORES:
        raise ValueError(f"core must be one of {CORES}, got {core!r}")


def fits(q_lat: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, key_mask=None) -> str | None:
    """Why the fused core cannot take these tensors, or None when it can (a host fact: no data read)."""
    if key_mask is not None:
        return "a key_mask (left padding)"
    if c_kv.device.type != "cpu":
        return f"device {c_kv.device.type}"
    if c_kv.dtype not in CORE_FOR or k_pe.dtype != c_kv.dtype:
        return f"cache dtype {c_kv.dtype} (bf16 or fp32 only)"
    widths = width_reason(c_kv.shape[-1], k_pe.shape[-1], c_kv.dtype)
    if widths is not None:
        return widths
    if c_kv.stride(-1) != 1 or k_pe.stride(-1) != 1:
        return "cache rows not contiguous"
    if torch.is_grad_enabled() and (q_lat.requires_grad or c_kv.requires_grad or k_pe.requires_grad):
        return "autograd"
    if torch.compiler.is_compiling():
        return "torch.compile"
    return None


def use_fused(core: str, q_lat: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, key_mask=None) -> bool:
    """Whether `core` ("auto", "fused", "torch") runs the fused core here; "fused" where it cannot
    run is a ValueError naming why."""
    check_core(core)
    if core == "torch":
        return False
    why = fits(q_lat, c_kv, k_pe, key_mask) or unavailable_reason(c_kv.dtype)
    if why is not None and core == "fused":
        raise ValueError(f"core='fused' cannot run here: {why}")
    return why is None


def fused_latent(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    *,
    rows: torch.Tensor | None = None,
    key_start: int = 0,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused core: q_lat [B,S,H,L], q_pe [B,S,H,dr] against c_kv [B,T,L], k_pe [B,T,dr] (or pools
    [N, L], [N, dr] read at `rows` [B, T]), keys at positions key_start.. ; query i of row b sees keys
    up to kv_lens[b] - S + i. Returns (o_lat [B,S,H,L], lse [B,S,H]) in fp32; -inf/0 where no key is seen.
    The core is the one for the cache's dtype (bf16 or fp32); the queries are converted to it.
    """
    core = CORE_FOR.get(c_kv.dtype)
    if core is None or not available(c_kv.dtype):
        raise ValueError(f"the fused core cannot run here: {unavailable_reason(c_kv.dtype)}")
    batch, new, heads, latent = q_lat.shape
    q_l = q_lat.reshape(batch, new * heads, latent).to(core.dtype).contiguous()
    q_r = q_pe.reshape(batch, new * heads, -1).to(core.dtype).contiguous()
    keys = (c_kv if rows is None else rows).shape[1]
    groups = -(-new * heads // core.group_rows)
    parts = default_splits(batch * groups, keys) if splits is None else splits
    lens = kv_lens.to(device="cpu", dtype=torch.long).contiguous()
    op = getattr(torch.ops, core.ops).latent_decode
    o, lse = op(q_l, q_r, c_kv, k_pe, rows, lens, new, key_start, scale, parts)
    return o.view(batch, new, heads, latent), lse.view(batch, new, heads)


def prefill_reason(q_nope: torch.Tensor, q_pe: torch.Tensor, dv: int) -> str | None:
    """Why the fused prefill core (`fused_prefill`) cannot take these queries and values `dv` wide, or
    None when it can: bf16 on a CPU, even nope and rope widths, a value width that is a multiple of 32,
    no autograd, not traced, the bf16 core loaded (a host fact: no data read)."""
    if q_nope.device.type != "cpu":
        return f"device {q_nope.device.type}"
    if q_nope.dtype != torch.bfloat16:
        return f"dtype {q_nope.dtype} (bf16 only)"
    dn, dr = q_nope.shape[-1], q_pe.shape[-1]
    if dn % 2 or dr % 2 or dv % 32 or dn < 2 or dr < 2:
        return f"widths {dn}/{dr}/{dv} (nope and rope even, values a multiple of 32)"
    if torch.is_grad_enabled() and (q_nope.requires_grad or q_pe.requires_grad):
        return "autograd"
    if torch.compiler.is_compiling():
        return "torch.compile"
    return unavailable_reason(torch.bfloat16)


def fused_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    *,
    key_start: int = 0,
    need_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Materialized attention on the bf16 core: q_nope [B,S,H,dn], q_pe [B,S,H,dr] against one
    context's expanded keys k_nope [B,T,H,dn] with the shared rope key k_pe [B,T,dr] (never expanded per
    head) and values v [B,T,H,dv]: strided views are read in place (rows contiguous). Keys sit at
    positions key_start.. ; query i of row b sees keys up to kv_lens[b] - S + i, and keys it cannot see
    are never read. Returns (out [B,S,H,dv], lse [B,S,H] fp32): out in bf16 and lse None by default;
    with need_lse out in fp32 (parts merged by lse keep their precision), -inf/0 where no key is seen.
    """
    why = prefill_reason(q_nope, q_pe, v.shape[-1])
    if why is None and torch.is_grad_enabled() and any(t.requires_grad for t in (k_nope, k_pe, v)):
        why = "autograd"
    if why is not None:
        raise ValueError(f"the fused prefill core cannot run here: {why}")
    rows = [t if t.stride(-1) == 1 else t.contiguous() for t in (q_nope, q_pe, k_nope, k_pe, v)]
    lens = kv_lens.to(device="cpu", dtype=torch.long).contiguous()
    out, lse = torch.ops.mlakit_cpu.prefill_attention(*rows, lens, key_start, scale, need_lse)
    return out, (lse if need_lse else None)


# keys one part of a split key range holds at least (fewer: the merge costs more than it spreads)
MIN_SPLIT_KEYS = 512


def default_splits(batch: int, keys: int) -> int:
    """Parts per sequence: about two work items per thread, none shorter than MIN_SPLIT_KEYS. `batch`:
    the work items before any split (sequences x groups of query rows)."""
    threads = torch.get_num_threads()
    if threads == 1:
        return 1
    want = -(-2 * threads // batch)
    return max(1, min(want, keys // MIN_SPLIT_KEYS))


def few_rows_fit(x: torch.Tensor, w: torch.Tensor, rows: int = 0, limit: int = 16) -> bool:
    """Whether the few-row products (`small_linear`, `fold_heads`, `unfold_heads`) take x and w: bf16
    on a CPU, at most `limit` rows, no autograd, not traced, the core loaded."""
    if rows > limit or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    if w.device.type != "cpu" or x.device != w.device or w.stride(-1) != 1:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    return not torch.compiler.is_compiling() and available()


def fold_heads(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q [M, H, dn] · w_uk [H, dn, L] per head → [M, H, L] bf16 (fp32 sums): the weight read once."""
    return torch.ops.mlakit_cpu.fold_heads(q if q.stride(-1) == 1 else q.contiguous(), w_uk)


def unfold_heads(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o [M <= 8, H, L] · w_uv[h]ᵀ per head (w_uv [H, dv, L]) → [M, H, dv] bf16 (fp32 sums)."""
    return torch.ops.mlakit_cpu.unfold_heads(o if o.stride(-1) == 1 else o.contiguous(), w_uv)


def small_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M <= 16, K] · w [N, K]ᵀ in bf16 with fp32 sums: each weight row read once."""
    return torch.ops.mlakit_cpu.small_linear(x if x.stride(-1) == 1 else x.contiguous(), w)


def core_name(dtype: torch.dtype, device: torch.device | str = "cpu", cfg=None) -> str:
    """The absorbed decode core "auto" runs for a cache of `dtype` on `device` (for reports):
    "fused-avx512bf16", "fused-avx2-fp32" or "torch-<core dtype>". Builds the fused core if it is not
    built yet."""
    return describe(dtype, device, cfg)[0]


def width_reason(latent: int, rope: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the fused core for `dtype` cannot take these widths (the rule `fits` applies), or None."""
    if dtype == torch.float32:
        if latent % 8 or rope < 1:
            return f"widths {latent}/{rope} (latent a multiple of 8, some rope)"
        return None
    if latent % 32 or rope % 2:
        return f"widths {latent}/{rope} (latent a multiple of 32, rope even)"
    return None


def describe(dtype: torch.dtype, device: torch.device | str = "cpu", cfg=None) -> tuple[str, str | None]:
    """(core_name, why not the fused core: None where it runs or off a CPU). With `cfg` (an MLAConfig)
    the width rule of `fits` applies too: a latent not a multiple of 32 or an odd rope runs the torch core.
    """
    from mlakit.ops.common import core_dtype

    on_cpu = torch.device(device).type == "cpu"
    core = CORE_FOR.get(dtype)
    name = "torch-" + str(core_dtype(dtype, device)).removeprefix("torch.")
    if not on_cpu:
        return name, None
    if core is None:
        return name, f"the fused cores take bf16 or fp32 caches, not {dtype}"
    widths = None if cfg is None else width_reason(cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype)
    why = unavailable_reason(dtype) or widths
    return (core.name, None) if why is None else (name, why)


def unavailable_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the fused core for caches of `dtype` is not available here (None when it is)."""
    core = CORE_FOR.get(dtype)
    if core is None:
        return f"no fused core takes {dtype} caches"
    return None if available(dtype) else _states[core.library]["why"]


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the fused core for caches of `dtype` (bf16 by default) is loaded (built on the first call
    where the CPU can run it)."""
    core = CORE_FOR.get(dtype)
    if core is None:
        return False
    state = _states[core.library]
    if state["loaded"] is None:
        state["loaded"], state["why"] = _load(core)
    return state["loaded"]


def _cpu_reason(core: Core) -> str | None:
    if core is F32:
        return None if cpu_has_avx2() else "this CPU has no AVX2 and FMA"
    return None if cpu_has_bf16() else "this CPU has no AVX512-BF16"


def _load(core: Core = BF16) -> tuple[bool, str | None]:
    if os.environ.get("MLAKIT_CPU_CORE", "auto").lower() in ("0", "off", "torch", "false"):
        return False, "MLAKIT_CPU_CORE turns it off"
    why = _cpu_reason(core)
    if why is not None:
        return False, why
    try:
        lib = _build_dir(core) / core.library
        failed = lib.with_suffix(".failed")
        if failed.exists():
            return False, failed.read_text()[-400:]
        if not lib.exists():
            why, lasting = _build_announced(lib)
            if why is not None:
                if lasting:  # a compile error stays one; no compiler or a slow machine may do better later
                    failed.write_text(why)
                return False, why
    except OSError as e:  # no source, no writable cache folder
        return False, f"cannot build the fused core: {e}"
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        return False, f"cannot load {lib}: {e}"
    return True, None


def _build_dir(core: Core = BF16) -> Path:
    sources = b"".join(p.read_bytes() for p in (core.source, *core.extra))
    what = sources + " ".join(core.flags).encode() + torch.__version__.encode()
    key = hashlib.sha256(what)
    root = (
        os.environ.get("MLAKIT_CPU_CORE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlakit" / "cpu_core"
    )
    path = Path(root) / key.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compile_command(out: Path, core: Core = BF16) -> list[str]:
    from torch.utils import cpp_extension as ext

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    sources = [str(core.source)] + [str(p) for p in core.extra if p.suffix == ".cpp"]
    cmd = [os.environ.get("CXX", "g++"), *core.flags, abi, f"-I{CSRC}", *sources, "-o", str(out)]
    cmd += [f"-I{p}" for p in ext.include_paths()]
    cmd += [f"-L{p}" for p in ext.library_paths()] + ["-lc10", "-ltorch_cpu"]
    return cmd


def _core_of(lib: Path) -> Core:
    return BF16 if lib.name == BF16.library else F32


def _build_announced(lib: Path) -> tuple[str | None, bool]:
    """`_build`, with one line on stderr as it starts and one when it ends (it blocks for ~1 min)."""
    what = f"{_core_of(lib).what}fused CPU decode core"
    print(f"mlakit: building the {what} (once, ~1 min) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    why, lasting = _build(lib)
    took = time.perf_counter() - t0
    if why is None:
        print(f"mlakit: {what} built in {took:.0f} s ({lib.parent})", file=sys.stderr, flush=True)
    else:
        print(
            f"mlakit: {what} not built ({why.splitlines()[0][:200]}); the torch path runs",
            file=sys.stderr,
            flush=True,
        )
    return why, lasting


def _build(lib: Path) -> tuple[str | None, bool]:
    """Compile the core named by `lib` into a temporary name, then rename (another process may be
    loading the same path). Returns (why it failed or None, whether the failure lasts): only the
    compiler's non-zero exit on this source and these flags lasts; no compiler (OSError) or a timeout
    may do better on a later call."""
    core = _core_of(lib)
    tmp = lib.with_name(f"{lib.stem}.{os.getpid()}.tmp.so")
    try:
        run = subprocess.run(
            _compile_command(tmp, core), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot compile {core.source.name}: {type(e).__name__}: {e}", False
    if run.returncode != 0:
        return f"cannot compile {core.source.name}: {run.stderr.strip()[-400:]}", True
    os.replace(tmp, lib)
    return None, False


if __name__ == "__main__":  # python -m mlakit.ops.cpu_core: build (or report why not)
    for dtype, core in CORE_FOR.items():
        print(f"{core.name}:", "ready" if available(dtype) else f"unavailable ({unavailable_reason(dtype)})")
    sys.exit(0)

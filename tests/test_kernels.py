"""The Triton absorbed-decode kernel under Triton's CPU interpreter, against a float64 oracle computed
from the exact bytes of the pages, against `mlakit.ops.reference` and against the torch absorb path.

Every pool is shuffled (pages in random order) and poisoned: every byte the kernel must not read —
unused pages, rows past a row's length inside its last page — is 0xFF (NaN in bf16, fp32 and e4m3),
and block-table entries past a row's blocks hold the sentinel.
"""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the interpreter only works when set before triton is imported (its library functions are wrapped then)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch  # noqa: E402
from support.common import assert_close, assert_lse_close, randomize_  # noqa: E402

import mlakit.kernels.paged as kernels_paged  # noqa: E402
from mlakit import MLAAttention, MLAConfig, PagedLatentCache  # noqa: E402
from mlakit.attention import _absorb_backend  # noqa: E402
from mlakit.cache.blocks import blocks_for  # noqa: E402
from mlakit.cache.paged import BLOCK_SENTINEL  # noqa: E402
from mlakit.cache.quant import field_view  # noqa: E402
from mlakit.kernels import (  # noqa: E402
    KernelConfig,
    absorb_decode,
    absorb_paged,
    available,
    choose_splits,
    interpreting,
    pick_backend,
    pick_config,
)
from mlakit.ops import reference  # noqa: E402
from mlakit.ops.paged import absorb_chunked  # noqa: E402

if not interpreting():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

FORMATS = {  # name → (compute dtype of the cache, quant)
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, None),
    "fp32": (torch.float32, None),
    "fp8": (torch.bfloat16, "fp8"),
    "int8": (torch.bfloat16, "int8"),
}
WIDTHS = {"V3": (512, 64), "L96r32": (96, 32), "L256r32": (256, 32)}


def widths_config(latent: int, rope: int, heads: int) -> MLAConfig:
    """Only the cache widths matter to the kernel; nope 16 != v 12 for the full absorb."""
    return MLAConfig(
        hidden_size=64,
        num_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=latent,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope,
        v_head_dim=12,
    )


class Pool:
    """A filled paged cache, its shuffled and poisoned copy, and the exact float64 context it holds."""

    def __init__(self, lens, widths, fmt, heads, block_size, seed):
        latent, rope = WIDTHS[widths]
        dtype, quant = FORMATS[fmt]
        g = torch.Generator().manual_seed(seed)
        self.cfg = widths_config(latent, rope, heads)
        self.lens = torch.tensor(lens, dtype=torch.long)
        used = sum(blocks_for(n, block_size) for n in lens)
        self.cache = PagedLatentCache(
            self.cfg, used + 3, block_size, max_batch=len(lens), dtype=dtype, quant=quant
        )
        for b, n in enumerate(lens):
            if n:
                c = torch.randn(1, n, latent, generator=g) * 2
                k = torch.randn(1, n, rope, generator=g)
                self.cache.append(c.to(dtype), k.to(dtype), slots=[b])
        self.width = max(1, max(blocks_for(n, block_size) for n in lens)) + 1  # one spare sentinel column
        table = self.cache.table(torch.arange(len(lens)), self.width)  # [B, NB] in cache order
        self.pages, self.table = self._shuffle(table, g)
        self.c_kv, self.k_pe = self._exact(table)

    def _shuffle(self, table, g):
        """Pages moved to random places; only the rows inside each length copied, the rest 0xFF."""
        src = self.cache.pages
        perm = torch.randperm(src.shape[0], generator=g)
        pool = torch.full_like(src, 0xFF)
        size = self.cache.block_size
        for b, n in enumerate(self.lens.tolist()):
            t = torch.arange(n)
            blk = table[b, t // size]
            pool[perm[blk], t % size] = src[blk, t % size]
        shuffled = torch.where(table == BLOCK_SENTINEL, table, perm[table.clamp_max(src.shape[0] - 1)])
        return pool, shuffled.to(torch.int32)

    def _exact(self, table):
        """(c_kv [B,T,L], k_pe [B,T,dr]) in float64 decoded from the page bytes: values × fp32 scales."""
        lay, size = self.cache.layout, self.cache.block_size
        rows = self.cache.pages.view(-1, lay.row_bytes)
        top = max(1, int(self.lens.max()))
        t = torch.arange(top)
        flat = (table[:, t // size].clamp_max(self.cache.num_blocks - 1) * size + t % size).reshape(-1)
        latent = field_view(rows, lay.latent)[flat].double()  # [B·T, L]
        if lay.quant is not None:
            scale = field_view(rows, lay.scale)[flat].double()
            latent = (latent.view(len(flat), scale.shape[1], -1) * scale[..., None]).view(len(flat), -1)
        rope = field_view(rows, lay.rope)[flat].double()
        keep = (t[None, :] < self.lens[:, None]).reshape(-1, 1)
        b = len(self.lens)
        return (latent * keep).view(b, top, -1), (rope * keep).view(b, top, -1)


def oracle(q_lat, q_pe, c_kv, k_pe, lens, scale):
    """float64 latent attention, one row at a time: (o_lat [B,S,H,L], lse [B,S,H])."""
    batch, new, heads, latent = q_lat.shape
    o = torch.zeros(batch, new, heads, latent, dtype=torch.float64)
    lse = torch.full((batch, new, heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        scores = torch.einsum("shl,tl->sht", q_lat[b].double(), c_kv[b, :n])
        scores = (scores + torch.einsum("shr,tr->sht", q_pe[b].double(), k_pe[b, :n])) * scale
        hidden = torch.arange(n)[None, None, :] > torch.arange(n - new, n)[:, None, None]
        scores = scores.masked_fill(hidden, -math.inf)
        lse[b] = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[b][..., None]).nan_to_num(0.0)
        o[b] = torch.einsum("sht,tl->shl", probs, c_kv[b, :n])
    return o, lse


def queries(pool, new, heads, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 1)
    latent, rope = pool.cfg.kv_lora_rank, pool.cfg.qk_rope_head_dim
    q_lat = torch.randn(len(pool.lens), new, heads, latent, generator=g) / math.sqrt(latent)
    q_pe = torch.randn(len(pool.lens), new, heads, rope, generator=g)
    return q_lat.to(dtype), q_pe.to(dtype)


# (lens, S, H, widths, format, block size, splits, config): page boundaries ±1, split boundaries
# (interpreter tiles are 64 keys: 2 splits of 127/128/129 keys are 64+63, 64+64, 128+1), ragged rows,
# empty rows, rows shorter than their query block, GPU-sized tiles (16 rows × 32 keys)
CASES = {
    "B1-S1-H16-V3-bf16-T64-page": ([64], 1, 16, "V3", "bf16", 64, 1, None),
    "B1-S1-H16-V3-bf16-T65-page+1": ([65], 1, 16, "V3", "bf16", 64, 1, None),
    "B2-S1-H16-V3-bf16-T63,129-split2": ([63, 129], 1, 16, "V3", "bf16", 64, 2, None),
    "B1-S2-H16-V3-fp8-T127-split2": ([127], 2, 16, "V3", "fp8", 64, 2, None),
    "B2-S4-H16-V3-fp8-T4,130-split3": ([4, 130], 4, 16, "V3", "fp8", 64, 3, None),
    "B2-S3-H3-V3-int8-T2,100-split2": ([2, 100], 3, 3, "V3", "int8", 64, 2, None),
    "B1-S1-H128-V3-fp8-T200-split2": ([200], 1, 128, "V3", "fp8", 64, 2, None),
    "B2-S1-H128-V3-bf16-T1,65-auto": ([1, 65], 1, 128, "V3", "bf16", 64, None, None),
    "B3-S2-H3-L96r32-bf16-T1,17,40-bs16": ([1, 17, 40], 2, 3, "L96r32", "bf16", 16, 2, None),
    "B5-S1-H1-L96r32-bf16-ragged-empty": ([0, 5, 16, 17, 33], 1, 1, "L96r32", "bf16", 16, 3, None),
    "B4-S1-H3-L96r32-int8-T15,16,17,0": ([15, 16, 17, 0], 1, 3, "L96r32", "int8", 16, 2, None),
    "B2-S2-H16-L256r32-fp8-T31,33-bs32": ([31, 33], 2, 16, "L256r32", "fp8", 32, 4, None),
    "B3-S1-H3-L96r32-fp16-T9,64,1": ([9, 64, 1], 1, 3, "L96r32", "fp16", 8, 2, None),
    "B2-S1-H3-L96r32-fp32-T20,7": ([20, 7], 1, 3, "L96r32", "fp32", 4, 3, None),
    "B2-S3-H16-V3-bf16-gpu-tiles": ([33, 95], 3, 16, "V3", "bf16", 64, 2, KernelConfig(16, 32)),
    "B1-S4-H3-L96r32-int8-gpu-tiles": ([70], 4, 3, "L96r32", "int8", 16, 3, KernelConfig(16, 16)),
    "B2-S1-H1-L96r32-bf16-all-empty": ([0, 0], 1, 1, "L96r32", "bf16", 16, 2, None),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_kernel_matches_float64_oracle(case):
    lens, new, heads, widths, fmt, block_size, splits, config = case
    pool = Pool(lens, widths, fmt, heads, block_size, seed=len(lens) * 7 + new)
    q_lat, q_pe = queries(pool, new, heads, seed=heads)
    scale = 0.3 / math.sqrt(q_lat.shape[-1] + q_pe.shape[-1])
    o, lse = absorb_decode(
        q_lat, q_pe, pool.pages, pool.table, pool.lens, pool.cache.layout, scale,
        num_splits=splits, config=config,
    )  # fmt: skip
    want_o, want_lse = oracle(q_lat, q_pe, pool.c_kv, pool.k_pe, pool.lens, scale)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert_close("o_lat", o, want_o, 2e-5)
    assert_lse_close("lse", lse, want_lse)


@pytest.mark.parametrize("splits", [1, 2, 5, 9], ids=lambda s: f"splits{s}")
def test_split_count_changes_nothing(splits):
    """Splits past the keys are empty (lse -inf, weight 0 in the merge); every count gives one result."""
    pool = Pool([3, 130, 64], "L96r32", "bf16", 3, 16, seed=5)
    q_lat, q_pe = queries(pool, 2, 3, seed=5)
    o, lse = absorb_decode(
        q_lat, q_pe, pool.pages, pool.table, pool.lens, pool.cache.layout, 0.2, num_splits=splits
    )
    want_o, want_lse = oracle(q_lat, q_pe, pool.c_kv, pool.k_pe, pool.lens, 0.2)
    assert_close("o_lat", o, want_o, 2e-5)
    assert_lse_close("lse", lse, want_lse)


# (format, cache dtype == query dtype, rtol vs torch, rtol vs reference on the exact page contents)
ABSORB = {
    "fp32-exact": ("fp32", 1e-5, 1e-5),
    "bf16-exact": ("bf16", 2e-2, 2e-2),
    "fp8-bf16": ("fp8", 3e-2, 2e-2),
}


@pytest.mark.parametrize("case", list(ABSORB.values()), ids=list(ABSORB))
def test_absorb_paged_matches_torch_path_and_reference(case):
    fmt, rtol_torch, rtol_ref = case
    lens, new, heads = [1, 70, 129], 2, 16
    pool = Pool(lens, "V3", fmt, heads, 64, seed=11)
    dtype = pool.cache.dtype
    g = torch.Generator().manual_seed(12)
    q_nope = torch.randn(len(lens), new, heads, 16, generator=g).to(dtype)
    q_pe = torch.randn(len(lens), new, heads, 64, generator=g).to(dtype)
    w_uk = (torch.randn(heads, 16, 512, generator=g) / 4).to(dtype)
    w_uv = (torch.randn(heads, 12, 512, generator=g) / 20).to(dtype)
    scale = pool.cfg.softmax_scale
    out, lse = absorb_paged(q_nope, q_pe, pool.pages, pool.table, pool.lens, w_uk, w_uv, scale,
                            layout=pool.cache.layout, num_splits=2)  # fmt: skip
    assert out.dtype == dtype and out.shape == (len(lens), new, heads, 12)
    read = pool.cache.reader(torch.arange(len(lens)), int(pool.lens.max()))
    want, want_lse = absorb_chunked(q_nope, q_pe, read, pool.lens, w_uk, w_uv, scale, chunk_tokens=50)
    assert_close("out vs torch", out, want, rtol_torch)
    assert_lse_close("lse vs torch", lse, want_lse, atol=rtol_torch)
    ref, ref_lse = reference(q_nope.double(), q_pe.double(), pool.c_kv, pool.k_pe, pool.lens,
                             w_uk.double(), w_uv.double(), scale)  # fmt: skip
    assert_close("out vs reference", out, ref, rtol_ref)
    assert_lse_close("lse vs reference", lse, ref_lse, atol=rtol_ref)


def test_absorb_paged_takes_the_cache_itself():
    """A PagedLatentCache stands for its pages and layout; CPU kv_lens and long tables are accepted."""
    pool = Pool([5, 40], "L96r32", "int8", 3, 16, seed=3)
    q_nope = torch.randn(2, 1, 3, 16)
    q_pe = torch.randn(2, 1, 3, 32)
    w_uk, w_uv = torch.randn(3, 16, 96) / 4, torch.randn(3, 12, 96) / 10
    table = pool.cache.table(torch.arange(2), pool.width)
    out, lse = absorb_paged(q_nope, q_pe, pool.cache, table, pool.lens, w_uk, w_uv, 0.2)
    ref, ref_lse = reference(q_nope.double(), q_pe.double(), pool.c_kv, pool.k_pe, pool.lens,
                             w_uk.double(), w_uv.double(), 0.2)  # fmt: skip
    assert_close("out", out, ref, 2e-5)
    assert_lse_close("lse", lse, ref_lse)
    with pytest.raises(ValueError, match="layer 1 out of range"):
        absorb_paged(q_nope, q_pe, pool.cache, table, pool.lens, w_uk, w_uv, 0.2, layer=1)


def test_out_dtype_and_single_split_view():
    pool = Pool([20], "L96r32", "bf16", 3, 16, seed=1)
    q_lat, q_pe = queries(pool, 1, 3, seed=1, dtype=torch.bfloat16)
    args = (q_lat, q_pe, pool.pages, pool.table, pool.lens, pool.cache.layout, 0.2)
    o32, _ = absorb_decode(*args, num_splits=1)
    o16, lse = absorb_decode(*args, num_splits=1, out_dtype=torch.bfloat16)
    assert o16.dtype == torch.bfloat16
    assert_close("bf16 out", o16, o32, 1e-2)
    want_o, want_lse = oracle(q_lat, q_pe, pool.c_kv, pool.k_pe, pool.lens, 0.2)
    assert_close("o_lat", o32, want_o, 2e-5)


def _bad(pool, q_lat, q_pe, change):
    args = dict(
        q_lat=q_lat, q_pe=q_pe, pages=pool.pages, block_table=pool.table, kv_lens=pool.lens,
        layout=pool.cache.layout, scale=0.1,
    )  # fmt: skip
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda p, q, r: {"q_lat": q[..., :-1]}, "wide, the layout holds"),
        (lambda p, q, r: {"q_pe": r[:, :, :2]}, "must be"),
        (lambda p, q, r: {"pages": p.pages[..., :-4]}, "rows of"),
        (lambda p, q, r: {"block_table": p.table.float()}, "block_table must be"),
        (lambda p, q, r: {"block_table": p.table[:1]}, "block_table must be"),
        (lambda p, q, r: {"kv_lens": p.lens[:1]}, "kv_lens must be"),
        (lambda p, q, r: {"kv_lens": p.lens.float()}, "kv_lens must be"),
        (lambda p, q, r: {"num_splits": 0}, "num_splits"),
        (lambda p, q, r: {"out_dtype": torch.int8}, "out_dtype"),
        (lambda p, q, r: {"interpret": False}, "interpret=False"),
    ],
    ids=[
        "latent-width",
        "q_pe-shape",
        "row-bytes",
        "table-dtype",
        "table-rows",
        "lens-rows",
        "lens-dtype",
        "splits",
        "out-dtype",
        "no-interpret-on-cpu",
    ],  # fmt: skip
)
def test_bad_input_raises_value_error(change, match):
    pool = Pool([5, 9], "L96r32", "bf16", 3, 16, seed=2)
    q_lat, q_pe = queries(pool, 1, 3, seed=2)
    args = _bad(pool, q_lat, q_pe, change(pool, q_lat, q_pe))
    with pytest.raises(ValueError, match=match):
        absorb_decode(**args)


def test_configs_and_splits_are_static():
    assert pick_config(128, 128, "16bit", interpret=False).block_m >= 16
    assert pick_config(3, 3, "fp8", interpret=True) == KernelConfig(16, 64, 1, 1)
    own = KernelConfig(32, 64, 8, 3)
    assert pick_config(1, 1, "int8", interpret=False, override=own) is own
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(24, 32)
    # one row tile on 132 SMs at 8K keys: split, but never under 256 keys a split
    assert choose_splits(1, 1, 8192, 132) == 32
    assert choose_splits(1, 1, 512, 132) == 2
    assert choose_splits(128, 8, 8192, 132) == 1
    assert choose_splits(4, 1, 64, 1) == 1


@pytest.mark.parametrize(
    "capability, quant, want",
    [((9, 0), None, "triton"), ((9, 0), "fp8", "triton"), ((8, 0), "fp8", "torch"),
     ((8, 0), "int8", "triton"), ((7, 5), None, "torch")],
    ids=["sm90", "sm90-fp8", "sm80-fp8", "sm80-int8", "sm75"],
)  # fmt: skip
def test_auto_backend_on_cuda_follows_the_capability(monkeypatch, capability, quant, want):
    monkeypatch.setattr(kernels_paged, "_capability", lambda device: capability)
    assert pick_backend("cuda", "auto", quant) == want


def test_backend_choice():
    assert pick_backend("cpu") == "torch"
    assert pick_backend("cpu", "triton") == "triton"
    assert pick_backend("cuda", "torch") == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        pick_backend("cpu", "cuda")
    assert available("cpu")  # under the interpreter


def _planned_stack(quant, backend, counts):
    """Two layers over one two-layer paged cache: a ragged prefill of each layer, then one planned
    absorb step of `counts` new tokens per row; returns (outputs, plan, layers)."""
    cfg = widths_config(256, 16, 3).replace(hidden_size=40, q_lora_rank=24)
    layers = [randomize_(MLAAttention(cfg, layer_idx=i), seed=i).eval() for i in range(2)]
    cache = PagedLatentCache(cfg, 24, 8, max_batch=3, num_layers=2, quant=quant)
    prefill = [9, 1, 17]
    plan = cache.plan(prefill, mode="absorb")
    g = torch.Generator().manual_seed(4)
    for i in range(2):
        c = torch.randn(3, max(prefill), 256, generator=g)
        cache.write(plan, i, c, torch.randn(3, max(prefill), 16, generator=g))
    cache.commit(plan)
    plan = cache.plan(counts, mode="absorb")
    hidden = torch.randn(3, max(counts), 40, generator=g)
    outs = []
    with torch.no_grad():
        for layer in layers:
            layer.absorb_backend = backend
            outs.append(layer(hidden, plan))
    cache.commit(plan)
    return outs, plan, layers


@pytest.mark.parametrize("quant", [None, "fp8"], ids=["fp32", "fp8"])
@pytest.mark.parametrize("counts", [[1, 1, 1], [2, 1, 3]], ids=["decode", "ragged"])
def test_layers_run_the_kernel_when_asked_and_record_it(quant, counts):
    got, plan, layers = _planned_stack(quant, "triton", counts)
    assert plan.backend == "triton"
    want, torch_plan, _ = _planned_stack(quant, "torch", counts)
    assert torch_plan.backend == "torch"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_close(f"layer {i}", a, b, 2e-5)


def test_auto_backend_stays_on_torch_off_cuda():
    _, plan, layers = _planned_stack(None, "auto", [1, 1, 1])
    assert plan.backend == "torch"
    layers[0].absorb_backend = "gpu"
    with pytest.raises(ValueError, match="absorb_backend must be one of"):
        _absorb_backend(layers[0].absorb_backend, torch.device("cpu"))


def test_nothing_outside_kernels_imports_triton_at_import_time():
    """`import mlakit` never needs Triton: no module-level import of triton or mlakit.kernels elsewhere."""
    root = Path(__file__).resolve().parents[1] / "mlakit"
    for path in sorted(root.rglob("*.py")):
        if "kernels" in path.relative_to(root).parts:
            continue
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            bad = [n for n in names if n.split(".")[0] == "triton" or n.startswith("mlakit.kernels")]
            assert not bad, f"{path.relative_to(root)} imports {bad} at module level"


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    """The GPU compiler (front end, optimizer, ptxas) accepts what the interpreter ran; fp8, the variant
    with the most registers. A process of its own: the interpreter's wrapped library can't compile."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold compile, and nothing left in ~/.triton
    cmd = [sys.executable, "-m", "mlakit.kernels.compile_check", "--formats", "fp8"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    print(run.stdout, run.stderr[-2000:])
    assert run.returncode == 0, run.stderr[-2000:]
    stage1 = next(line for line in run.stdout.splitlines() if line.startswith("stage1 fp8"))
    assert "'spill_stores': 0" in stage1 and "'registers': None" not in stage1

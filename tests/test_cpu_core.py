"""The two absorbed decode cores (fused CPU, torch) on the same inputs against fp64; pages read in place;
the fallback when the fused core cannot build; the few-row products. The fused core's tests skip where
it cannot run (no AVX512-BF16, no compiler), and say why."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_close, assert_lse_close, tiny_config

from mlakit.linear import Linear
from mlakit.ops import absorb, cpu_core, reference
from mlakit.ops.absorb import UNFOLD_CHUNKED_ROWS, fold_queries, latent_attention, unfold_values
from mlakit.ops.common import context_mask, core_dtype
from mlakit.ops.paged import absorb_chunked

CORES = ["fused", "torch"]


def need(core: str) -> None:
    if core == "fused" and not cpu_core.available():
        pytest.skip(f"fused core unavailable: {cpu_core.unavailable_reason()}")


def latent_core(core, q_lat, q_pe, c_kv, k_pe, lens, new, scale):
    """(o_lat, lse) of one core on the same bf16 inputs."""
    if core == "fused":
        return cpu_core.fused_latent(q_lat, q_pe, c_kv, k_pe, lens, scale)
    mask = context_mask(lens, new, 0, new, 0, c_kv.shape[1], "cpu")
    return latent_attention(q_lat, q_pe, c_kv, k_pe, mask, scale)


def latent_oracle(q_lat, q_pe, c_kv, k_pe, lens, new, scale):
    """fp64, one sequence at a time: o_lat [B,S,H,L] and lse [B,S,H]; query i of row b sees keys
    0 .. lens[b] - new + i."""
    outs, lses = [], []
    for b in range(q_lat.shape[0]):
        scores = torch.einsum("shl,tl->sht", q_lat[b].double(), c_kv[b].double())
        scores = (scores + torch.einsum("shr,tr->sht", q_pe[b].double(), k_pe[b].double())) * scale
        keys = torch.arange(c_kv.shape[1])
        last = int(lens[b]) - new + torch.arange(new)
        scores = scores.masked_fill((keys[None, :] > last[:, None])[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        outs.append(probs @ c_kv[b].double())
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def case(batch, new, heads, latent, rope, lens, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    keys = max(lens)
    return (
        torch.randn(batch, new, heads, latent, generator=g).to(dtype),
        torch.randn(batch, new, heads, rope, generator=g).to(dtype),
        torch.randn(batch, keys, latent, generator=g).to(dtype),
        torch.randn(batch, keys, rope, generator=g).to(dtype),
        torch.tensor(lens),
    )


# (batch, new, heads, latent, rope, lens): odd head counts, 128-key block boundaries ±1, one key
SHAPES = {
    "B1-S1-H128-T300": (1, 1, 128, 512, 64, [300]),
    "B3-S1-H5-T127/128/129": (3, 1, 5, 64, 8, [127, 128, 129]),
    "B2-S3-H7-T1/257": (2, 3, 7, 32, 2, [3, 257]),
    "B2-S1-H16-T1/9": (2, 1, 16, 96, 16, [1, 9]),
    # 300 query rows: a 256-row group and a 44-row one (padded to 48), causal within each
    "B2-S100-H3-T120/300": (2, 100, 3, 64, 8, [120, 300]),
}


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_each_core_against_fp64_on_the_same_inputs(core, shape):
    need(core)
    batch, new, heads, latent, rope, lens = shape
    q_lat, q_pe, c_kv, k_pe, kv_lens = case(batch, new, heads, latent, rope, lens)
    o, lse = latent_core(core, q_lat, q_pe, c_kv, k_pe, kv_lens, new, 0.1)
    want, want_lse = latent_oracle(q_lat, q_pe, c_kv, k_pe, kv_lens, new, 0.1)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    # both keep scores in fp32 (bf16 products are exact in fp32): lse to fp32 round-off; the fused
    # core mixes values with bf16 probabilities (2^-9 each), the torch core in fp32
    assert_lse_close("lse", lse, want_lse, atol=1e-5)
    assert_close("o_lat", o, want, 4e-3 if core == "fused" else 1e-5)
    if core == "fused":  # the key range cut in parts (as with several threads), merged by lse
        o3, lse3 = cpu_core.fused_latent(q_lat, q_pe, c_kv, k_pe, kv_lens, 0.1, splits=3)
        assert_lse_close("lse, 3 parts", lse3, want_lse, atol=1e-5)
        assert_close("o_lat, 3 parts", o3, want, 4e-3)


@pytest.mark.parametrize("core", CORES)
def test_error_targets_at_v3_widths(core):
    """Output error (max relative, vs fp64 on the unrounded inputs) within 1.5x of an exact computation
    on the bf16-rounded inputs; lse within 1e-5 of fp64 on the rounded inputs."""
    need(core)
    q_lat, q_pe, c_kv, k_pe, lens = case(2, 1, 16, 512, 64, [2048, 1500], seed=3, dtype=torch.float32)
    q_lat, q_pe = q_lat * 0.5, q_pe * 0.5
    exact, _ = latent_oracle(q_lat, q_pe, c_kv, k_pe, lens, 1, 192**-0.5)
    rounded = [t.bfloat16() for t in (q_lat, q_pe, c_kv, k_pe)]
    on_rounded, lse_rounded = latent_oracle(*rounded, lens, 1, 192**-0.5)
    o, lse = latent_core(core, *rounded, lens, 1, 192**-0.5)
    floor = assert_close("exact on rounded inputs", on_rounded, exact, 1.0)
    assert_close(f"{core} core", o, exact, 1.5 * floor)
    assert_lse_close("lse vs fp64 on rounded inputs", lse, lse_rounded, atol=1e-5)


def test_absorb_cores_agree_and_fused_takes_pages_in_place():
    need("fused")
    g = torch.Generator().manual_seed(5)
    batch, heads, lens = 3, 6, [5, 200, 129]
    q_nope = torch.randn(batch, 1, heads, 16, generator=g).bfloat16()
    q_pe = torch.randn(batch, 1, heads, 64, generator=g).bfloat16()
    c_kv = torch.randn(batch, 200, 512, generator=g).bfloat16()
    k_pe = torch.randn(batch, 200, 64, generator=g).bfloat16()
    w_uk = (torch.randn(heads, 16, 512, generator=g) / 4).bfloat16()
    w_uv = (torch.randn(heads, 12, 512, generator=g) / 20).bfloat16()
    kv_lens = torch.tensor(lens)
    args = (q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, 0.1)
    fused, fused_lse = absorb(*args, core="fused")
    torch_out, torch_lse = absorb(*args, core="torch")
    ref, ref_lse = reference(*[t.double() if t.is_floating_point() else t for t in args[:7]], 0.1)
    assert_close("fused vs fp64", fused, ref, 2e-2)  # bf16 queries, folds and output
    assert_close("fused vs torch", fused, torch_out, 2e-2)
    assert_lse_close("lse fused vs torch", fused_lse, torch_lse, atol=1e-5)
    assert_lse_close("lse vs fp64", fused_lse, ref_lse, atol=2e-2)  # q_lat folded in bf16
    # a shuffled pool of rows, NaN wherever no key of a row's length points
    pool = torch.full((batch * 200 + 7, 576), float("nan")).bfloat16()
    rows = torch.randperm(pool.shape[0])[: batch * 200].view(batch, 200)
    for b, n in enumerate(lens):
        pool[rows[b, :n], :512], pool[rows[b, :n], 512:] = c_kv[b, :n], k_pe[b, :n]

    def read(start, stop):
        return c_kv[:, start:stop], k_pe[:, start:stop]

    pages = (pool[:, :512], pool[:, 512:], rows)
    paged, paged_lse = absorb_chunked(*args[:2], read, *args[4:], pages=pages, core="fused")
    assert torch.equal(paged, fused) and torch.equal(paged_lse, fused_lse)
    chunked, chunked_lse = absorb_chunked(*args[:2], read, *args[4:], chunk_tokens=64, core="fused")
    assert_close("chunks merged", chunked, fused, 1e-2)
    assert_lse_close("chunks merged lse", chunked_lse, fused_lse, atol=1e-5)


def test_auto_falls_back_and_forced_fused_says_why(monkeypatch):
    monkeypatch.setitem(cpu_core._state, "loaded", False)
    monkeypatch.setitem(cpu_core._state, "why", "no compiler here")
    q_nope, q_pe, c_kv, k_pe, lens = case(1, 1, 4, 64, 8, [40], seed=2)
    w_uk, w_uv = torch.randn(4, 64, 64).bfloat16(), torch.randn(4, 8, 64).bfloat16()
    args = (q_nope, q_pe, c_kv, k_pe, lens, w_uk, w_uv, 0.2)
    auto, _ = absorb(*args)
    assert torch.equal(auto, absorb(*args, core="torch")[0])
    with pytest.raises(ValueError, match="no compiler here"):
        absorb(*args, core="fused")
    with pytest.raises(ValueError, match="core must be one of"):
        absorb(*args, core="amx")
    assert cpu_core.core_name(torch.bfloat16) == "torch-float32"


def test_a_failed_build_is_remembered_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("MLAKIT_CPU_CORE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_core, "cpu_has_bf16", lambda: True)
    ok, why = cpu_core._load()
    assert not ok and "cannot compile" in why and "FileNotFoundError" in why
    assert not list(tmp_path.rglob("*.failed"))  # no compiler: no marker, a compiler installed later builds
    fail = tmp_path / "fail.sh"
    fail.write_text("#!/bin/sh\necho 'error: bad source' >&2\nexit 1\n")
    fail.chmod(0o755)
    monkeypatch.setenv("CXX", str(fail))
    ok, why = cpu_core._load()
    assert not ok and "bad source" in why and list(tmp_path.rglob("*.failed"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_core._load() == (False, why)  # the compiler's own error: remembered, no second attempt
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MLAKIT_CPU_CORE_DIR", str(tmp_path / "a-file"))
    ok, why = cpu_core._load()  # no folder to build in: a reason, not an exception
    assert not ok and "cannot build" in why
    monkeypatch.setenv("MLAKIT_CPU_CORE", "torch")
    assert cpu_core._load() == (False, "MLAKIT_CPU_CORE turns it off")


def test_torch_core_multiplies_in_fp32_for_16bit_caches_on_cpu():
    assert core_dtype(torch.bfloat16, "cpu") == torch.float32
    assert core_dtype(torch.float16, "cpu") == torch.float32
    assert core_dtype(torch.float32, "cpu") == torch.float32
    assert core_dtype(torch.float64, "cpu") == torch.float64


@pytest.mark.parametrize("rows", [1, 3, 4, 8])
def test_few_row_products_against_fp64(rows):
    need("fused")
    g = torch.Generator().manual_seed(rows)
    lin = Linear(70, 37, bias=True).bfloat16()
    x = torch.randn(rows, 70, generator=g).bfloat16()
    with torch.no_grad():
        want = x.double() @ lin.weight.double().T + lin.bias.double()
        assert_close("Linear", lin(x), want, 1e-2)  # bf16 output
    q = torch.randn(rows, 1, 5, 24, generator=g).bfloat16()
    w = torch.randn(5, 24 + 12, 64, generator=g).bfloat16()
    w_uk, w_uv = w[:, :24], w[:, 24:]  # strided per-head views, as up_weights gives them
    fold = torch.einsum("bshd,hdl->bshl", q.double(), w_uk.double())
    assert_close("fold", fold_queries(q, w_uk), fold, 1e-2)
    o = torch.randn(rows, 1, 5, 64, generator=g).bfloat16()
    unfold = torch.einsum("bshl,hvl->bshv", o.double(), w_uv.double())
    assert_close("unfold", unfold_values(o, w_uv), unfold, 1e-2)


def test_bench_says_which_core_runs():
    from mlakit.bench.context import BenchContext
    from mlakit.bench.report import header
    from mlakit.bench.results import environment

    env = environment(BenchContext(tiny_config(), torch.float32, "cpu"))
    # fp32 at the tiny widths (latent 20): no fused core takes them (or none runs here); the note says why
    assert env["core"] == "torch-float32" and env["core_note"]
    assert (env["core"], env["core_note"]) == cpu_core.describe(torch.float32, "cpu", tiny_config())
    doc = {"env": env, "model": "tiny", "dtype": "fp32", "gate": [], "skipped": []}
    doc["timing"] = {"repeats": 3, "min_repeats": 3, "warmup": 1}
    assert f"decode core: torch-float32 ({env['core_note']})" in header(doc)
    name, note = cpu_core.describe(torch.bfloat16)
    assert (name == "fused-avx512bf16") == cpu_core.available() and (note is None) == cpu_core.available()


def test_bench_names_the_torch_core_where_the_widths_do_not_fit(monkeypatch):
    from mlakit.bench.context import BenchContext
    from mlakit.bench.results import environment

    monkeypatch.setitem(cpu_core._state, "loaded", True)  # as if built: the widths alone decide
    monkeypatch.setitem(cpu_core._state, "why", None)
    cfg = tiny_config(kv_lora_rank=16, qk_rope_head_dim=4)
    env = environment(BenchContext(cfg, torch.bfloat16, "cpu"))
    assert env["core"] == "torch-float32" and "widths 16/4" in env["core_note"]
    assert cpu_core.describe(torch.bfloat16, "cpu", tiny_config(kv_lora_rank=48, qk_rope_head_dim=4))[0] == (
        "torch-float32"
    )
    assert cpu_core.describe(torch.bfloat16, "cpu", tiny_config(kv_lora_rank=64, qk_rope_head_dim=8)) == (
        "fused-avx512bf16",
        None,
    )


@pytest.mark.parametrize(
    "result,last",
    [
        ((None, False), "mlakit: fused CPU decode core built in 0 s ("),
        (
            ("cannot compile latent_decode.cpp: error: bad\nmore", True),
            "mlakit: fused CPU decode core not built "
            "(cannot compile latent_decode.cpp: error: bad); the torch path runs",
        ),
    ],
    ids=["built", "failed"],
)
def test_the_build_says_when_it_starts_and_ends(monkeypatch, tmp_path, capsys, result, last):
    monkeypatch.setenv("MLAKIT_CPU_CORE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_core, "cpu_has_bf16", lambda: True)
    calls = []
    monkeypatch.setattr(cpu_core, "_build", lambda lib: calls.append(lib) or result)
    cpu_core._load()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "mlakit: building the fused CPU decode core (once, ~1 min) ..."
    assert len(err) == 2 and err[1].startswith(last) and len(calls) == 1


def test_a_built_core_loads_without_a_build_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MLAKIT_CPU_CORE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_core, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(cpu_core, "_build", lambda lib: pytest.fail("built again"))
    (cpu_core._build_dir() / "mlakit_cpu_core.so").write_bytes(b"not a library")
    ok, why = cpu_core._load()
    assert not ok and "cannot load" in why and capsys.readouterr().err == ""


@pytest.mark.parametrize("rows", [9, 33, 64, 65])
def test_unfold_in_fused_chunks_equals_one_row_at_a_time(rows):
    """Past the fused core's 8 rows a call, unfold_values runs it 8 rows at a time up to
    UNFOLD_CHUNKED_ROWS (then a bmm): each row exactly as alone, all within bf16 of fp64."""
    need("fused")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(5, 24 + 12, 64, generator=g).bfloat16()
    w_uv = w[:, 24:]
    o = torch.randn(rows, 1, 5, 64, generator=g).bfloat16()
    got = unfold_values(o, w_uv)
    assert_close("unfold", got, torch.einsum("bshl,hvl->bshv", o.double(), w_uv.double()), 1e-2)
    if rows <= UNFOLD_CHUNKED_ROWS:
        alone = torch.cat([unfold_values(o[i : i + 1], w_uv) for i in range(rows)])
        assert torch.equal(got, alone)


# the fp32 core (AVX2 + FMA): everything in fp32, so its error is fp32 round-off at any width


def need_f32() -> None:
    if not cpu_core.available(torch.float32):
        pytest.skip(f"fp32 fused core unavailable: {cpu_core.unavailable_reason(torch.float32)}")


F32_SHAPES = {
    **SHAPES,
    "B2-S70-H3-T80/300": (2, 70, 3, 64, 8, [80, 300]),  # rows past one 64-row group, causal within
    "B1-S1-H16-T97": (1, 1, 16, 8, 1, [97]),  # narrowest widths: latent 8, rope 1; 96-key block + 1
}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", list(F32_SHAPES.values()), ids=list(F32_SHAPES))
def test_fp32_core_against_fp64(shape, splits):
    need_f32()
    batch, new, heads, latent, rope, lens = shape
    q_lat, q_pe, c_kv, k_pe, kv_lens = case(batch, new, heads, latent, rope, lens, dtype=torch.float32)
    o, lse = cpu_core.fused_latent(q_lat, q_pe, c_kv, k_pe, kv_lens, 0.1, splits=splits)
    want, want_lse = latent_oracle(q_lat, q_pe, c_kv, k_pe, kv_lens, new, 0.1)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert_lse_close("lse", lse, want_lse, atol=1e-5)
    assert_close("o_lat", o, want, 1e-5)
    assert torch.equal(o[torch.isneginf(lse)], torch.zeros_like(o[torch.isneginf(lse)]))


def test_fp32_core_reads_pages_in_place_and_auto_picks_it():
    need_f32()
    g = torch.Generator().manual_seed(7)
    batch, heads, lens = 3, 6, [5, 200, 129]
    q_nope = torch.randn(batch, 1, heads, 16, generator=g)
    q_pe = torch.randn(batch, 1, heads, 64, generator=g)
    c_kv = torch.randn(batch, 200, 512, generator=g)
    k_pe = torch.randn(batch, 200, 64, generator=g)
    w_uk, w_uv = torch.randn(heads, 16, 512, generator=g) / 4, torch.randn(heads, 12, 512, generator=g) / 20
    kv_lens = torch.tensor(lens)
    args = (q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, 0.1)
    fused, fused_lse = absorb(*args, core="fused")
    ref, ref_lse = reference(*[t.double() if t.is_floating_point() else t for t in args[:7]], 0.1)
    assert_close("fused vs fp64", fused, ref, 1e-5)
    assert_lse_close("lse vs fp64", fused_lse, ref_lse, atol=1e-5)
    assert torch.equal(absorb(*args)[0], fused)  # "auto" runs the fused core
    assert cpu_core.core_name(torch.float32) == "fused-avx2-fp32"
    # a shuffled pool of rows, NaN wherever no key of a row's length points
    pool = torch.full((batch * 200 + 7, 576), float("nan"))
    rows = torch.randperm(pool.shape[0], generator=g)[: batch * 200].view(batch, 200)
    for b, n in enumerate(lens):
        pool[rows[b, :n], :512], pool[rows[b, :n], 512:] = c_kv[b, :n], k_pe[b, :n]

    def read(start, stop):
        return c_kv[:, start:stop], k_pe[:, start:stop]

    pages = (pool[:, :512], pool[:, 512:], rows)
    paged, paged_lse = absorb_chunked(*args[:2], read, *args[4:], pages=pages, core="fused")
    assert torch.equal(paged, fused) and torch.equal(paged_lse, fused_lse)


def test_fp32_core_refuses_what_it_cannot_take():
    need_f32()
    q_lat, q_pe, c_kv, k_pe, lens = case(1, 1, 4, 20, 4, [9], dtype=torch.float32)  # latent 20: not 8k
    with pytest.raises(ValueError, match="widths 20/4"):
        cpu_core.use_fused("fused", q_lat, c_kv, k_pe)
    assert not cpu_core.use_fused("auto", q_lat, c_kv, k_pe)
    q_lat, q_pe, c_kv, k_pe, lens = case(1, 1, 4, 64, 8, [9], dtype=torch.float32)
    with pytest.raises(ValueError, match="bf16 or fp32 only"):
        cpu_core.use_fused("fused", q_lat, c_kv.double(), k_pe.double())
    with pytest.raises(ValueError, match="autograd"):
        cpu_core.use_fused("fused", q_lat.requires_grad_(), c_kv, k_pe)


def test_the_fp32_core_is_built_apart_and_turned_off_by_the_same_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("MLAKIT_CPU_CORE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_core, "cpu_has_avx2", lambda: False)
    assert cpu_core._load(cpu_core.F32) == (False, "this CPU has no AVX2 and FMA")
    monkeypatch.setattr(cpu_core, "cpu_has_avx2", lambda: True)
    built = []
    monkeypatch.setattr(cpu_core, "_build", lambda lib: built.append(lib.name) or ("no compiler", False))
    assert cpu_core._load(cpu_core.F32) == (False, "no compiler")
    assert built == ["mlakit_cpu_f32.so"]
    assert cpu_core._build_dir(cpu_core.F32) != cpu_core._build_dir(cpu_core.BF16)  # sources differ
    assert "latent_decode_f32.cpp" in " ".join(cpu_core._compile_command(tmp_path / "x.so", cpu_core.F32))
    monkeypatch.setenv("MLAKIT_CPU_CORE", "off")
    assert cpu_core._load(cpu_core.F32) == (False, "MLAKIT_CPU_CORE turns it off")


def test_every_file_a_core_builds_from_ships_in_the_package():
    # an installed (not editable) mlakit builds the cores from the files package-data ships: a header
    # left out made the bf16 core fail to build there and fall back to the torch core
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(cpu_core.__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists():
        pytest.skip("mlakit is installed, not run from its source tree")
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "mlakit"
    ]
    package = root / "mlakit"
    for core in (cpu_core.BF16, cpu_core.F32):
        for path in (core.source, *core.extra):
            name = path.relative_to(package).as_posix()
            assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not in package-data"

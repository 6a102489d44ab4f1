"""mlakit bench and calibrate at tiny widths: the gate, the results schema, the summary, the profile; and
what makes a bench figure trustworthy on a busy machine: the thread choice, noise marks, peaks, auto
against its own path, the help text against the code."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch

from mlakit.attention import MLAAttention
from mlakit.bench import BACKENDS, Backend, BenchOptions, CalibrateOptions, Cell, Grid, Timing, calibrate
from mlakit.bench import run as bench_run
from mlakit.bench.backends import MLA_ORACLE, mlakit_step
from mlakit.bench.context import BenchContext
from mlakit.bench.gate import check, gate_cells
from mlakit.bench.grid import parse_ints
from mlakit.bench.machine_state import MachineState, _choose, advisories
from mlakit.bench.report import summary_lines
from mlakit.bench.summary import auto_regret, crossovers, same_path
from mlakit.bench.sweep import run_sweep
from mlakit.bench.timing import QUICK_TIMING, Stats, stats_of, time_step
from mlakit.calibration import CrossoverProfile, attach, find_profile, profile_path, widths_of
from mlakit.cli import main
from mlakit.config import MLAConfig
from mlakit.cost import MachineProfile, validate_results
from mlakit.dispatch import choose
from mlakit.ops import absorb

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale_all_dim": 1.0}
TINY = MLAConfig(
    hidden_size=64,
    num_heads=8,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_scaling=YARN,
    rope_interleave=True,
    name="tiny",
)
TINY_NO_Q_LORA = TINY.replace(q_lora_rank=None, rope_scaling=None, rope_interleave=False, name="tiny-plain-q")
QUICK = Timing(warmup=0, repeats=1, min_repeats=1, budget_s=0.01)  # the tests time nothing
FAKE_MACHINE = MachineProfile("fake", {"fp32": 1e11, "bf16": 2e11}, 1e10, "test")
HF_CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "num_attention_heads": 8,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_hidden_layers": 1,
    "rope_theta": 10000.0,
}


def assert_close(name: str, got: float, want: float, rtol: float = 1e-12) -> None:
    err = abs(got - want)
    scale = max(abs(want), 1e-300)
    assert err <= rtol * scale, f"{name}: got {got!r}, want {want!r}, error {err:.3g}, scale {scale:.3g}"


@pytest.fixture(autouse=True)
def one_thread():
    # tiny matmuls on a shared 2-core machine: a second thread only adds barrier waits
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MLAKIT_CACHE_DIR", str(folder))
    return folder


# ---- grid and timing


@pytest.mark.parametrize(
    ("text", "want"),
    [("1", (1,)), ("1,8", (1, 8)), ("1K, 4k", (1024, 4096)), ("0", (0,))],
    ids=["one", "two", "k-suffix", "zero"],
)
def test_parse_ints(text, want):
    assert parse_ints(text, "context") == want


@pytest.mark.parametrize(
    "text", ["", "1,,2", "x", "1.5", "-3"], ids=["empty", "hole", "word", "float", "neg"]
)
def test_parse_ints_names_the_flag(text):
    with pytest.raises(ValueError, match="--new"):
        parse_ints(text, "new")


def test_grid_sorts_and_checks():
    g = Grid(batch=(8, 1, 8), context=(1024, 0), new=(4, 1))
    assert (g.batch, g.context, g.new, g.decode_new) == ((1, 8), (0, 1024), (1, 4), 1)
    assert len(g.cells()) == 8
    with pytest.raises(ValueError, match="--new"):
        Grid(batch=(1,), context=(0,), new=(0,))
    with pytest.raises(ValueError, match="batch"):
        Cell(0, 1, 1)


def test_time_step_counts_calls():
    calls = {"run": 0, "reset": 0}

    def run():
        calls["run"] += 1
        return torch.zeros(1)

    def reset():
        calls["reset"] += 1

    from mlakit.bench.backends import Step

    stats = time_step(
        Step(run, reset),
        torch.device("cpu"),
        Timing(warmup=2, repeats=3, min_repeats=3, budget_s=60, noisy_spread=1e9),
    )
    assert stats.repeats == 3 and calls == {"run": 5, "reset": 5}
    assert stats.ms_min <= stats.ms_median <= stats.ms_max


def test_noisy_cells_take_more_calls():
    import time

    from mlakit.bench.backends import Step

    pauses = iter([0.001, 0.008] * 20)
    timing = Timing(warmup=0, repeats=3, min_repeats=3, budget_s=60, noisy_spread=0.2, noisy_repeats=7)
    stats = time_step(Step(lambda: time.sleep(next(pauses))), torch.device("cpu"), timing)
    assert stats.repeats == 7 and stats.spread > 0.2


@pytest.mark.parametrize(
    ("call_s", "min_repeats", "calls", "repeats"),
    [(2.0, 1, 1, 1), (2.0, 2, 2, 2), (0.1, 1, 6, 5)],
    ids=["slow-warmup-counts", "slow-min-two", "fast-warmup-dropped"],
)
def test_time_step_counts_a_slow_warmup(monkeypatch, call_s, min_repeats, calls, repeats):
    # a fake clock: each run takes call_s seconds
    import mlakit.bench.timing as timing_mod
    from mlakit.bench.backends import Step

    clock = {"t": 0.0, "runs": 0}

    def run():
        clock["t"] += call_s
        clock["runs"] += 1

    monkeypatch.setattr(timing_mod.time, "perf_counter", lambda: clock["t"])
    t = Timing(warmup=1, repeats=5, min_repeats=min_repeats, budget_s=1.0)
    stats = time_step(Step(run), torch.device("cpu"), t)
    assert (clock["runs"], stats.repeats) == (calls, repeats)
    assert_close("median", stats.ms_median, 1e3 * call_s, 1e-9)


def test_timing_rejects_bad_settings():
    with pytest.raises(ValueError, match="min_repeats"):
        Timing(repeats=1, min_repeats=2)


# ---- the gate


@pytest.mark.parametrize("cfg", [TINY, TINY_NO_Q_LORA], ids=["q-lora-yarn", "plain-q"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_backend_agrees_with_its_oracle(cfg, dtype):
    ctx = BenchContext(cfg, dtype, "cpu")
    oracles = {}
    for backend in BACKENDS.values():
        if backend.oracle is None or not backend.available() or backend.sparse_only:
            continue
        verdict = check(backend, ctx, gate_cells(2, 100), oracles)
        assert verdict.ok, f"{backend.name}: {verdict.error}"
        assert verdict.rel_err <= verdict.tol


def _wrong_scale(q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, scale):
    # the classic MLA bug: softmax scale from the latent width instead of nope + rope
    return absorb(q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, (w_uk.shape[-1] + q_pe.shape[-1]) ** -0.5)


def _no_rope(q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, scale):
    return absorb(q_nope, torch.zeros_like(q_pe), c_kv, k_pe, kv_lens, w_uk, w_uv, scale)


def _raises(q_nope, *args):
    raise RuntimeError("kernel not built for this device")


WRONG = {
    "latent-scale": _wrong_scale,
    "no-rope": _no_rope,
    "raises": _raises,
}


@pytest.mark.parametrize("name", list(WRONG), ids=list(WRONG))
def test_gate_rejects_a_wrong_backend_and_never_times_it(name):
    wrong = Backend(f"wrong-{name}", mlakit_step("absorb", op=WRONG[name]), MLA_ORACLE, "absorb")
    ctx = BenchContext(TINY, torch.float32, "cpu")
    grid = Grid(batch=(1,), context=(16,), new=(1, 3))
    sweep = run_sweep(ctx, grid, [BACKENDS["mlakit-absorb"], wrong], QUICK, show_progress=False)
    verdict = {v.backend: v for v in sweep.verdicts}[wrong.name]
    assert not verdict.ok and verdict.error
    if name == "raises":
        assert "RuntimeError" in verdict.error and verdict.rel_err is None
    else:
        assert verdict.rel_err > verdict.tol
    assert {r["backend"] for r in sweep.rows} == {"mlakit-absorb"}


# ---- a whole run: files, schema, work counts


def _run(tmp_path, **kw):
    opts = BenchOptions(
        model=TINY,
        dtype="fp32",
        device="cpu",
        grid=Grid(batch=(1, 2), context=(8, 40), new=(1, 4)),
        timing=QUICK,
        out_dir=str(tmp_path / "out"),
        machine=FAKE_MACHINE,
        profile=None,
        progress=False,
    )
    return bench_run.run_bench(BenchOptions(**{**opts.__dict__, **kw}))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    torch.set_num_threads(1)
    return _run(tmp_path_factory.mktemp("bench"))


def test_results_follow_the_schema(tiny_run):
    doc = tiny_run
    validate_results(doc)
    assert doc["model"] == "tiny" and doc["dtype"] == "fp32"
    assert doc["env"]["threads"] >= 1 and doc["env"]["versions"]["torch"] == torch.__version__
    assert all(v["ok"] for v in doc["gate"])
    for row in doc["rows"]:
        assert 0 < row["ms_min"] <= row["ms_median"] <= row["ms_max"]
        assert row["flops"] > 0 and row["bytes"] > 0 and row["pct_peak_flops"] > 0
    cells = {(r["backend"], r["batch"], r["cached"], r["new"]) for r in doc["rows"]}
    assert len(cells) == len(doc["rows"])
    # the paths and auto in every cell; the baselines at decode only
    for b in ("mlakit-absorb", "mlakit-materialize", "mlakit-auto"):
        assert sum(r["backend"] == b for r in doc["rows"]) == 2 * 2 * 2
    for b in ("einsum-absorb", "transformers", "mha", "gqa8", "mqa", "mlakit-projections"):
        assert {r["new"] for r in doc["rows"] if r["backend"] == b} == {1}


def test_files_written(tiny_run):
    files = tiny_run["files"]
    with open(files["json"]) as f:
        assert json.load(f)["rows"] == json.loads(json.dumps(tiny_run["rows"]))
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(tiny_run["rows"]) and rows[0]["backend"] and float(rows[0]["ms_median"]) > 0
    assert os.path.getsize(files["explorer"]) > 1000
    for path in files.get("plots", []):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _row(doc, backend, batch, cached, new):
    return next(
        r
        for r in doc["rows"]
        if (r["backend"], r["batch"], r["cached"], r["new"]) == (backend, batch, cached, new)
    )


def test_projection_flops_by_hand(tiny_run):
    # q_a 64→32, q_b 32→8·24, kv_a 64→40, o_proj 8·16→64, per token, times 2 FLOPs
    per_token = 64 * 32 + 32 * 8 * 24 + 64 * 40 + 8 * 16 * 64
    row = _row(tiny_run, "mlakit-projections", 2, 40, 1)
    assert_close("projection FLOPs", row["flops"], 2 * 2 * per_token)


def test_mha_flops_by_hand(tiny_run):
    # 4 projections of 64×128, scores and weighted sum over 41 keys of 8 heads × 16
    row = _row(tiny_run, "mha", 1, 40, 1)
    want = 2 * (4 * 64 * 128 + 2 * 41 * 8 * 16)
    assert_close("MHA FLOPs", row["flops"], want)
    assert row["kv_heads"] == 8 and _row(tiny_run, "gqa8", 1, 40, 1)["kv_heads"] == 8


def test_absorb_decode_flops_by_hand(tiny_run):
    # projections, fold (8·16·32), scores over 41 keys of 40 wide, mix 32 wide, unfold (8·32·16)
    per_token = 64 * 32 + 32 * 8 * 24 + 64 * 40 + 8 * 16 * 64
    core = 8 * 16 * 32 + 41 * 8 * 40 + 41 * 8 * 32 + 8 * 32 * 16
    row = _row(tiny_run, "mlakit-absorb", 1, 40, 1)
    assert_close("absorb decode FLOPs", row["flops"], 2 * (per_token + core))
    assert_close("FLOP/s", row["flop_per_s"], row["flops"] / (row["ms_median"] / 1e3))
    assert_close("% of peak", row["pct_peak_flops"], 100 * row["flop_per_s"] / 1e11)


def test_summary_and_report(tiny_run):
    s = tiny_run["summary"]
    assert {(c["batch"], c["context"]) for c in s["crossover"]} == {(1, 8), (1, 40), (2, 8), (2, 40)}
    assert s["auto"]["cells"] == 8 and s["auto"]["decided_by"] == "analytic model"
    decode = {(d["batch"], d["context"]): d for d in s["decode"]}
    d = decode[(1, 40)]
    want = _row(tiny_run, "transformers", 1, 40, 1)["ms_median"] / d["absorb_ms"]
    assert_close("speedup over transformers", d["slower_than_absorb"]["transformers"], want)
    from mlakit.bench.report import render

    text = render(tiny_run)
    assert "crossover" in text and "auto (by analytic model)" in text and "transformers" in text


def test_plots_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_run.plots, "matplotlib_missing", lambda: "matplotlib is not installed: skipped")
    doc = _run(
        tmp_path, grid=Grid(batch=(1,), context=(8,), new=(1,)), backends=("mlakit-absorb",), explorer=False
    )
    assert "plots" not in doc["files"] and any("matplotlib" in n for n in doc["notes"])


# ---- summary arithmetic on rows made up by hand


def _rows(times: dict[tuple[str, int], float], picks: dict[int, str]) -> list[dict]:
    rows = []
    for (backend, new), ms in times.items():
        rows.append(
            {"backend": backend, "batch": 1, "cached": 64, "new": new, "dtype": "fp32", "ms_median": ms}
        )
    for new, path in picks.items():
        rows.append(
            {
                "backend": "mlakit-auto",
                "batch": 1,
                "cached": 64,
                "new": new,
                "dtype": "fp32",
                "ms_median": 1.0,
                "path": path,
            }
        )
    return rows


def test_auto_regret_by_hand():
    times = {("mlakit-absorb", 1): 1.0, ("mlakit-materialize", 1): 5.0}
    times |= {("mlakit-absorb", 16): 10.0, ("mlakit-materialize", 16): 10.4}
    times |= {("mlakit-absorb", 64): 40.0, ("mlakit-materialize", 64): 20.0}
    a = auto_regret(_rows(times, {1: "absorb", 16: "materialize", 64: "absorb"}), "analytic model")
    assert (a["cells"], a["within_5pct"], a["meets_target"]) == (3, 2, False)
    assert [m["new"] for m in a["misses"]] == [64]
    assert_close("regret", a["misses"][0]["regret"], 1.0)


def test_measured_crossover_in_summary_by_hand():
    # log-log interpolation: ratio mat/abs = 2 at 4 and 1/2 at 16 → crossing at 8
    times = {("mlakit-absorb", 4): 1.0, ("mlakit-materialize", 4): 2.0}
    times |= {("mlakit-absorb", 16): 4.0, ("mlakit-materialize", 16): 2.0}
    (c,) = crossovers(TINY, _rows(times, {}), "fp32", FAKE_MACHINE)
    assert_close("measured crossover", c["measured"], 8.0, 1e-9)
    assert c["flop_model"] is not None and c["roofline"] is not None


# ---- the calibration profile and auto


def _profile(points, cfg=TINY, max_new=256) -> CrossoverProfile:
    return CrossoverProfile("tiny", widths_of(cfg), "fp32", "cpu", points, max_new)


def test_profile_interpolates_in_log_context():
    p = _profile(((1024, 100.0), (256, 40.0)))
    assert p.points == ((256, 40.0), (1024, 100.0))
    assert_close("at 512", p.crossover_at(512), 70.0)  # halfway in log2 between 256 and 1024
    assert p.crossover_at(64) == 40.0 and p.crossover_at(1 << 20) == 100.0  # held at the ends
    assert p.decide(TINY, 69, 512) == "absorb" and p.decide(TINY, 70, 512) == "materialize"


def test_profile_without_crossover_decides_only_what_it_measured():
    p = _profile(((256, None),), max_new=64)
    assert p.crossover_at(256) is None
    assert p.decide(TINY, 64, 256) == "absorb" and p.decide(TINY, 65, 256) is None


def test_choose_follows_a_matching_profile_only():
    analytic = choose(TINY, 20, 1000)
    other = "materialize" if analytic == "absorb" else "absorb"
    crossing = 10.0 if other == "materialize" else 1000.0
    p = _profile(((1000, crossing),))
    assert choose(TINY, 20, 1000, profile=p) == other
    assert choose(TINY, 20, [900, 1100], profile=p) == other
    assert choose(TINY_NO_Q_LORA.replace(num_heads=4), 20, 1000, profile=p) == choose(
        TINY_NO_Q_LORA.replace(num_heads=4), 20, 1000
    )


def test_profile_roundtrip_find_and_attach(cache_dir):
    p = _profile(((256, 12.5), (1024, None)))
    path = p.save(profile_path(TINY, "fp32", "cpu"))
    assert path.startswith(str(cache_dir))
    assert CrossoverProfile.load(path) == p
    assert find_profile(TINY, "fp32", "cpu") == p
    assert find_profile(TINY, "bf16", "cpu") is None
    layer = MLAAttention(TINY)
    assert attach(layer) == p and layer.profile == p
    hidden = torch.randn(1, 20, TINY.hidden_size)
    from mlakit.cache.contiguous import LatentCache

    cache = LatentCache(TINY, 1, 600)
    # 256 cached tokens (written: lengths cannot be raised over tokens never written)
    cache.append(torch.zeros(1, 256, TINY.kv_lora_rank), torch.zeros(1, 256, TINY.qk_rope_head_dim))
    with torch.inference_mode():
        _, plan = layer.step(hidden, cache, mode="auto")
    assert plan.mode == "materialize"  # 20 new tokens >= the measured 12.5


def test_profile_rejects_foreign_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"model": "x"}')
    with pytest.raises(ValueError, match="lacks"):
        CrossoverProfile.load(str(path))


def test_calibrate_measures_points(monkeypatch):
    opts = CalibrateOptions(
        model=TINY, contexts=(8, 64), max_new=16, timing=QUICK, measure_machine=False, progress=False
    )
    profile, rows = calibrate(opts)
    assert [t for t, _ in profile.points] == [8, 64]
    assert profile.widths == widths_of(TINY) and profile.dtype == "fp32" and profile.device == "cpu"
    assert profile.max_new == max(r["new"] for r in rows) <= 16
    assert {r["backend"] for r in rows} == {"mlakit-absorb", "mlakit-materialize"}


# ---- the CLI


def _fake_machine(monkeypatch):
    monkeypatch.setattr(bench_run, "resolve_machine", lambda machine, device: FAKE_MACHINE)
    import mlakit.bench.calibrator as cal

    monkeypatch.setattr(cal, "_machine", lambda device: FAKE_MACHINE)


def test_cli_calibrate_then_bench_uses_the_profile(tmp_path, cache_dir, monkeypatch, capsys):
    _fake_machine(monkeypatch)
    model = tmp_path / "config.json"
    model.write_text(json.dumps(HF_CONFIG))
    flags = ["--model", str(model), "--dtype", "fp32", "--device", "cpu", "--quick"]
    # one context: no neighbour for the consistency checks to find noise against at these tiny widths
    assert main(["calibrate", *flags, "--context", "8", "--max-new", "4"]) == 0
    out = capsys.readouterr().out
    saved = out.split("saved ")[1].split()[0]
    assert saved.startswith(str(cache_dir)) and os.path.isfile(saved)
    args = ["bench", *flags, "--json", "--context", "8", "--new", "1,4"]
    args += ["--backends", "mlakit-absorb,mlakit-materialize,mlakit-auto"]
    assert main(args + ["--out", str(tmp_path / "b")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["auto"]["decided_by"] == "measured profile"
    assert doc["auto_profile"]["points"] and os.path.isfile(tmp_path / "b" / "results.csv")


def test_cli_calibrate_out_file(tmp_path, cache_dir, monkeypatch, capsys):
    _fake_machine(monkeypatch)
    model = tmp_path / "config.json"
    model.write_text(json.dumps(HF_CONFIG))
    target = tmp_path / "mine.json"
    args = ["calibrate", "--model", str(model), "--device", "cpu", "--context", "4", "--max-new", "1"]
    assert main(args + ["--quick", "--json", "--out", str(target)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == str(target) and CrossoverProfile.load(str(target)).max_new == 1
    assert not cache_dir.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--new", "0"], "--new"),
        (["--context", "abc"], "--context"),
        (["--backends", "nope"], "unknown backends"),
    ],
    ids=["zero-new", "bad-context", "unknown-backend"],
)
def test_cli_bench_bad_flags(args, message, capsys, monkeypatch, tmp_path):
    _fake_machine(monkeypatch)
    assert main(["bench", "--model", "deepseek-v3", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("step", "max_new", "want"),
    [(4, 512, [1, 4, 16, 64, 256, 512]), (4, 256, [1, 4, 16, 64, 256]), (2, 1, [1]), (3, 10, [1, 3, 9, 10])],
    ids=["4-to-512", "4-to-256", "just-decode", "3-to-10"],
)
def test_calibrate_counts_end_at_max_new(step, max_new, want):
    from mlakit.bench.calibrator import _counts

    assert _counts(step, max_new) == want


# ---- the DSA layer's rows (mlakit-sparse): index_topk 8, so that sparsity bites within 40 tokens

TINY_DSA = TINY.replace(
    index_n_heads=8, index_head_dim=16, index_topk=8, indexer_rope_interleave=False, name="tiny-dsa"
)
SPARSE_CELLS = [Cell(1, 5, 1), Cell(2, 8, 1), Cell(2, 9, 1), Cell(2, 40, 1), Cell(2, 40, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_backend_agrees_with_its_fp64_oracle(dtype):
    ctx = BenchContext(TINY_DSA, dtype, "cpu")
    verdict = check(BACKENDS["mlakit-sparse"], ctx, SPARSE_CELLS, {})
    assert verdict.ok, verdict.error
    with torch.inference_mode():
        step = BACKENDS["mlakit-sparse"].prepare(ctx, Cell(1, 40, 1), ctx.inputs(Cell(1, 40, 1)))
        step.reset()
        step.run()
    assert step.describe() == {"path": "sparse-absorb"}


def test_sparse_gate_can_fail():
    # past index_topk the DSA layer is not dense MLA: against the dense oracle the gate must reject it
    ctx = BenchContext(TINY_DSA, torch.float32, "cpu")
    as_dense = Backend("sparse-vs-dense", BACKENDS["mlakit-sparse"].prepare, MLA_ORACLE, None)
    verdict = check(as_dense, ctx, [Cell(2, 40, 1)], {})
    assert not verdict.ok and verdict.rel_err > verdict.tol


@pytest.mark.parametrize(
    "names, sparse, want",
    [(None, False, False), (None, True, True), (("mlakit-sparse",), True, True)],
    ids=["dense-default", "sparse-default", "sparse-named"],
)
def test_sparse_backend_only_for_dsa_models(names, sparse, want):
    from mlakit.bench.backends import resolve_backends

    assert ("mlakit-sparse" in [b.name for b in resolve_backends(names, sparse=sparse)]) == want


def test_sparse_backend_refused_for_a_dense_model():
    from mlakit.bench.backends import resolve_backends

    with pytest.raises(ValueError, match="mlakit-sparse"):
        resolve_backends(["mlakit-absorb", "mlakit-sparse"], sparse=False)


def test_dense_run_has_no_sparse_rows(tiny_run):
    from mlakit.bench.report import render

    assert "sparse" not in tiny_run["summary"]
    assert not any(r["backend"] == "mlakit-sparse" for r in tiny_run["rows"])
    assert "sparse decode" not in render(tiny_run)


def test_sparse_rows_in_a_dsa_run(tmp_path):
    from mlakit.bench.report import render
    from mlakit.cost import sparse_path_macs

    doc = _run(
        tmp_path,
        model=TINY_DSA,
        grid=Grid(batch=(1,), context=(4, 40), new=(1,)),
        backends=("mlakit-absorb", "mlakit-sparse", "mlakit-projections"),
        plots=False,
        explorer=False,
    )
    validate_results(doc)
    assert all(v["ok"] for v in doc["gate"])
    assert _row(doc, "mlakit-sparse", 1, 4, 1)["path"] == "absorb"  # every query sees <= k: dense
    row = _row(doc, "mlakit-sparse", 1, 40, 1)
    assert row["path"] == "sparse-absorb"
    # the projections (as dense MLA's) plus the sparse path and its indexer, from the sparse cost model
    per_token = 64 * 32 + 32 * 8 * 24 + 64 * 40 + 8 * 16 * 64
    core = sparse_path_macs(TINY_DSA, "sparse-absorb", 1, 40, "causal")  # the decode query sees itself
    assert_close("sparse FLOPs", row["flops"], 2 * (per_token + core))
    assert row["roofline_ms"] > 0
    sparse = {r["context"]: r for r in doc["summary"]["sparse"]}
    assert set(sparse) == {4, 40} and sparse[40]["index_topk"] == 8
    want = _row(doc, "mlakit-absorb", 1, 40, 1)["ms_median"] / row["ms_median"]
    assert_close("sparse vs absorb", sparse[40]["speedup_vs_absorb"], want)
    text = render(doc)
    assert "sparse decode (DSA, index_topk 8)" in text
    line = next(ln for ln in text.splitlines() if "sparse-absorb" in ln)
    assert f"{row['ms_median']:.1f}" in line and f"x{want:.2f}" in line


# ---- what makes a figure trustworthy on a busy machine


@pytest.mark.parametrize(
    ("requested", "load", "one", "every", "want"),
    [
        (None, 0.1, 2.0, 1.0, 2),  # free cores, threads help x2
        (None, 2.5, 2.0, 1.0, 1),  # busy cores
        (None, 0.1, 2.0, 1.9, 1),  # threads barely help
        (None, 0.1, 1.7, 32.0, 1),  # spinning threads: 2 threads far slower
        (2, 2.5, 1.7, 32.0, 2),  # asked for: kept, and the reason says so
    ],
    ids=["free-fast", "busy", "no-gain", "spin", "asked"],
)
def test_thread_choice(requested, load, one, every, want):
    threads, reason = _choose(requested, "cpu", 2, load, 2, one, every)
    assert threads == want and f"load {load:.1f} on 2 cores" in reason


def test_advisory_names_omp_wait_policy_when_threads_spin():
    state = MachineState(2, 2.5, 2, 1.7, 32.0, None, 2, "asked")
    text = " ".join(advisories(state))
    assert "OMP_WAIT_POLICY=PASSIVE" in text and "busy" in text
    assert not advisories(MachineState(2, 0.0, 2, 2.0, 1.0, "PASSIVE", 2, "free"))


def test_quick_timing_never_times_one_call():
    assert QUICK_TIMING.min_repeats >= 3


@pytest.mark.parametrize(
    ("seconds", "spread"), [([1.0, 1.0, 1.0], 0.0), ([1.0, 2.0, 1.5], 2 / 3)], ids=["flat", "wide"]
)
def test_spread(seconds, spread):
    assert stats_of(seconds).spread == pytest.approx(spread)


def _timed_row(backend, ms, spread=0.0, **kw):
    return dict(backend=backend, batch=1, cached=256, new=1, dtype="fp32", ms_median=ms, spread=spread, **kw)


@pytest.mark.parametrize(
    ("auto_ms", "spread", "within"),
    [(1.03, 0.02, True), (1.3, 0.02, False), (1.3, 0.4, True)],
    ids=["close", "apart", "noisy"],
)
def test_auto_against_its_own_path(auto_ms, spread, within):
    rows = [_timed_row("mlakit-absorb", 1.0, spread), _timed_row("mlakit-auto", auto_ms, 0.0, path="absorb")]
    (check,) = same_path(rows)
    assert check["within_noise"] is within and check["ratio"] == pytest.approx(auto_ms)


def _doc(pct_bw):
    decode = {
        "batch": 1,
        "context": 256,
        "new": 1,
        "absorb_ms": 1.0,
        "slower_than_absorb": {},
        "absorb_core_pct_peak_flops": None,
        "absorb_pct_peak_bandwidth": pct_bw,
        "absorb_roofline_fraction": pct_bw / 100,
        "absorb_spread": 0.0,
    }
    crossover = {
        "batch": 1,
        "context": 256,
        "measured": None,
        "measured_max_new": 16,
        "counting": "causal",
        "flop_model": 135.0,
        "roofline": None,
        "noisy": False,
    }
    auto = {"cells": 0}
    return {
        "summary": {"crossover": [crossover], "decode": [decode], "auto": auto, "same_path": []},
        "rows": [],
    }


@pytest.mark.parametrize(
    ("pct", "shown"), [(40.0, "40% of peak bandwidth"), (108.0, "unreliable")], ids=["ok", "over"]
)
def test_no_figure_above_the_peak(pct, shown):
    text = "\n".join(summary_lines(_doc(pct)))
    assert shown in text and "108%" not in text and "causal counting" in text


def test_bench_help_defaults_match_the_grid():
    from mlakit.bench.grid import DEFAULT_GRID, QUICK_GRID
    from mlakit.commands.bench import DEFAULT_LISTS, QUICK_LISTS

    for lists, grid in ((DEFAULT_LISTS, DEFAULT_GRID), (QUICK_LISTS, QUICK_GRID)):
        assert lists == {"batch": grid.batch, "context": grid.context, "new": grid.new}


def test_stats_spread_zero_for_one_call():
    assert Stats(1.0, 1.0, 1.0, 1).spread == 0.0


@pytest.mark.parametrize(
    ("value", "label"), [(1, "1"), (16, "16"), (1024, "1K"), (4096, "4K"), (1 << 20, "1M"), (1536, "1536")]
)
def test_plot_ticks_read_as_tokens(value, label):
    from mlakit.bench.plots import token_label

    assert token_label(value) == label

"""mlakit.cost against numbers worked out by hand (the articles *Understanding MLA Decoding* and
*From MHA to MLA*), and its own invariants."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlakit import cost
from mlakit.config import PRESETS, MLAConfig
from mlakit.dispatch import choose

V3 = MLAConfig.preset("deepseek-v3")
GLM5 = MLAConfig.preset("glm-5")
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "cost-model.md")


def assert_close(name: str, got: float, want: float, rtol: float = 1e-9) -> None:
    err = abs(got - want)
    scale = max(abs(want), 1e-300)
    assert err <= rtol * scale, f"{name}: got {got!r}, want {want!r}, error {err:.3g}, scale {scale:.3g}"


def widths(heads=1, latent=3, nope=2, rope=2, v=2, layers=1) -> MLAConfig:
    return MLAConfig(
        hidden_size=8,
        num_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=latent,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        num_layers=layers,
    )


# the toy of *Understanding MLA Decoding*: one head, latent 3, nope 2, value 2, three cached tokens,
# one query.
# the toy has no rope; mlakit needs an even rope width >= 2, and rope terms are equal on both sides.
TOY = widths()


def test_toy_terms_by_hand():
    assert cost.materialize_macs(TOY, new=1, cached=3) == {
        "expand_k": 3 * 2 * 3,  # 3 tokens · (1×3)·(3×2)
        "expand_v": 3 * 2 * 3,
        "scores": 3 * (2 + 2),  # 1 query · 3 keys · (nope + rope)
        "weighted_sum": 3 * 2,
    }
    assert cost.absorb_macs(TOY, new=1, cached=3) == {
        "fold_q": 2 * 3,  # (1×2)·(2×3)
        "scores": 3 * (3 + 2),  # 3 keys of latent + rope
        "mix_latents": 3 * 3,
        "unfold_v": 3 * 2,
    }


def test_toy_crossover_by_hand():
    # c·L·(dn+dv) / (L·(dn+dv) + c·(2L−dn−dv)) = 3·3·4 / (12 + 3·2) = 2; limit 12 / 2 = 6
    point = cost.crossover(TOY, 3)
    assert point.exact == 2.0
    assert point.asymptotic == 6.0
    assert cost.path_macs(TOY, "materialize", 2, 3) == cost.path_macs(TOY, "absorb", 2, 3) == 72


@pytest.mark.parametrize(
    "cfg,context,want",
    [
        (V3, 4096, 4096 * 512 * 256 / (512 * 256 + 4096 * 768)),  # 163.84
        (V3, 0, 0.0),
        (V3, 1, 512 * 256 / (512 * 256 + 768)),
        (GLM5, 4096, 4096 * 512 * 448 / (512 * 448 + 4096 * 576)),
        (MLAConfig.preset("minicpm3-4b"), 32768, 32768 * 256 * 128 / (256 * 128 + 32768 * 384)),
    ],
    ids=["v3-4096", "v3-0", "v3-1", "glm5-4096", "minicpm3-32k"],
)
def test_exact_against_articles_formula(cfg, context, want):
    assert_close("exact", cost.crossover(cfg, context).exact, want)


def test_published_figures():
    assert_close("V3 limit", cost.crossover(V3, 4096).asymptotic, 512 * 256 / 768)
    assert round(cost.crossover(V3, 4096).asymptotic, 1) == 170.7
    assert round(cost.crossover(V3, 4096).exact, 1) == 163.8
    # *Understanding MLA Decoding* says about 228 for GLM; its own formula gives 512·448/576 ≈ 398.2
    assert round(cost.crossover(GLM5, 4096).asymptotic, 1) == 398.2
    assert round(cost.crossover(MLAConfig.preset("kimi-k2"), 4096).asymptotic, 1) == 170.7


def macs_gap(cfg: MLAConfig, new: float, context: int, model: str) -> float:
    return cost.path_macs(cfg, "materialize", new, context, model) - cost.path_macs(
        cfg, "absorb", new, context, model
    )


def causal_by_hand(cfg: MLAConfig, c: int) -> float:
    # gap/h = c·L·(dn+dv) − D·(n·c + n(n+1)/2), D = 2L − dn − dv: root of D/2·n² + D(c+½)·n − c·L·(dn+dv)
    lat, dn, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    d = 2 * lat - dn - dv
    b = d * (c + 0.5)
    return (-b + math.sqrt(b * b + 2 * d * c * lat * (dn + dv))) / d


@pytest.mark.parametrize("context", [1, 7, 4096, 131072, 1_000_000], ids=lambda c: f"c{c}")
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_exact_is_where_the_term_sums_meet(name, context):
    cfg = MLAConfig.preset(name)
    for model in cost.MODELS:
        n = cost.crossover(cfg, context, model).exact
        mat = cost.path_macs(cfg, "materialize", n, context, model)
        absorb = cost.path_macs(cfg, "absorb", n, context, model)
        assert_close(f"{name} {model} totals at the crossover", mat, absorb, 1e-9)
        assert macs_gap(cfg, n * 0.99, context, model) > 0 > macs_gap(cfg, n * 1.01, context, model)
    assert_close("causal by hand", cost.crossover(cfg, context, "causal").exact, causal_by_hand(cfg, context))


def test_causal_limit_equals_the_independent_one():
    far = 10**12
    assert_close("causal far", cost.crossover(V3, far, "causal").exact, 512 * 256 / 768, 1e-6)
    assert_close("independent far", cost.crossover(V3, far).exact, 512 * 256 / 768, 1e-6)


@pytest.mark.parametrize(
    "latent,nope,v,context,model,want",
    [
        (128, 128, 128, 5, "independent", 5.0),  # 2L == nope+v: the totals meet at n == context
        (64, 128, 128, 64, "independent", 128.0),  # 2L < nope+v: 64·16384 / (16384 − 64·128)
        (64, 128, 128, 128, "independent", None),  # denominator 0: absorb never loses
        (64, 128, 128, 4096, "independent", None),
        (64, 128, 128, 64, "causal", None),  # every term favours absorb
        (64, 128, 128, 0, "causal", None),
        (128, 128, 128, 0, "independent", 0.0),
    ],
    ids=["equal-c5", "below-c64", "below-c128", "below-c4096", "below-causal", "below-causal-c0", "equal-c0"],
)
def test_no_long_context_crossover(latent, nope, v, context, model, want):
    cfg = widths(heads=4, latent=latent, nope=nope, rope=64, v=v)
    point = cost.crossover(cfg, context, model)
    assert point.asymptotic is None
    assert point.exact == want


@settings(max_examples=300, deadline=None)
@given(
    heads=st.integers(1, 256),
    latent=st.integers(1, 1024),
    nope=st.integers(1, 512),
    rope=st.integers(1, 64).map(lambda r: 2 * r),
    v=st.integers(1, 512),
    context=st.integers(0, 2_000_000),
    model=st.sampled_from(cost.MODELS),
)
def test_crossover_is_never_negative_or_infinite(heads, latent, nope, rope, v, context, model):
    cfg = widths(heads, latent, nope, rope, v)
    point = cost.crossover(cfg, context, model)
    for x in (point.exact, point.asymptotic):
        assert x is None or (math.isfinite(x) and x >= 0)
    if point.exact is not None and point.exact > 0:
        lo, hi = point.exact * (1 - 1e-6), point.exact * (1 + 1e-6)
        assert cost.path_macs(cfg, "materialize", lo, context, model) >= cost.path_macs(
            cfg, "absorb", lo, context, model
        )
        assert cost.path_macs(cfg, "materialize", hi, context, model) < cost.path_macs(
            cfg, "absorb", hi, context, model
        )


def test_shared_projections_by_hand():
    assert cost.shared_macs(V3, 1) == {
        "q_a_proj": 7168 * 1536,
        "q_b_proj": 1536 * 128 * 192,
        "kv_a_proj_with_mqa": 7168 * 576,
        "o_proj": 128 * 128 * 7168,
    }
    lite = cost.shared_macs(MLAConfig.preset("deepseek-v2-lite"), 2)
    assert lite["q_proj"] == 2 * 2048 * 16 * 192 and "q_a_proj" not in lite
    core = cost.path_macs(V3, "absorb", 3, 100)
    assert cost.path_macs(V3, "absorb", 3, 100, include_shared=True) == core + sum(
        cost.shared_macs(V3, 3).values()
    )


def test_causal_counts_the_chunk():
    assert cost.keys_seen(4, 10, "causal") == 4 * 10 + 10  # 1 + 2 + 3 + 4 earlier-or-self new keys
    assert cost.expanded_tokens(4, 10, "causal") == 14
    assert cost.materialize_macs(V3, 4, 10, "causal")["expand_k"] == 14 * 128 * 128 * 512


# --- cache economics (the figures of *From MHA to MLA*)


def test_cache_values_and_bytes_v3():
    e = cost.cache_economics(V3, 1_000_000, "bf16")
    v = e["values_per_token_per_layer"]
    assert (v["mla"], v["expanded"], v["mha"], v["mqa"], v["gqa8"]) == (576, 40_960, 32_768, 256, 2048)
    assert e["bytes_per_token"]["mla"] == 70_272  # 576 · 2 B · 61 layers
    assert e["bytes_per_sequence"]["mla"] == 70_272 * 10**6
    assert round(e["bytes_per_sequence"]["mla"] / 1e9) == 70  # ≈ 70 GB at 1M tokens
    assert e["bytes_per_token"]["mha"] == 32_768 * 2 * 61  # 3,997,696 B ≈ 4 MB per token
    assert cost.format_bytes(e["bytes_per_token"]["mha"]) == "4.00 MB"
    assert e["mla_equivalent_gqa_groups"] == 2.25  # 576 / (2 · 128)


@pytest.mark.parametrize(
    "dtype,want",
    [("fp32", 576 * 4), ("bf16", 576 * 2), ("fp8", 512 + 4 * 4 + 64 * 2), ("int8", 512 + 4 + 64 * 2)],
    ids=["fp32", "bf16", "fp8", "int8"],
)
def test_latent_bytes_per_dtype(dtype, want):
    assert cost.cache_economics(V3, 1, dtype)["bytes_per_token_per_layer"]["mla"] == want


def test_fp8_is_656_bytes_and_per_head_caches_quantize_per_vector():
    per_layer = cost.cache_economics(V3, 1, "fp8")["bytes_per_token_per_layer"]
    assert per_layer["mla"] == 656
    assert per_layer["mha"] == 128 * 2 * (128 + 4)  # each head's K and V: 128 fp8 + one scale
    assert per_layer["expanded"] == 128 * 2 * (128 + 4) + 128 * 64 * 2  # plus per-head bf16 rope
    assert cost.cache_economics(V3, 1, "int8")["bytes_per_token_per_layer"]["mqa"] == 2 * (128 + 4)


@pytest.mark.parametrize(
    "name,expanded", [("kimi-k2", 20_480), ("glm-5", 32_768), ("deepseek-v3", 40_960)], ids=str
)
def test_expanded_cache_article_000(name, expanded):
    v = cost.cache_economics(MLAConfig.preset(name), 1)["values_per_token_per_layer"]
    assert v["mla"] == 576 and v["expanded"] == expanded


def test_gqa_groups_only_where_defined():
    glm_flash = MLAConfig.preset("glm-4.7-flash")  # 20 heads
    keys = cost.cache_economics(glm_flash, 1, gqa_groups=(3, 4, 8, 20, 1))["values_per_token_per_layer"]
    assert list(keys) == ["mla", "expanded", "mha", "gqa4", "mqa"]
    with pytest.raises(ValueError, match="positive integers"):
        cost.cache_economics(V3, 1, gqa_groups=(0,))


@pytest.mark.parametrize(
    "n,text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.00 kB"),
        (70_272, "70.3 kB"),
        (70_250, "70.3 kB"),
        (4.5e12, "4.50 TB"),
    ],
    ids=str,
)
def test_format_bytes(n, text):
    assert cost.format_bytes(n) == text


# --- bytes and the roofline


def test_decode_bytes_by_hand():
    b = cost.absorb_bytes(V3, 1, 4096, dtype="bf16")
    assert b["scores"] == 4096 * 576 * 2 + 128 * 576 * 2  # the whole cache once, q_lat and q_pe
    assert b["fold_q"] == (128 * 128 + 128 * 128 * 512 + 128 * 512) * 2
    fp8 = cost.absorb_bytes(V3, 1, 4096, dtype="fp8")
    assert fp8["scores"] == 4096 * 656 + 128 * 576 * 2  # quantized cache, bf16 activations
    unfused = sum(cost.materialize_bytes(V3, 1, 4096).values())
    fused = sum(cost.materialize_bytes(V3, 1, 4096, fused=True).values())
    assert unfused - fused == 2 * 4096 * 128 * (128 + 128) * 2  # K and V written once and read once


def test_term_time_is_max_of_compute_and_memory():
    machine = cost.MachineProfile("toy", {"fp32": 1e3, "bf16": 2e3}, memory_bandwidth=100.0)
    t = cost.term_times({"a": 1000, "b": 10}, {"a": 10, "b": 1000}, machine, "bf16")
    assert t["a"] == {"compute_s": 1.0, "memory_s": 0.1, "time_s": 1.0, "bound": "compute"}
    assert t["b"]["time_s"] == 10.0 and t["b"]["bound"] == "memory"
    assert cost.term_times({"a": 1000}, {"a": 0}, machine, "fp32")["a"]["compute_s"] == 2.0


@pytest.mark.parametrize("name", ["deepseek-v3", "glm-5", "minicpm3-4b"])
def test_roofline_with_free_memory_is_the_flop_crossover(name):
    cfg = MLAConfig.preset(name)
    compute_only = cost.MachineProfile("compute-bound", {"fp32": 1e12, "bf16": 1e12}, memory_bandwidth=1e40)
    assert_close(
        "roofline", cost.roofline_crossover(cfg, 4096, compute_only), cost.crossover(cfg, 4096).exact, 1e-6
    )


def test_roofline_with_free_compute_is_the_byte_crossover():
    memory_only = cost.MachineProfile("memory-bound", {"fp32": 1e40, "bf16": 1e40}, memory_bandwidth=1e12)
    n = cost.roofline_crossover(V3, 4096, memory_only)

    def byte_gap(x):
        return sum(cost.materialize_bytes(V3, x, 4096).values()) - sum(
            cost.absorb_bytes(V3, x, 4096).values()
        )

    assert byte_gap(n * 0.999) > 0 > byte_gap(n * 1.001)


def test_roofline_on_the_datasheet_machines():
    for name in ("h100", "h200", "h800"):
        n = cost.roofline_crossover(V3, 4096, name)
        machine = cost.MACHINES[name]
        for x, sign in ((n * 0.999, 1), (n * 1.001, -1)):
            gap = cost.path_time(V3, "materialize", x, 4096, machine) - cost.path_time(
                V3, "absorb", x, 4096, machine
            )
            assert gap * sign > 0 or (sign < 0 and gap == 0)
    assert cost.MACHINES["h200"].memory_bandwidth == 4.8e12
    assert cost.MACHINES["h100"].peak_flops["bf16"] == 989.4e12


def test_machine_profile_roundtrip(tmp_path):
    path = str(tmp_path / "m.json")
    cost.MACHINES["h800"].save(path)
    assert cost.resolve_machine(path) == cost.MACHINES["h800"]
    with pytest.raises(ValueError, match="neither a preset"):
        cost.resolve_machine("b200")
    with pytest.raises(ValueError, match="memory_bandwidth"):
        cost.MachineProfile.from_dict({"name": "x", "peak_flops": {"fp32": 1, "bf16": 1}})
    with pytest.raises(ValueError, match="peak_flops"):
        cost.MachineProfile("x", {"fp32": 1.0}, 1.0)
    with pytest.raises(ValueError, match="memory_bandwidth"):
        cost.MachineProfile("x", {"fp32": 1.0, "bf16": 1.0}, -1.0)


def test_cost_report_totals():
    r = cost.cost_report(V3, 4096, 1, "bf16", "h100")
    mat = r["totals"]["materialize"]
    assert mat["macs"] == cost.path_macs(V3, "materialize", 1, 4096)
    assert mat["macs_with_shared"] == cost.path_macs(V3, "materialize", 1, 4096, include_shared=True)
    assert r["faster"] == r["fewer_macs"] == "absorb"
    assert r["crossover"]["exact"] == cost.crossover(V3, 4096).exact


# --- measured crossover (the bench results schema)


def rows_from(absorb: dict, mat: dict, cached=4096, batch=1, dtype="bf16") -> list[dict]:
    out = []
    for backend, pts in (("mlakit-absorb", absorb), ("mlakit-materialize", mat)):
        for n, ms in pts.items():
            out.append(dict(backend=backend, batch=batch, new=n, cached=cached, dtype=dtype, ms_median=ms))
    return out


@pytest.mark.parametrize(
    "mat_ms,want",
    [(6.0, 6.0), (8.0, 8.0), (0.5, 1.0), (100.0, None)],
    ids=["between-points", "on-a-point", "below-first", "never"],
)
def test_measured_crossover(mat_ms, want):
    # absorb takes n ms, materialize a constant: straight lines in log-log, so interpolation is exact
    rows = rows_from({n: float(n) for n in (1, 2, 4, 8, 16)}, {n: mat_ms for n in (1, 2, 4, 8, 16)})
    got = cost.measured_crossover(rows, 4096, 1, "bf16")
    if want is None:
        assert got is None
    else:
        assert_close("measured", got, want, 1e-12)
    assert cost.measured_crossover(rows, 1024, 1, "bf16") is None  # no such cell


@pytest.mark.parametrize(
    "data,match",
    [
        ([], "'rows' list"),
        ({"rows": [{"backend": "x"}]}, "lacks"),
        ({"rows": [dict(backend="x", batch=0, new=1, cached=0, dtype="bf16", ms_median=1.0)]}, "batch"),
        ({"rows": [dict(backend="x", batch=1, new=1, cached=0, dtype="bf16", ms_median=-1)]}, "ms_median"),
        ({"rows": [dict(backend="x", batch=1, new=1, cached=0, dtype="bf16", ms_median=1)] * 2}, "repeats"),
    ],
    ids=["not-object", "missing", "batch", "ms", "duplicate"],
)
def test_results_schema_errors(data, match):
    with pytest.raises(ValueError, match=match):
        cost.validate_results(data)


# --- bad input, dispatch, docs


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: cost.crossover(V3, -1), "context"),
        (lambda: cost.crossover(V3, 10, "prefill"), "counting model"),
        (lambda: cost.materialize_macs(V3, -2, 10), "new"),
        (lambda: cost.absorb_macs(V3, 1, float("inf")), "cached"),
        (lambda: cost.path_macs(V3, "flash", 1, 1), "mode"),
        (lambda: cost.cache_economics(V3, 10, "fp16"), "dtype"),
        (lambda: cost.cache_economics(V3, -1), "context"),
        (lambda: cost.absorb_bytes(V3, 1, 1, dtype="int4"), "dtype"),
    ],
    ids=["context", "model", "new", "cached", "mode", "dtype", "cache-context", "bytes-dtype"],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_dispatch_still_uses_the_exact_crossover():
    assert choose(V3, 1, 4096) == "absorb"
    assert choose(V3, 163, 4096) == "absorb"
    assert choose(V3, 164, 4096) == "materialize"
    assert choose(V3, 4, [100, 300]) == "absorb"


def test_docs_table_is_current():
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    assert cost.markdown_tables() in text, (
        "docs/cost-model.md is stale: run `python -m mlakit.cost --markdown`"
    )


def test_cost_imports_only_config_and_the_standard_library():
    import ast
    import glob
    import sys

    allowed = {"mlakit.config"} | set(sys.stdlib_module_names) | {"__future__"}
    folder = os.path.join(os.path.dirname(cost.__file__), "*.py")
    for path in glob.glob(folder):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module]
            for name in names:
                ok = (
                    name.startswith("mlakit.cost")
                    or name in allowed
                    or name.split(".")[0] in allowed - {"mlakit"}
                )
                assert ok, f"{os.path.basename(path)} imports {name}"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(220.0, "220 s"), (1.25, "1.25 s"), (0.00123, "1.23 ms"), (4.5e-6, "4.5 µs"), (3e-9, "3 ns")],
)
def test_times_print_in_fitting_units(seconds, text):
    from mlakit.cost import format_seconds

    assert format_seconds(seconds) == text

"""`mlakit crossover / cache / cost / explore`: JSON keys, figures, and errors."""

from __future__ import annotations

import json
import os
import re

import pytest

from mlakit.cli import main

V3_LIMIT = 512 * 256 / 768
V3_4096 = 4096 * 512 * 256 / (512 * 256 + 4096 * 768)


def run_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def hf_config(path, **changes) -> str:
    """A DeepSeek-V3-shaped config.json with the given changes."""
    d = {
        "model_type": "deepseek_v3",
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "q_lora_rank": 256,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_hidden_layers": 4,
    }
    d.update(changes)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(d, f)
    return os.path.join(path, "config.json")


def test_crossover_json(capsys):
    r = run_json(
        capsys, "crossover", "--model", "deepseek-v3", "--context", "4K", "--counting", "independent"
    )
    assert {"model", "context", "exact", "asymptotic"} <= set(r)
    assert r["model"] == "deepseek-v3" and r["context"] == 4096
    assert r["exact"] == pytest.approx(V3_4096, rel=1e-12)
    assert r["asymptotic"] == pytest.approx(V3_LIMIT, rel=1e-12)
    assert set(r["by_counting"]) == {"independent", "causal"}
    assert r["by_counting"]["causal"]["exact"] > r["exact"]
    assert "roofline" not in r


def test_crossover_null_and_roofline(capsys, tmp_path):
    # 2L < nope + v: no long-context crossover, and none at a long context
    cfg = hf_config(str(tmp_path / "narrow"), kv_lora_rank=64)
    r = run_json(capsys, "crossover", "--model", cfg, "--context", "100000", "--machine", "h200")
    assert r["exact"] is None and r["asymptotic"] is None
    assert r["roofline"]["machine"] == "h200"
    r = run_json(capsys, "crossover", "--model", "glm-5", "--counting", "causal", "--machine", "h100")
    d = r["dense_layer"]  # a DSA model: the dense layer's figures, labelled (the top level is sparse)
    assert r["counting"] == "causal" and d["exact"] == d["by_counting"]["causal"]["exact"]
    assert d["asymptotic"] == pytest.approx(512 * 448 / 576)
    assert d["roofline"]["exact"] > 0


def test_crossover_default_counting_is_the_benchs(capsys):
    from mlakit.cost import DEFAULT_COUNTING

    r = run_json(capsys, "crossover", "--model", "deepseek-v3", "--context", "1024")
    assert r["counting"] == DEFAULT_COUNTING == "causal"
    assert r["exact"] == r["by_counting"]["causal"]["exact"]


def test_crossover_text(capsys):
    assert main(["crossover", "--model", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "163.8" in out and "170.7" in out


def test_cache_json_v3(capsys):
    r = run_json(capsys, "cache", "--model", "deepseek-v3", "--context", "1000000")
    for key in ("values_per_token_per_layer", "bytes_per_token", "bytes_per_sequence"):
        assert {"mla", "expanded", "mha", "mqa", "gqa4", "gqa8"} == set(r[key])
    assert r["values_per_token_per_layer"]["mla"] == 576
    assert r["values_per_token_per_layer"]["expanded"] == 40_960
    assert r["bytes_per_token"]["mla"] == 70_272
    assert r["bytes_per_sequence"]["mla"] == 70_272_000_000
    assert r["mla_equivalent_gqa_groups"] == 2.25


def test_cache_fp8_and_groups(capsys):
    r = run_json(capsys, "cache", "--model", "deepseek-v3", "--dtype", "fp8", "--gqa-groups", "2,16,3")
    assert r["bytes_per_token_per_layer"]["mla"] == 656
    assert {"gqa2", "gqa16"} <= set(r["values_per_token_per_layer"])
    assert "gqa3" not in r["values_per_token_per_layer"]
    assert main(["cache", "--model", "kimi-k2", "--dtype", "int8"]) == 0
    assert "644" in capsys.readouterr().out


def test_cost_json(capsys):
    r = run_json(
        capsys,
        "cost",
        "--model",
        "deepseek-v3",
        "--context",
        "4096",
        "--new",
        "1",
        "--counting",
        "independent",
    )
    assert set(r["terms"]) == {"materialize", "absorb", "shared"}
    assert set(r["terms"]["materialize"]) == {"expand_k", "expand_v", "scores", "weighted_sum"}
    assert set(r["terms"]["absorb"]) == {"fold_q", "scores", "mix_latents", "unfold_v"}
    assert set(r["terms"]["shared"]) == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"}
    expand_k = r["terms"]["materialize"]["expand_k"]
    assert expand_k["macs"] == 4096 * 128 * 128 * 512
    assert expand_k["time_s"] == max(expand_k["compute_s"], expand_k["memory_s"])
    for path in ("materialize", "absorb"):
        t = r["totals"][path]
        assert t["macs"] == sum(x["macs"] for x in r["terms"][path].values())
        assert t["macs_with_shared"] > t["macs"]
        assert t["time_s"] > 0
    assert r["machine"]["name"] == "h100" and r["faster"] == "absorb"
    assert r["crossover"]["exact"] == pytest.approx(V3_4096)


def test_cost_machine_file_and_folder_model(capsys, tmp_path):
    folder = tmp_path / "model"
    hf_config(str(folder))
    machine = {"name": "mine", "peak_flops": {"fp32": 1e12, "bf16": 2e12}, "memory_bandwidth": 1e11}
    (tmp_path / "m.json").write_text(json.dumps(machine))
    r = run_json(
        capsys,
        "cost",
        "--model",
        str(folder),
        "--context",
        "100",
        "--new",
        "300",
        "--machine",
        str(tmp_path / "m.json"),
    )
    assert r["machine"]["name"] == "mine" and r["model"] != "deepseek-v3"
    assert r["terms"]["absorb"]["fold_q"]["macs"] == 300 * 16 * 128 * 512
    assert main(["cost", "--context", "4096", "--new", "512", "--machine", "h800", "--fused"]) == 0
    assert "materialize" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["crossover", "--model", "gpt-2"], "neither a preset"),
        (["crossover", "--context", "-1"], "--context"),
        (["cost", "--context", "10", "--new", "0"], "--new"),
        (["cost", "--context", "10", "--new", "1", "--machine", "tpu"], "machine 'tpu'"),
        (["cache", "--gqa-groups", "4,x"], "--gqa-groups"),
        (["explore", "--bench", "/nonexistent/results.json"], "no such file"),
    ],
    ids=["model", "context", "new", "machine", "groups", "bench"],
)
def test_errors_exit_2(capsys, argv, match):
    assert main(argv) == 2
    assert re.search(match, capsys.readouterr().err)


def test_explore_writes_and_prints_path(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["explore"]) == 0
    path = capsys.readouterr().out.strip()
    assert path == str(tmp_path / "mlakit-explorer.html")
    html = (tmp_path / "mlakit-explorer.html").read_text(encoding="utf-8")
    assert 'id="crossover-exact"' in html and '"bench":null' in html
    results = {
        "rows": [dict(backend="mlakit-absorb", batch=1, new=1, cached=64, dtype="bf16", ms_median=0.5)]
    }
    (tmp_path / "r.json").write_text(json.dumps(results))
    assert main(["explore", "--out", "page.html", "--bench", "r.json"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "page.html")
    assert '"ms_median":0.5' in (tmp_path / "page.html").read_text()
    (tmp_path / "bad.json").write_text(json.dumps({"rows": [{"backend": "x"}]}))
    assert main(["explore", "--bench", "bad.json"]) == 2
    assert "lacks" in capsys.readouterr().err


def test_profile_measures_and_caches(capsys, tmp_path, monkeypatch):
    from mlakit import profile

    assert profile.measure_matmul_flops("fp32", size=64, repeats=1) > 0
    assert profile.measure_read_bandwidth(nbytes=1 << 20, repeats=1) > 0
    assert profile.measure_fp8_flops("cpu") is None
    monkeypatch.setenv("MLAKIT_CACHE_DIR", str(tmp_path))
    stored = {"name": "local-cpu", "peak_flops": {"fp32": 5e10, "bf16": 1e9}, "memory_bandwidth": 1e10}
    path = profile.default_profile_path("cpu")
    assert os.path.dirname(path) == str(tmp_path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(stored, f)
    assert profile.local_profile().peak_flops == stored["peak_flops"]  # read back, not measured again
    r = run_json(capsys, "cost", "--context", "64", "--new", "8", "--machine", "local", "--dtype", "fp32")
    expand_k = r["terms"]["materialize"]["expand_k"]
    assert expand_k["compute_s"] == pytest.approx(2 * expand_k["macs"] / 5e10)
    assert expand_k["memory_s"] == pytest.approx(expand_k["bytes"] / 1e10)


@pytest.mark.parametrize(
    "argv,want,not_want",
    [
        (["cost", "--context", "4K", "--new", "1"], "1 new token over", "1 new tokens"),
        (
            ["cost", "--model", "deepseek-v4-flash", "--context", "4K", "--new", "1"],
            "1 new token over",
            "1 new tokens",
        ),
        (["cost", "--context", "4K", "--new", "2"], "2 new tokens over", None),
        (["cache", "--context", "1"], "sequence of 1 token", "1 tokens"),
        (["cache", "--model", "deepseek-v4-pro", "--context", "1"], "sequence of 1 token", "1 tokens"),
    ],
    ids=["cost-1", "cost-v4-1", "cost-2", "cache-1", "cache-v4-1"],
)
def test_counts_of_one_are_singular(argv, want, not_want, capsys):
    from mlakit.cli import main

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert want in out and (not_want is None or not_want not in out)


def test_cost_local_predicts_at_the_rate_mlakit_runs(monkeypatch, capsys):
    import json

    import torch

    import mlakit.profile as prof
    from mlakit.cli import main
    from mlakit.cost import MachineProfile
    from mlakit.ops import common
    from mlakit.ops.common import compute_dtype

    native = MachineProfile("local-cpu", {"fp32": 8.9e10, "bf16": 6.2e8}, 1.6e10)
    monkeypatch.setattr(prof, "local_profile", lambda device="cpu", refresh=False: native)
    # the profile is an AVX2-only CPU's (bf16 at 0.62 GFLOP/s): run as on one wherever this runs
    monkeypatch.setitem(common._CPU_FAST, torch.bfloat16, False)
    assert main(["cost", "--context", "1K", "--new", "128", "--machine", "local", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    native_bf16 = compute_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    want = native.peak_flops["bf16" if native_bf16 else "fp32"]
    assert r["machine"]["peak_flops"]["bf16"] == want
    assert r["totals"]["materialize"]["time_s"] < 10  # not minutes at 0.62 GFLOP/s

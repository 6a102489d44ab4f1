"""The V4 terms of the cost model (torch-free), `mlakit cost` / `mlakit cache` on a V4 model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlakit.cost.v4 import TERMS, compare, layer_terms, model_cost, sequence_bytes
from mlakit.v4.config import V4Config

PRO = V4Config.preset("deepseek-v4-pro")
M = 1 << 20


def test_terms_are_the_arithmetic():
    h, hd = 128, 512
    hca = layer_terms(PRO, "heavily_compressed_attention", M)
    csa = layer_terms(PRO, "compressed_sparse_attention", M)
    assert set(hca) == set(csa) == set(TERMS)
    assert hca["window"]["macs"] == 2 * h * hd * 128
    assert hca["compressed_dense"]["macs"] == 2 * h * hd * ((M + 1) // 128)
    assert csa["compressed_sparse"]["macs"] == 2 * h * hd * 1024
    assert csa["indexer"]["macs"] == 1536 * 64 * 128 + 7168 * 64 + ((M + 1) // 4) * 64 * 129
    assert hca["indexer"]["macs"] == csa["compressed_dense"]["macs"] == 0
    # short context: every entry fits in index_topk, no indexer work; the window holds t+1 keys
    short = layer_terms(PRO, "compressed_sparse_attention", 99)
    assert short["indexer"]["macs"] == 0 and short["compressed_sparse"]["macs"] == 2 * h * hd * 25
    assert short["window"]["macs"] == 2 * h * hd * 100


def test_v4_pro_against_v32_at_1m():
    rows = compare(PRO, M)
    v4 = rows["deepseek-v4-pro"]
    # mlakit's counts (attention layers only): 22% of V3.2's FLOPs, 11.5% of its bf16 cache
    assert 0.21 < v4["flops_vs_v3.2"] < 0.23
    assert 0.11 < v4["cache_vs_v3.2"] < 0.12
    assert rows["deepseek-v3"]["flops_vs_v3.2"] > 10
    total = model_cost(PRO, M)
    assert total["macs"] == sum(t["macs"] for t in total["terms"].values())
    seq = sequence_bytes(PRO, M)
    assert (
        seq["total"]
        == 30 * seq["per_layer"]["compressed_sparse_attention"]
        + 31 * seq["per_layer"]["heavily_compressed_attention"]
    )


def _cli(*args):
    out = subprocess.run(
        [sys.executable, "-m", "mlakit.cli", *args], capture_output=True, text=True, check=False, cwd="."
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("cmd", ["cost", "cache"])
def test_cli_json(cmd):
    extra = ["--new", "1"] if cmd == "cost" else []
    r = json.loads(_cli(cmd, "--model", "deepseek-v4-pro", "--context", "1M", *extra, "--json"))
    assert r["context"] == M
    if cmd == "cost":
        for kind in ("compressed_sparse_attention", "heavily_compressed_attention"):
            assert set(r["per_layer_type"][kind]["terms"]) == set(TERMS)
        assert set(r["compare"]) == {"deepseek-v4-pro", "deepseek-v3.2", "deepseek-v3"}
    else:
        assert r["bytes_per_token_per_layer"]["heavily_compressed_attention"] == 8.0
        assert r["compare"]["deepseek-v3.2"]["cache_bytes_per_token_per_layer"] == 1408


def test_cli_text_and_torch_free():
    text = _cli("cost", "--model", "deepseek-v4-flash", "--context", "128K", "--new", "1")
    assert "compressed_sparse" in text and "of V3.2" in text
    code = "import sys, mlakit.cost.v4, mlakit.commands.v4; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=".")


def test_layer_type_names_match_the_config():
    from mlakit.cost import v4 as cost_v4
    from mlakit.v4 import config

    assert cost_v4.LAYER_TYPES == config.LAYER_TYPES


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlakit.cli", *args], capture_output=True, text=True, check=False, cwd="."
    )


@pytest.mark.parametrize("cmd", ["cost", "cache"])
def test_cli_refuses_context_0_on_v4(cmd):
    extra = ["--new", "1"] if cmd == "cost" else []
    out = _run(cmd, "--model", "deepseek-v4-pro", "--context", "0", *extra)
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.strip() == f"mlakit {cmd}: error: --context must be >= 1, got 0"


def test_cli_cost_says_roofline_flags_are_ignored_on_v4():
    plain = _run("cost", "--model", "deepseek-v4-pro", "--context", "4K", "--new", "1", "--json")
    assert plain.returncode == 0 and plain.stderr == ""
    flags = ["--machine", "a100", "--counting", "independent", "--fused"]
    out = _run("cost", "--model", "deepseek-v4-pro", "--context", "4K", "--new", "1", "--json", *flags)
    assert out.returncode == 0 and json.loads(out.stdout) == json.loads(plain.stdout)
    assert len(out.stderr.strip().splitlines()) == 1
    assert "--machine, --counting, --fused ignored" in out.stderr


# ---- the MLA-only commands, and the V4 capacity table


@pytest.mark.parametrize("cmd", ["crossover", "check", "bench", "calibrate", "cp-check"])
@pytest.mark.parametrize("model", ["deepseek-v4-pro", "folder"], ids=["preset", "folder"])
def test_mla_only_commands_say_what_v4_has(cmd, model, tmp_path, capsys):
    from mlakit.cli import main

    if model == "folder":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **FLASH_JSON}))
        model = str(tmp_path)
    assert main([cmd, "--model", model]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"mlakit {cmd}: error: --model {model!r} is a DeepSeek-V4 model")
    assert f"`mlakit cost --model {model}`" in err and f"`mlakit cache --model {model}`" in err
    assert "neither a preset" not in err


FLASH_JSON = {
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_hidden_layers": 43,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_v4_capacity_arithmetic():
    from mlakit.cost.v4_capacity import sequence_bytes_per_rank, v4_capacity

    for d in ("bf16", "fp8"):
        assert sequence_bytes_per_rank(PRO, M, 1, d)["total"] == sequence_bytes(PRO, M, d)["total"]
    two = sequence_bytes_per_rank(PRO, M + 7, 2, "bf16")["per_layer_type"]
    assert two["compressed_sparse_attention"]["compressed_entries"] == -(-((M + 7) // 4) // 2)
    assert two["heavily_compressed_attention"]["compressed_entries"] == M // 128 // 2
    assert two["sliding_attention"] == {"window_entries": 128, "compressed_entries": 0, "bytes": 128 * 1024}
    c = v4_capacity(PRO, M, 141 * 10**9, tp=8, cp=2, weights_dtype="int4")
    assert c["weights"]["bytes_per_rank"] == 1.6e12 * 0.5 / 8
    free = 141 * 10**9 - 10**11
    for name, d in (("v4-bf16", "bf16"), ("v4-fp8", "fp8")):
        per_seq = sequence_bytes_per_rank(PRO, M, 2, d)["total"]
        assert c["caches"][name]["sequences_per_rank"] == free // per_seq
    assert (
        c["caches"]["v4-bf16"]["sequences_per_rank"] == 7
        and c["caches"]["v4-fp8"]["sequences_per_rank"] == 13
    )
    assert v4_capacity(PRO, M, 141 * 10**9, tp=8)["free_bytes_per_rank"] == 0  # bf16 weights: 400 GB a rank
    with pytest.raises(ValueError, match="tp=256 exceeds the 128 heads"):
        v4_capacity(PRO, M, 10**12, tp=256)


def test_cli_cache_v4_capacity_uses_memory_tp_cp():
    args = ["cache", "--model", "deepseek-v4-pro", "--context", "1M", "--memory", "141GB", "--tp", "8"]
    out = _run(*args, "--cp", "2", "--weights-dtype", "int4")
    assert out.returncode == 0 and out.stderr == ""
    assert "capacity per rank (tp=8 cp=2) of 141 GB" in out.stdout
    assert "v4-bf16" in out.stdout and "floor(41.0 GB / 5.17 GB)" in out.stdout
    r = json.loads(_run(*args, "--cp", "2", "--weights-dtype", "int4", "--json").stdout)
    assert r["capacity"]["caches"]["v4-fp8"]["sequences_per_rank"] == 13
    assert r["per_rank"] == {"cp": 2, "tp": 8, "bytes_per_sequence_max_rank": 5171183616}
    full = _run(*args, "--cp", "2")
    assert "the weights alone fill the memory" in full.stdout


def test_cli_cache_v4_per_rank_without_memory_and_ignored_flags():
    out = _run("cache", "--model", "deepseek-v4-flash", "--context", "128K", "--cp", "4", "--gqa-groups", "2")
    assert out.returncode == 0
    assert "per rank at cp=4 tp=1" in out.stdout
    assert out.stderr.strip() == (
        "mlakit cache: --gqa-groups ignored for a V4 model (it is compared with V3.2 and V3, "
        "not with GQA layouts of its widths)"
    )
    bad = _run("cache", "--model", "deepseek-v4-flash", "--context", "128K", "--weights-memory", "1GB")
    assert bad.returncode == 2 and "--weights-memory needs --memory" in bad.stderr

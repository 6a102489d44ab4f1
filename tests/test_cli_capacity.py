"""The CLI's capacity and DSA answers: `cache --memory` (capacity per rank, by hand), one sparse
answer for DSA models in crossover / cost / cache, `cost` defaulting --context,
`cache --context 0` refused, byte units."""

from __future__ import annotations

import json
import math

import pytest

from mlakit.cli import main
from mlakit.commands.capacity import parse_bytes
from mlakit.config import MLAConfig
from mlakit.cost import sparse_crossover
from mlakit.cost.capacity import PARAMETERS, capacity, owned_tokens_max

V3_ROW = {"bf16": 1152, "fp8": 656, "int8": 644}  # 576-wide latent: bytes per token per layer
INDEX_KEY = {"bf16": 256, "fp8": 132, "int8": 132}  # d_I = 128


def run_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("80 gib", 80 * 2**30),
        ("1.5TB", 15 * 10**11),
        ("512MiB", 512 * 2**20),
        ("85899345920", 85899345920),
        ("7B", 7),
    ],
    ids=["GB", "GiB", "lower-space", "TB-decimal", "MiB", "bytes", "B"],
)
def test_sizes_read_decimal_and_binary_units(text, want):
    assert parse_bytes(text, "memory") == want


@pytest.mark.parametrize("text", ["", "80XB", "-1GB", "GB", "0", "1e30"], ids=str)
def test_bad_sizes_name_the_flag(text):
    with pytest.raises(ValueError, match="--memory"):
        parse_bytes(text, "memory")


@pytest.mark.parametrize(
    ("model", "context", "memory", "tp", "cp", "wdtype"),
    [
        ("deepseek-v3", 131072, 141 * 10**9, 8, 1, "fp8"),
        ("deepseek-v3", 32768, 80 * 2**30, 8, 2, "bf16"),
        ("deepseek-v3.2", 131072, 141 * 10**9, 8, 1, "fp8"),
        ("deepseek-v2-lite", 4097, 80 * 10**9, 1, 3, "bf16"),
        ("kimi-k2", 65, 192 * 10**9, 16, 4, "int4"),
    ],
    ids=["v3-tp8", "v3-tp8-cp2", "v32-dsa", "lite-cp3-odd", "kimi-int4"],
)
def test_capacity_by_hand(model, context, memory, tp, cp, wdtype):
    cfg = MLAConfig.preset(model)
    c = capacity(cfg, context, memory, "bf16", tp, cp, None, wdtype)
    per_param = {"bf16": 2, "fp8": 1, "int4": 0.5}[wdtype]
    weights = round(PARAMETERS[model] * per_param)
    assert c["weights"]["bytes"] == weights and c["weights"]["bytes_per_rank"] == math.ceil(weights / tp)
    free = max(0, memory - math.ceil(weights / tp))
    assert c["free_bytes_per_rank"] == free
    blocks = context // 64
    tokens = math.ceil(blocks / cp) * 64 + (context % 64 if blocks % cp == 0 else 0)
    assert c["tokens_per_rank"] == tokens == owned_tokens_max(context, cp)
    h, dn, dv, dr, layers = 128 if model != "kimi-k2" else 64, 128, 128, 64, cfg.num_layers
    if model == "deepseek-v2-lite":
        h = 16
    want = {}
    for d, row in V3_ROW.items():
        key = INDEX_KEY[d] if cfg.is_sparse else 0
        want[("mla+indexer-" if cfg.is_sparse else "mla-") + d] = row + key
    want["expanded"] = math.ceil(h / tp) * (dn + dv + dr) * 2
    want["mha"] = math.ceil(h / tp) * (dn + dv) * 2
    for g in (4, 8):
        if g < h and h % g == 0:
            want[f"gqa{g}"] = math.ceil(g / tp) * (dn + dv) * 2
    want["mqa"] = (dn + dv) * 2
    assert list(c["caches"]) == list(want)
    for name, per_layer in want.items():
        r = c["caches"][name]
        assert r["bytes_per_token_per_layer_per_rank"] == per_layer, name
        assert r["sequences_per_rank"] == free // (per_layer * layers * tokens), name


def test_v3_on_h200s_the_docs_example():
    c = capacity(MLAConfig.preset("deepseek-v3"), 131072, 141 * 10**9, tp=8, weights_dtype="fp8")
    fits = {name: r["sequences_per_rank"] for name, r in c["caches"].items()}
    assert (fits["mla-bf16"], fits["mla-fp8"], fits["mla-int8"], fits["mha"]) == (6, 10, 11, 0)


def test_cli_capacity_json_and_arithmetic(capsys):
    argv = ["cache", "--model", "deepseek-v3", "--context", "32K", "--memory", "80GiB"]
    d = run_json(capsys, *argv, "--weights-memory", "10GB")
    c = d["capacity"]
    assert c["memory_bytes"] == 80 * 2**30 and c["weights"]["bytes"] == 10**10
    assert c["free_bytes_per_rank"] == 80 * 2**30 - 10**10
    mla = c["caches"]["mla-bf16"]
    assert mla["sequences_per_rank"] == (80 * 2**30 - 10**10) // (1152 * 61 * 32768) == 32
    assert mla["arithmetic"].endswith("= 32")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "floor(" in out and "671 GB" not in out and "sequences" in out
    assert main(argv[:5] + ["--memory", "141GB", "--tp", "8"]) == 0  # the preset's parameters, bf16
    out = capsys.readouterr().out
    assert "6.71e+11 parameters × 2 B (bf16) = 1.34 TB" in out and "no sequence fits" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--context", "0"], "--context must be >= 1"),
        (["--memory", "80XB"], "--memory takes a size"),
        (["--weights-memory", "1GB"], "--weights-memory needs --memory"),
        (["--model", "ax-k2", "--memory", "80GB"], "--weights-memory"),
        (["--memory", "80GB", "--tp", "256"], "tp=256 exceeds"),
        (["--memory", "0", "--weights-memory", "0"], "--memory must be from 1 byte"),
        (["--memory", "80GB", "--weights-memory=-1GB"], "--weights-memory takes a size"),
    ],
    ids=["context-0", "bad-unit", "weights-alone", "no-parameters", "tp-too-many", "memory-0", "weights-neg"],
)
def test_cache_refusals_are_one_line(argv, message, capsys):
    assert main(["cache", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_weights_memory_may_be_zero_as_capacity_takes_it(capsys):
    d = run_json(capsys, "cache", "--model", "deepseek-v3", "--memory", "80GB", "--weights-memory", "0")
    want = capacity(MLAConfig.preset("deepseek-v3"), 4096, 80 * 10**9, "bf16", weights_memory=0)
    assert d["capacity"] == want and want["free_bytes_per_rank"] == 80 * 10**9
    assert parse_bytes("0", "weights-memory", 0) == 0


# ---- one answer for a DSA model


def test_crossover_of_a_dsa_model_is_the_sparse_one(capsys):
    v32 = MLAConfig.preset("deepseek-v3.2")
    d = run_json(capsys, "crossover", "--model", "deepseek-v3.2", "--context", "128K")
    assert d["sparse"]["materialize_cheaper"] is None and d["sparse"]["text"].startswith("never")
    assert main(["crossover", "--model", "deepseek-v3.2", "--context", "128K"]) == 0
    out = capsys.readouterr().out
    assert "never" in out and "more: materialize" not in out
    assert "dense layer" in out.split("170.6")[0]  # the dense figure, labelled as the dense layer's
    d = run_json(capsys, "crossover", "--model", "deepseek-v3.2", "--context", "100")
    lo, hi = sparse_crossover(v32, 100, "causal")
    assert d["sparse"]["materialize_cheaper"] == {"from": lo, "below": hi}
    assert "sparse" not in run_json(capsys, "crossover", "--model", "deepseek-v3")


def test_cost_of_a_dsa_model_labels_the_dense_rows(capsys):
    assert main(["cost", "--model", "deepseek-v3.2", "--context", "128K", "--new", "1"]) == 0
    out = capsys.readouterr().out
    assert "dense layer: crossover at this context" in out and "materialize cheaper: never" in out
    for counting in ("causal", "independent"):
        d = run_json(
            capsys,
            "cost",
            "--model",
            "deepseek-v3.2",
            "--context",
            "1000",
            "--new",
            "8",
            "--counting",
            counting,
        )
        band = sparse_crossover(MLAConfig.preset("deepseek-v3.2"), 1000, counting)
        assert d["sparse"]["crossover"] == (None if band is None else list(band))


def test_cache_of_a_dsa_model_leads_with_the_indexer_key(capsys):
    d = run_json(capsys, "cache", "--model", "deepseek-v3.2", "--context", "128K")
    assert list(d["bytes_per_token_per_layer"])[:2] == ["mla+indexer", "mla"]
    assert d["bytes_per_token_per_layer"]["mla+indexer"] == 1408
    assert d["bytes_per_sequence"]["mla+indexer"] == d["indexer"]["mla_with_indexer_bytes_per_sequence"]
    d = run_json(capsys, "cache", "--model", "deepseek-v3.2", "--context", "128K", "--tp", "2")
    assert d["per_rank"]["mla_bytes_per_rank"] == [1408 * 61 * 131072] * 2
    assert main(["cache", "--model", "deepseek-v3.2", "--context", "128K"]) == 0
    assert "11.3 GB" in capsys.readouterr().out.splitlines()[2]  # the first row


def test_cost_defaults_its_context_like_crossover_and_cache(capsys):
    d = run_json(capsys, "cost", "--new", "1")
    assert (
        d["context"]
        == 4096
        == run_json(capsys, "crossover")["context"]
        == run_json(capsys, "cache")["context"]
    )


def test_dsa_json_top_level_is_the_sparse_answer(capsys):
    """In JSON, the top level of cost / crossover / cache is the DSA model's answer, the
    dense layer's figures under "dense_layer"; dense models keep their keys as they were."""
    v32 = MLAConfig.preset("deepseek-v3.2")
    for context in ("128K", "1000"):
        n = 131072 if context == "128K" else 1000
        band = sparse_crossover(v32, n, "causal")
        low, high = band or (None, None)
        d = run_json(capsys, "cost", "--model", "deepseek-v3.2", "--context", context, "--new", "1")
        assert d["fewer_macs"] == d["sparse"]["fewer_macs"] == "sparse-absorb" and d["faster"] is None
        assert (d["crossover"]["exact"], d["crossover"]["below"]) == (low, high)
        assert d["dense_layer"]["fewer_macs"] == "absorb" and d["dense_layer"]["crossover"]["exact"] > 100
        r = run_json(capsys, "crossover", "--model", "deepseek-v3.2", "--context", context)
        assert (r["exact"], r["below"]) == (low, high) and "asymptotic" not in r
        assert r["by_counting"]["causal"] == {"exact": low, "below": high}
        assert r["dense_layer"]["exact"] == d["dense_layer"]["crossover"]["exact"]
        assert r["dense_layer"]["asymptotic"] == pytest.approx(512 * 256 / 768)
    assert (
        run_json(capsys, "cost", "--model", "deepseek-v3.2", "--context", "128K", "--new", "1")["crossover"][
            "exact"
        ]
        is None
    )  # never, where the dense layer says 170.6
    c = run_json(capsys, "cache", "--model", "deepseek-v3.2", "--context", "128K")
    assert c["mla_equivalent_gqa_groups"] == (576 + 128) / 256 == 2.75  # the mla+indexer row
    assert c["dense_layer"]["mla_equivalent_gqa_groups"] == 2.25
    for argv in (["cost", "--new", "1"], ["crossover"], ["cache"]):
        assert "dense_layer" not in run_json(capsys, *argv, "--model", "deepseek-v3")
    d = run_json(capsys, "cost", "--model", "deepseek-v3", "--new", "1")
    assert d["fewer_macs"] == "absorb" and set(d["crossover"]) == {"exact", "asymptotic", "roofline"}


# ---- a model folder's weights: summed from its safetensors headers

TINY_HF = {
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_hidden_layers": 2,
}


def _folder(tmp_path, shards: dict[str, dict[str, tuple]], index: bool) -> int:
    """Write config.json and safetensors shards of zero tensors; the tensors' bytes in all."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    total, weight_map = 0, {}
    for file, tensors in shards.items():
        data = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in tensors.items()}
        save_file(data, str(tmp_path / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in data.values())
        weight_map.update(dict.fromkeys(tensors, file))
    if index:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


@pytest.mark.parametrize("index", [False, True], ids=["files", "index"])
def test_folder_weights_are_summed_from_safetensors_headers(tmp_path, capsys, monkeypatch, index):
    import torch

    shards = {
        "model-00001-of-00002.safetensors": {"a": ((1000, 7), torch.bfloat16), "b": ((3,), torch.float32)},
        "model-00002-of-00002.safetensors": {"c": ((64, 64), torch.int8)},
    }
    total = _folder(tmp_path, shards, index)
    assert total == 1000 * 7 * 2 + 12 + 4096
    if index:
        (tmp_path / "stray.safetensors").write_bytes(b"not listed by the index")
    monkeypatch.setattr("safetensors.safe_open", lambda *a, **k: pytest.fail("a tensor was opened"))
    d = run_json(capsys, "cache", "--model", str(tmp_path), "--memory", "1GB", "--context", "4K")
    w = d["capacity"]["weights"]
    assert w["source"] == "safetensors" and w["bytes"] == total and w["files"] == 2
    assert d["capacity"]["free_bytes_per_rank"] == 10**9 - total
    assert main(["cache", "--model", str(tmp_path / "config.json"), "--memory", "1GB"]) == 0
    out = capsys.readouterr().out
    assert f"(summed from the headers of the 2 safetensors files in {tmp_path})" in out
    given = run_json(capsys, "cache", "--model", str(tmp_path), "--memory", "1GB", "--weights-memory", "5MB")
    assert given["capacity"]["weights"] == {
        "source": "given",
        "parameters": None,
        "dtype": None,
        "bytes": 5 * 10**6,
        "bytes_per_rank": 5 * 10**6,
    }


def test_folder_without_safetensors_still_asks_for_weights_memory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    assert main(["cache", "--model", str(tmp_path), "--memory", "1GB"]) == 2
    assert "--weights-memory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content,match",
    [(b"\x05", "not a safetensors header"), (b"\x04\x00\x00\x00\x00\x00\x00\x00[12]", "not a JSON object")],
    ids=["short", "list-header"],
)
def test_broken_safetensors_header_is_one_line(tmp_path, capsys, content, match):
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    (tmp_path / "model.safetensors").write_bytes(content)
    assert main(["cache", "--model", str(tmp_path), "--memory", "1GB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and match in err and "model.safetensors" in err

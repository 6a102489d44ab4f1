"""Context and tensor parallel MLA on local gloo groups of 2 and 3 processes, against one process.

Each group runs every scenario in one launch (a launch costs a fork, not a torch import); the
scenarios return plain numbers that the parametrized tests below read.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from mlakit.attention import MLAAttention
from mlakit.cache.contiguous import LatentCache
from mlakit.cli import main
from mlakit.config import MLAConfig
from mlakit.distributed import (
    BlockPlacement,
    ContextParallelMLA,
    RankFailure,
    TensorParallelMLA,
    head_range,
    launch_local,
    owned_tokens,
    per_rank_cache_bytes,
    shard_state_dict,
)

TOL = 1e-5
# collectives wait this long for a peer; the whole launch is cut off at DEADLINE_S
TIMEOUT_S = 30.0
DEADLINE_S = 120.0

TINY = MLAConfig(
    hidden_size=48,
    num_heads=6,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=10,
    attention_bias=True,
    rope_interleave=True,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
)
TINY_QPROJ = TINY.replace(num_heads=5, q_lora_rank=None, attention_bias=False, rope_scaling=None)

# calls: (slots, new tokens) in order; every scenario compares each call's output with one process
CP_CASES = {
    "decode-ctx13-block4": dict(block=4, batch=1, calls=[([0], 13)] + [([0], 1)] * 4),
    "prefill-chunks-block3": dict(block=3, batch=1, calls=[([0], 5), ([0], 7), ([0], 1), ([0], 6), ([0], 1)]),
    # rank 1 (and rank 2 of 3) holds nothing for the first calls
    "empty-rank-block4": dict(block=4, batch=1, calls=[([0], 3), ([0], 1), ([0], 1), ([0], 1), ([0], 4)]),
    "ragged-batch-block2": dict(
        block=2, batch=2, calls=[([0], 5), ([1], 11), ([0, 1], 1), ([0, 1], 1), ([1, 0], 3)]
    ),
    "token-round-robin": dict(block=1, batch=1, calls=[([0], 7), ([0], 1), ([0], 1)]),
}
TP_CASES = {
    "q_lora-bias-yarn-H6": dict(cfg=TINY, mode="absorb"),
    "q_proj-H5-uneven": dict(cfg=TINY_QPROJ, mode="auto"),
}
MAX_SEQ = 32


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def assert_close(name: str, err: float, tol: float = TOL) -> None:
    assert err <= tol, f"{name}: max |got - want| / max |want| = {err:.3e} > {tol:.0e}"


def seeded_layer(cfg: MLAConfig, seed: int = 0) -> MLAAttention:
    torch.manual_seed(seed)
    return MLAAttention(cfg).eval()


def hidden_for(cfg: MLAConfig, calls, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(len(slots), new, cfg.hidden_size, generator=gen) for slots, new in calls]


def run_cp_case(case: dict) -> dict:
    """On each rank: the CP layer and one-process materialize over the same calls."""
    layer = seeded_layer(TINY)
    cp = ContextParallelMLA(layer, block_size=case["block"])
    cache = cp.new_cache(case["batch"], MAX_SEQ)
    ref_cache = LatentCache(TINY, case["batch"], MAX_SEQ)
    err, held = 0.0, []
    with torch.inference_mode():
        for (slots, _), x in zip(case["calls"], hidden_for(TINY, case["calls"]), strict=True):
            got = cp(x, cache, slots=slots)
            want = layer(x, ref_cache, mode="materialize", slots=slots)
            err = max(err, rel_err(got, want))
            held.append(int(cache.local.lengths.sum()))
    return {"err": err, "held": held}


def run_tp_case(case: dict) -> dict:
    cfg = case["cfg"]
    layer = seeded_layer(cfg)
    tp = TensorParallelMLA.from_layer(layer)
    calls = [([0], 9), ([0], 1), ([0], 1), ([0], 4)]
    cache, ref_cache = LatentCache(cfg, 1, MAX_SEQ), LatentCache(cfg, 1, MAX_SEQ)
    err = 0.0
    with torch.inference_mode():
        for x in hidden_for(cfg, calls):
            got = tp(x, cache, mode=case["mode"])
            err = max(err, rel_err(got, layer(x, ref_cache, mode="materialize")))
    return {"err": err, "heads": list(tp.heads), "cache_tokens": int(cache.lengths.sum())}


def all_scenarios() -> dict:
    return {
        "cp": {name: run_cp_case(case) for name, case in CP_CASES.items()},
        "tp": {name: run_tp_case(case) for name, case in TP_CASES.items()},
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def group_results(request):
    world = request.param
    return world, launch_local(all_scenarios, world, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("name", list(CP_CASES))
def test_context_parallel_matches_one_process(group_results, name):
    world, ranks = group_results
    for rank, r in enumerate(ranks):
        assert_close(f"cp {name} world {world} rank {rank}", r["cp"][name]["err"])
    total = sum(new * len(slots) for slots, new in CP_CASES[name]["calls"])
    assert sum(r["cp"][name]["held"][-1] for r in ranks) == total


def test_a_rank_holding_nothing_still_works(group_results):
    world, ranks = group_results
    held = ranks[-1]["cp"]["empty-rank-block4"]["held"]
    assert held[0] == 0, f"rank {world - 1} was meant to start empty, holds {held}"
    assert held[-1] > 0, f"rank {world - 1} should hold tokens by the end, holds {held}"


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tensor_parallel_matches_one_process(group_results, name):
    world, ranks = group_results
    for rank, r in enumerate(ranks):
        assert_close(f"tp {name} world {world} rank {rank}", r["tp"][name]["err"])
        assert r["tp"][name]["cache_tokens"] == 15, "each TP rank holds the whole latent cache"
    heads = [tuple(r["tp"][name]["heads"]) for r in ranks]
    assert heads[0][0] == 0 and heads[-1][1] == TP_CASES[name]["cfg"].num_heads
    assert all(a[1] == b[0] for a, b in zip(heads, heads[1:], strict=False))


def fail_bad_input() -> dict:
    """Rank 1 passes a wrong width once; then every rank runs a good step on the same group."""
    layer = seeded_layer(TINY)
    cp = ContextParallelMLA(layer, block_size=2)
    cache = cp.new_cache(1, MAX_SEQ)
    ref_cache = LatentCache(TINY, 1, MAX_SEQ)
    first, bad, good = hidden_for(TINY, [([0], 5), ([0], 1), ([0], 1)])
    rank = cp.placement.rank
    with torch.inference_mode():
        cp(first, cache)
        layer(first, ref_cache)
        try:
            cp(bad[..., :7] if rank == 1 else bad, cache)
            caught = "nothing"
        except Exception as err:
            caught = f"{type(err).__name__}: {err}"
        lengths = (int(cache.lengths[0]), int(cache.local.lengths[0]))
        err = rel_err(cp(good, cache), layer(good, ref_cache))
    return {"caught": caught, "lengths": lengths, "err": err, "local_after_first": cp.placement.count(5)}


def fail_after_cache_write() -> dict:
    """Rank 0 raises after it has written its part of the step; every rank must roll the step back."""
    layer = seeded_layer(TINY)
    cp = ContextParallelMLA(layer, block_size=1)
    cache = cp.new_cache(1, MAX_SEQ)
    first, second = hidden_for(TINY, [([0], 4), ([0], 3)])
    rank = cp.placement.rank
    with torch.inference_mode():
        cp(first, cache)
        before = (int(cache.lengths[0]), int(cache.local.lengths[0]))
        if rank == 0:
            layer.up_weights = _raise_injected
        try:
            cp(second, cache)
            caught = "nothing"
        except Exception as err:
            caught = f"{type(err).__name__}: {err}"
    return {"caught": caught, "before": before, "after": (int(cache.lengths[0]), int(cache.local.lengths[0]))}


def _raise_injected():
    raise RuntimeError("injected failure after the cache write")


def fail_slow_rank(sleep_s: float) -> None:
    """Rank 1 arrives after the group timeout; nothing is caught, launch_local reports every rank."""
    layer = seeded_layer(TINY)
    cp = ContextParallelMLA(layer, block_size=2)
    cache = cp.new_cache(1, MAX_SEQ)
    (x,) = hidden_for(TINY, [([0], 3)])
    if cp.placement.rank == 1:
        time.sleep(sleep_s)
    with torch.inference_mode():
        cp(x, cache)


def fail_dead_rank() -> None:
    tp = TensorParallelMLA.from_layer(seeded_layer(TINY))
    (x,) = hidden_for(TINY, [([0], 3)])
    if torch.distributed.get_rank() == 1:
        os._exit(3)
    tp(x)


def test_bad_input_on_one_rank_raises_on_every_rank():
    ranks = launch_local(fail_bad_input, 2, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S)
    assert ranks[1]["caught"].startswith("ValueError: hidden_states has width 7"), ranks[1]["caught"]
    assert ranks[0]["caught"].startswith("RankFailure"), ranks[0]["caught"]
    assert "rank(s) [1]" in ranks[0]["caught"] and "width 7" in ranks[0]["caught"], ranks[0]["caught"]
    for rank, r in enumerate(ranks):
        want = (5, r["local_after_first"])
        assert r["lengths"] == want, f"rank {rank}: lengths {r['lengths']} after the failed step, want {want}"
        assert_close(f"rank {rank}: step after the failure", r["err"])


def test_failure_after_cache_write_rolls_back_every_rank():
    ranks = launch_local(fail_after_cache_write, 3, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S)
    assert ranks[0]["caught"].startswith("RuntimeError: injected"), ranks[0]["caught"]
    for r in ranks[1:]:
        assert r["caught"].startswith("RankFailure") and "rank(s) [0]" in r["caught"], r["caught"]
    for rank, r in enumerate(ranks):
        assert r["after"] == r["before"], f"rank {rank}: lengths {r['before']} -> {r['after']}"


def test_slow_rank_times_out_on_every_rank():
    timeout_s = 2.0
    with pytest.raises(RankFailure) as info:
        launch_local(fail_slow_rank, 2, (timeout_s + 1.0,), timeout_s=timeout_s, deadline_s=DEADLINE_S)
    msg = str(info.value)
    assert "2 of 2 ranks failed" in msg, msg
    assert "rank 0: RankFailure" in msg and "timeout" in msg, msg
    assert "rank 1: RankFailure" in msg, msg


def test_dead_rank_is_reported_not_hung():
    with pytest.raises(RankFailure) as info:
        launch_local(fail_dead_rank, 2, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S)
    msg = str(info.value)
    assert "rank 1: process exited with code 3" in msg, msg
    assert "rank 0: RankFailure" in msg, msg


def test_cp_check_cli_json(capsys):
    argv = ["cp-check", "--world-size", "3", "--model", "minicpm3-4b", "--context", "11"]
    assert main([*argv, "--decode-steps", "2", "--block-size", "4", "--prefill-chunk", "5", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert_close("cp-check", r["max_rel_err"])
    cfg = MLAConfig.preset("minicpm3-4b")
    assert r["per_rank_cache_bytes"] == per_rank_cache_bytes(cfg, 13, 4, cp=3, block_size=4, layers=1)
    assert r["per_rank_tokens"] == [5, 4, 4]
    assert r["single_rank_cache_bytes"] == 13 * cfg.latent_dim * 4 == sum(r["per_rank_cache_bytes"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--world-size", "0"], "--world-size"),
        (["--context", "0"], "--context"),
        (["--model", "nope"], "model 'nope'"),
    ],
    ids=["world0", "context0", "model"],
)
def test_cp_check_rejects_bad_flags(capsys, argv, needle):
    assert main(["cp-check", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("world", [1, 2, 3, 5], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("block", [1, 3, 4], ids=lambda b: f"block{b}")
def test_placement_counts_and_positions(world, block):
    for length in range(0, 3 * world * block + 2):
        owners = [(p // block) % world for p in range(length)]
        for rank in range(world):
            place = BlockPlacement(rank, world, block)
            mine = [p for p in range(length) if owners[p] == rank]
            assert owned_tokens(length, rank, world, block) == len(mine)
            assert place.global_positions(len(mine)).tolist() == mine


def test_per_rank_cache_bytes_deepseek_v3():
    cfg = MLAConfig.preset("deepseek-v3")
    context = 128 * 1024
    one = per_rank_cache_bytes(cfg, context, 2)
    assert one == [context * 576 * 2 * 61]
    tp8 = per_rank_cache_bytes(cfg, context, 2, tp=8)
    assert tp8 == one * 8, "TP replicates the latent cache"
    cp8 = per_rank_cache_bytes(cfg, context, 2, cp=8)
    assert cp8 == [one[0] // 8] * 8
    both = per_rank_cache_bytes(cfg, context + 1, 2, cp=2, tp=2, block_size=64, layers=1)
    assert both == [(context // 2 + 1) * 1152] * 2 + [context // 2 * 1152] * 2


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(context=-1), "context"),
        (dict(dtype_bytes=0), "dtype_bytes"),
        (dict(cp=0), "cp"),
        (dict(tp=200), "tp=200"),
        (dict(layers=0), "layers"),
    ],
    ids=["context", "dtype", "cp", "tp-heads", "layers"],
)
def test_per_rank_cache_bytes_rejects(kwargs, needle):
    args = dict(context=10, dtype_bytes=2) | kwargs
    with pytest.raises(ValueError, match=needle):
        per_rank_cache_bytes(MLAConfig.preset("deepseek-v3"), **args)


@pytest.mark.parametrize("heads, world", [(6, 2), (5, 2), (5, 3), (128, 8), (20, 8)], ids=str)
def test_head_ranges_cover_all_heads(heads, world):
    ranges = [head_range(heads, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == heads
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_shard_state_dict_slices_and_rejects():
    layer = seeded_layer(TINY)
    state = layer.state_dict()
    local_cfg, local = shard_state_dict(TINY, state, 1, 2)
    assert local_cfg.num_heads == 3
    per = TINY.qk_nope_head_dim + TINY.v_head_dim
    assert torch.equal(local["kv_b_proj.weight"], state["kv_b_proj.weight"][3 * per :])
    assert torch.equal(local["o_proj.weight"], state["o_proj.weight"][:, 3 * TINY.v_head_dim :])
    assert not local["o_proj.bias"].any(), "the bias is added by rank 0 only"
    with pytest.raises(ValueError, match="missing"):
        shard_state_dict(TINY, {k: v for k, v in state.items() if k != "kv_b_proj.weight"}, 0, 2)
    with pytest.raises(ValueError, match="needs at least as many heads"):
        shard_state_dict(TINY, state, 0, 7)


def test_needs_an_initialized_group():
    with pytest.raises(RuntimeError, match="not initialized"):
        ContextParallelMLA(seeded_layer(TINY))


@pytest.mark.parametrize(
    "field, value", [("kv_lora_rank", 16), ("qk_rope_head_dim", 8)], ids=["latent", "rope"]
)
def test_context_parallel_cache_of_another_width_is_refused_naming_it(field, value):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cp = ContextParallelMLA(seeded_layer(TINY))
        other = ContextParallelMLA(seeded_layer(TINY.replace(**{field: value}))).new_cache(1, 8)
        before = other.lengths.clone()
        with pytest.raises(ValueError, match=rf"{field} \(\w+ width\): cache {value}, layer"):
            cp(torch.randn(1, 2, TINY.hidden_size), other)
        assert torch.equal(other.lengths, before)
    finally:
        dist.destroy_process_group()

"""The engine's decoder loop (mlakit/engine/loop.py) against the model's own forward: the families it
takes, the same tokens and bit-identical log-probabilities with and without it (fp32 and bf16, steps
that chunk prompts, mix prefill with decode and reuse cached prefixes; at widths the fused bf16 core
takes, its decode steps' attention through mlakit/engine/decode.py where this CPU runs that core), and
hooks on a bypassed module sending the step back to the model's forward."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("xxhash")

import torch  # noqa: E402
from support.engine import FAMILIES, prompts, tiny_model  # noqa: E402

from mlakit.engine import LLM, SamplingParams  # noqa: E402
from mlakit.engine import loop as loop_mod  # noqa: E402
from mlakit.engine.loop import DecoderLoop  # noqa: E402
from mlakit.engine.packed import packs  # noqa: E402
from mlakit.ops import cpu_core  # noqa: E402
from mlakit.ops.vnni import vnni_packs  # noqa: E402

LOOPED = ("deepseek-v3", "deepseek-v2", "glm-4.7-flash")
ENGINE = dict(num_blocks=40, block_size=16, max_num_seqs=6, max_num_batched_tokens=64)
LENGTHS = [1, 9, 70, 33, 120, 5]
# widths the fused bf16 core and the one-pass rope take (the tiny models' 16 / 8 they do not)
WIDE = dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=16, q_lora_rank=32)


def generate(family: str, dtype: torch.dtype, loop: bool, **extra):
    llm = LLM(tiny_model(family, **extra).to(dtype), **ENGINE)
    runner = llm.llm_engine.runner
    assert (runner.loop is not None) == (family in LOOPED)
    if not loop:
        runner.loop = None
    ps = prompts(12, LENGTHS, shared=40)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    outs = llm.generate(ps, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loop_takes_the_families_whose_forward_it_is(family):
    llm = LLM(tiny_model(family), **ENGINE)
    runner = llm.llm_engine.runner
    built = DecoderLoop.build(runner.model, runner.layers)
    assert (built is not None) == (family in LOOPED), family


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", LOOPED)
@pytest.mark.parametrize("wide", [False, True], ids=["tiny", "wide"])
@pytest.mark.parametrize("path", ["fused", "ops"])
def test_loop_gives_the_model_forwards_numbers(family, dtype, wide, path, monkeypatch):
    extra = WIDE if wide else {}
    fast, fused, moes = [], [], []
    real, real_fused, real_moe = loop_mod.absorb_in_place, loop_mod.fused_layer, loop_mod.fused_moe

    def counted(mla, x, plan):
        out = real(mla, x, plan)
        fast.append(out is not None)
        return out

    def counted_fused(*args):
        out = real_fused(*args) if path == "fused" else None
        fused.append(out is not None)
        return out

    def counted_moe(*args):
        out = real_moe(*args)
        moes.append(out is not None)
        return out

    monkeypatch.setattr(loop_mod, "absorb_in_place", counted)
    monkeypatch.setattr(loop_mod, "fused_layer", counted_fused)
    monkeypatch.setattr(loop_mod, "fused_moe", counted_moe)
    want, _ = generate(family, dtype, loop=False, **extra)
    assert not fast and not fused and not moes
    got, llm = generate(family, dtype, loop=True, **extra)
    # every step's hidden states are the same bits: the same tokens and the same log-probability floats
    assert got == want
    assert llm.llm_engine.stats.prefix_cache_hits > 0
    llm.llm_engine.check()
    # decode steps' attention in one C++ call (path "fused") or a dozen ops (path "ops", or where a layer
    # is not of the fused op's form) exactly where the packed bf16 weights and the core are
    bf16 = dtype == torch.bfloat16
    can = wide and bf16 and packs(dtype, "cpu") and vnni_packs() and cpu_core.available(dtype)
    if path == "fused":
        assert any(fused) == bool(can), (fused.count(True), len(fused))
        assert not any(fast)  # every layer the op took is one absorb_in_place would have taken
        # the MoE blocks after a fused layer: routers of the short form (V3's noaux_tc, GLM-4.7-Flash's)
        assert any(moes) == bool(can and family != "deepseek-v2"), (moes.count(True), len(moes))
    else:
        assert any(fast) == bool(can), (fast.count(True), len(fast))


def test_a_hook_on_a_norm_or_projection_runs_the_layer_op_by_op():
    """The fused layer bypasses its norms' and projections' forwards: a hook on one sends that layer
    through the ops (which call the modules), the others stay fused."""
    if not (vnni_packs() and cpu_core.available(torch.bfloat16)):
        pytest.skip("the fused decode layer needs the AVX512-BF16 core and mlakit's packed weights")
    llm = LLM(tiny_model("deepseek-v3", **WIDE).to(torch.bfloat16), **ENGINE)
    runner = llm.llm_engine.runner
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.generate(prompts(2, [6, 11]), params, use_tqdm=False)
    layers = runner.model.model.layers
    for module in (layers[1].post_attention_layernorm, runner.layers[0].q_a_proj):
        calls: list[int] = []
        handle = module.register_forward_hook(lambda m, a, out, calls=calls: calls.append(a[0].shape[0]))
        hooked = llm.generate(prompts(2, [6, 11]), params, use_tqdm=False)
        handle.remove()
        assert 2 in calls  # the decode steps' two rows went through the hooked module
        assert [o.outputs[0].token_ids for o in hooked] == [o.outputs[0].token_ids for o in plain]


def test_the_fused_layer_refuses_before_writing_the_cache(monkeypatch):
    """A call of the fused op with a bad argument raises before the cache changes; write_in_place
    refuses a quantized cache and a finished plan before its writer runs."""
    if not (vnni_packs() and cpu_core.available(torch.bfloat16)):
        pytest.skip("the fused decode layer needs the AVX512-BF16 core and mlakit's packed weights")
    llm = LLM(tiny_model("deepseek-v3", **WIDE).to(torch.bfloat16), **ENGINE)
    op = torch.ops.mlakit_cpu.mla_decode_layer
    seen = []

    class Spy:
        def __call__(self, *args):
            seen.append(args)
            return op(*args)

    monkeypatch.setattr(torch.ops.mlakit_cpu, "mla_decode_layer", Spy())
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(prompts(2, [6, 11]), params, use_tqdm=False)
    assert seen
    args = list(seen[-1])
    latent, rope = args[15], args[16]
    before = (latent.clone(), rope.clone())
    bad = {
        17: args[17].flip(0)[:1],  # slots of another length
        20: args[20][:, :1].expand(-1, 3),  # rows not contiguous in their last dim
        27: [1, 2, 3],  # dims
        24: args[24][:-1],  # o_proj's pack of fewer blocks
    }
    for i, value in bad.items():
        call = list(args)
        call[i] = value
        with pytest.raises(RuntimeError, match="mla_decode_layer"):
            op(*call)
        assert torch.equal(latent, before[0]) and torch.equal(rope, before[1]), i
    out_of_range = list(args)
    out_of_range[17] = torch.full_like(args[17], latent.shape[0])
    with pytest.raises(RuntimeError, match="out of the pools"):
        op(*out_of_range)
    assert torch.equal(latent, before[0]) and torch.equal(rope, before[1])


def test_a_hook_on_a_bypassed_module_runs_the_model_forward():
    llm = LLM(tiny_model("deepseek-v3"), **ENGINE)
    runner = llm.llm_engine.runner
    calls = []
    handle = runner.model.model.layers[1].register_forward_hook(lambda m, a, out: calls.append(1))
    assert runner.loop.hooked()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    hooked = llm.generate(prompts(2, [6, 11]), params, use_tqdm=False)
    assert len(calls) >= 3  # the prompts' steps and the decode steps ran the model's forward
    handle.remove()
    assert not runner.loop.hooked()
    calls.clear()
    plain = llm.generate(prompts(2, [6, 11]), params, use_tqdm=False)
    assert not calls
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in hooked]

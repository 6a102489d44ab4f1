"""The engine's prepacked bf16 weights (mlakit/engine/packed.py).

PackedLinear's product is bit-identical to F.linear (bf16, every row count, 2D and 3D inputs, with and
without bias) at these small widths in both packed layouts (oneDNN's; mlakit's own on AVX512-BF16 CPUs
without AMX, which sums the same fp32 products in another order at wider ones: tests/test_vnni.py
bounds it); through fp32 (from `upcast` rows) it equals F.linear of the fp32 weight and input.
pack_model replaces the plain linears (not kv_b_proj, not a tied head, not fp32 models where the fp32
probe says no: tests/test_engine_packed_fp32.py covers the fp32 packing), packs the
MoE experts in place (their plain weights become meta tensors), and unpack_model restores every
weight exactly. The engine with packed weights gives the same tokens and log-probabilities as the
engine without, where no product is upcast (and within bf16's reach of them where it is).
Skipped where this CPU has no native bf16 oneDNN (AVX2-only: mlakit computes bf16 in fp32 there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

from support.engine import drain, prompts, tiny_model  # noqa: E402

import mlakit.engine.runner as runner_mod  # noqa: E402
from mlakit.engine import LLMEngine, SamplingParams  # noqa: E402
from mlakit.engine import packed as packed_mod  # noqa: E402
from mlakit.engine.moe import GroupedMoE, install_moe  # noqa: E402
from mlakit.engine.packed import PackedLinear, pack_model, packs, unpack_model, upcast_rows  # noqa: E402
from mlakit.linear import Linear  # noqa: E402

pytestmark = pytest.mark.skipif(
    not packs(torch.bfloat16, "cpu"), reason="this CPU's oneDNN has no native bf16 (nothing is packed)"
)


@pytest.fixture
def no_upcast(monkeypatch):
    """Every packed product in bf16 (the probe's answer replaced by 'never')."""
    monkeypatch.setattr(packed_mod, "_UPCAST", [None])


@pytest.fixture
def no_fp32(monkeypatch):
    """fp32 weights stay plain (the fp32 probe's answer replaced by 'no gain')."""
    monkeypatch.setattr(packed_mod, "_FP32", [False])


def _linear(out_f: int, in_f: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias).to(torch.bfloat16)
    return lin


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 130])
def test_packed_linear_bitwise(rows, bias):
    lin = _linear(200, 96, bias, seed=rows)
    p = PackedLinear(lin)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(p(x), F.linear(x, lin.weight, lin.bias))
        x3 = x.view(1, rows, 96)
        assert torch.equal(p(x3), F.linear(x3, lin.weight, lin.bias))
    assert torch.equal(p.weight, lin.weight)  # rebuilt from the packed layout, exactly


def test_packed_linear_upcast():
    lin = _linear(64, 48, True, seed=0)
    p = PackedLinear(lin, upcast=16)
    with torch.inference_mode():
        few = torch.randn(15, 48).to(torch.bfloat16)
        assert torch.equal(p(few), F.linear(few, lin.weight, lin.bias))  # under the threshold: bf16
        many = torch.randn(2, 16, 48).to(torch.bfloat16)
        want = F.linear(many.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16)
        assert torch.equal(p(many), want)
    assert upcast_rows() in (None, *packed_mod.PROBE_ROWS)


def test_packed_linear_refuses_other_inputs():
    p = PackedLinear(_linear(8, 4, False, seed=0))
    with pytest.raises(ValueError, match="bf16 on the CPU"):
        p(torch.randn(2, 4))


def test_pack_model_what_is_packed_and_unpack(no_upcast):
    model = tiny_model("deepseek-v3").to(torch.bfloat16)
    install_moe(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n = pack_model(model)
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.q_a_proj, PackedLinear)
    assert isinstance(layers[0].mlp.down_proj, PackedLinear)  # the dense first layer
    assert isinstance(model.lm_head, PackedLinear)
    assert type(layers[0].self_attn.kv_b_proj) is nn.Linear  # read as views by mlakit: plain
    moe = layers[1].mlp
    assert isinstance(moe, GroupedMoE) and moe.released
    assert moe.experts.gate_up_proj.device.type == "meta"  # memory neutral: the packed copy replaced it
    linears = sum(isinstance(m, PackedLinear) for m in model.modules())
    assert n == linears + 1
    assert unpack_model(model) == n
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def test_pack_model_skips_tied_head_fp32_and_compile_refusal(no_upcast, no_fp32):
    tied = tiny_model("minicpm3", tie_word_embeddings=True).to(torch.bfloat16)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    pack_model(tied)
    assert type(tied.lm_head) is nn.Linear  # its weight is the embedding's: packing it would copy
    assert pack_model(tiny_model("deepseek-v3")) == 0  # fp32 where the probe finds no gain: nothing
    model = tiny_model("glm-4.7-flash").to(torch.bfloat16)
    install_moe(model)
    pack_model(model)
    moe = model.model.layers[1].mlp
    with pytest.raises(RuntimeError, match="unpack"):
        moe._traced(
            torch.zeros(2, 32, dtype=torch.bfloat16), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)
        )
    assert install_moe(model, impl="transformers") == 0  # transformers' blocks back, plain weights
    assert model.model.layers[1].mlp.experts.gate_up_proj.device.type == "cpu"


def test_released_experts_equal_the_copy(no_upcast):
    model = tiny_model("deepseek-v2").to(torch.bfloat16)
    install_moe(model, pack=True)  # a packed copy beside the plain weights
    moe = model.model.layers[1].mlp
    x = torch.randn(1, 200, 32).to(torch.bfloat16)  # segments over PACKED_ROWS? no: 200 x 2 / 4 = 100
    with torch.inference_mode():
        want = moe(x)
        assert moe.pack(release=True)
        assert torch.equal(moe(x), want)
        assert moe.unpack()
        assert torch.equal(moe(x), want)


@pytest.mark.parametrize("family", ["deepseek-v3", "minicpm3"])
def test_engine_packed_same_tokens(family, no_upcast, monkeypatch):
    ps = prompts(4, [5, 40, 17, 90], seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    got = {}
    for pack in (False, True):
        monkeypatch.setattr(runner_mod, "PACK", pack)
        eng = LLMEngine(tiny_model(family).to(torch.bfloat16), num_blocks=64, block_size=16)
        assert (eng.runner.packed_modules > 0) == pack
        assert eng.stats.packed_modules == eng.runner.packed_modules
        for i, p in enumerate(ps):
            eng.add_request(f"r{i}", p, params)
        got[pack] = {k: (o.outputs[0].token_ids, o.outputs[0].logprobs) for k, o in drain(eng).items()}
    assert got[True] == got[False]


def test_engine_fp32_not_packed(no_fp32):
    eng = LLMEngine(tiny_model("deepseek-v3"), num_blocks=32, block_size=16)
    assert eng.runner.packed_modules == 0
    assert not any(isinstance(m, PackedLinear) for m in eng.runner.model.modules())
    assert all(type(m) is not PackedLinear for m in eng.runner.layers)
    assert isinstance(eng.runner.layers[0].q_a_proj, Linear)

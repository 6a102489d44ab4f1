"""Prepacked fp32 weights (mlakit/engine/packed.py, `fp32_packs`): where oneDNN's packed fp32 GEMM beats
torch's plain one (an AVX2-only EPYC: 1.4-2.3x at decode rows), the engine's fp32 linears and experts
are packed too.

The probe's answer is replaced in these tests ('gain' / 'no gain') so they hold on every CPU. Packed
fp32 products are not bit-identical to MKL's (another summation order): they are compared with the
fp64 product at fp32's rounding, and the engine with packed fp32 weights against transformers' own
greedy tokens and against the engine with plain weights (log-probabilities within fp32 rounding).
The weights come back exactly: oneDNN's reorder moves values, it computes none."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

from support.engine import drain, prompts, reference, tiny_model  # noqa: E402

import mlakit.engine.runner as runner_mod  # noqa: E402
from mlakit.engine import LLMEngine, SamplingParams  # noqa: E402
from mlakit.engine import packed as packed_mod  # noqa: E402
from mlakit.engine.moe import GroupedMoE, install_moe  # noqa: E402
from mlakit.engine.packed import PackedLinear, fp32_packs, pack_model, packs, unpack_model  # noqa: E402

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
pytestmark = pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN: nothing is packed")


@pytest.fixture
def fp32_gain(monkeypatch):
    monkeypatch.setattr(packed_mod, "_FP32", [True])


def _linear(out_f: int, in_f: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


def test_probe_answers_once_and_packs_follows_it(monkeypatch):
    monkeypatch.setattr(packed_mod, "_FP32", [])
    answer = fp32_packs()
    assert isinstance(answer, bool)
    assert [answer] == packed_mod._FP32  # cached: later engines do not probe again
    assert packs(torch.float32, "cpu") is answer
    monkeypatch.setattr(packed_mod, "_FP32", [False])
    assert not packs(torch.float32, "cpu")
    monkeypatch.setattr(packed_mod, "_FP32", [True])
    assert packs(torch.float32, "cpu")
    assert not packs(torch.float16, "cpu")
    assert not packs(torch.float32, "meta")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 130])
def test_packed_fp32_linear_within_rounding(rows, bias, fp32_gain):
    lin = _linear(200, 96, bias, seed=rows)
    p = PackedLinear(lin)
    assert p.dtype == torch.float32 and p.upcast is None
    x = torch.randn(rows, 96)
    want = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    with torch.inference_mode():
        got = p(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 200)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p(x.view(1, rows, 96)), got.view(1, rows, 200), rtol=0, atol=1e-6)
    assert torch.equal(p.weight, lin.weight)  # rebuilt from the packed layout, exactly


def test_packed_fp32_refuses_other_inputs(fp32_gain):
    p = PackedLinear(_linear(8, 4, False, seed=0))
    with pytest.raises(ValueError, match="fp32 on the CPU"):
        p(torch.randn(2, 4).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 or fp32"):
        PackedLinear(_linear(8, 4, False, seed=0).to(torch.float16))


def test_pack_model_fp32_and_unpack_exactly(fp32_gain):
    model = tiny_model("deepseek-v3")
    install_moe(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n = pack_model(model)
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.q_a_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)
    assert type(layers[0].self_attn.kv_b_proj) is nn.Linear  # read as views by mlakit: plain
    moe = layers[1].mlp
    assert isinstance(moe, GroupedMoE) and moe.released
    assert moe.experts.gate_up_proj.device.type == "meta"
    assert n == sum(isinstance(m, PackedLinear) for m in model.modules()) + 1
    assert unpack_model(model) == n
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert after[k].dtype == torch.float32 and torch.equal(after[k], v), k


def test_packed_fp32_experts_within_rounding(fp32_gain):
    model = tiny_model("deepseek-v2")
    install_moe(model)
    moe = model.model.layers[1].mlp
    x = torch.randn(1, 60, 32)
    with torch.inference_mode():
        want = moe(x)
        assert moe.pack(release=True)
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
        assert moe.unpack()
        assert torch.equal(moe(x), want)


@pytest.mark.parametrize("family", ["deepseek-v3", "minicpm3", "glm-4.7-flash"])
def test_engine_packed_fp32_tokens(family, fp32_gain, monkeypatch):
    ps = prompts(4, [5, 40, 17, 90], seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    got = {}
    for pack in (False, True):
        monkeypatch.setattr(runner_mod, "PACK", pack)
        eng = LLMEngine(tiny_model(family), num_blocks=64, block_size=16)
        assert (eng.runner.packed_modules > 0) == pack
        assert eng.stats.packed_modules == eng.runner.packed_modules
        for i, p in enumerate(ps):
            eng.add_request(f"r{i}", p, params)
        got[pack] = {k: o.outputs[0] for k, o in drain(eng).items()}
    want = reference(tiny_model(family), ps, 8)
    for i, (tokens, lps) in enumerate(want):
        plain, packed = got[False][f"r{i}"], got[True][f"r{i}"]
        assert list(packed.token_ids) == tokens == list(plain.token_ids)
        for step, (a, b) in enumerate(zip(plain.logprobs, packed.logprobs, strict=True)):
            (ta, la), (tb, lb) = next(iter(a.items())), next(iter(b.items()))
            assert ta == tb == tokens[step]
            assert abs(la - lb) < 1e-4 and abs(lb - lps[step]) < 1e-4

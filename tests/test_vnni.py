"""mlakit's packed bf16 weights (mlakit/ops/vnni.py, csrc/vnni_linear.cpp): the layout round trip, the
product against fp64 and F.linear at every row count a step gives, per-head folds and unfolds, the
layer's packs and when they are not used; the one-pass RMSNorm (csrc/rows.cpp) and the engine's swap
of transformers' norms. Skips where the bf16 core cannot run, saying why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.common import assert_close, tiny_config

from mlakit import MLAAttention
from mlakit.ops import absorb, cpu_core
from mlakit.ops.vnni import HeadWeights, UpPacks, VnniWeight, pack, unpack, vnni_packs


def need_core() -> None:
    if not cpu_core.available():
        pytest.skip(f"fused core unavailable: {cpu_core.unavailable_reason()}")


@pytest.mark.parametrize("shape", [(64, 32), (77, 301), (1, 2), (33, 1)], ids=["aligned", "odd", "one", "k1"])
def test_pack_round_trip_is_exact(shape):
    w = torch.randn(*shape).bfloat16()
    packed = pack(w)
    assert packed.shape == (-(-shape[0] // 32), -(-shape[1] // 2), 64)
    assert torch.equal(unpack(packed, *shape), w)
    heads = torch.randn(3, *shape).bfloat16()
    per_head = pack(heads)
    assert all(torch.equal(per_head[h], pack(heads[h])) for h in range(3))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 33, 130])
def test_product_against_fp64_and_f_linear(rows, bias):
    """Within the output's bf16 rounding of the exact product, and within one rounding of F.linear
    (the same fp32 sums in another order); N and K not multiples of the block."""
    need_core()
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 301, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 301, generator=g).bfloat16()
    got = VnniWeight(w).mm(x, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    assert_close("vs fp64", got, exact, 2**-8)
    assert_close("vs F.linear", got, F.linear(x, w, b), 2**-7)
    x3 = torch.randn(2, rows, 301, generator=g).bfloat16()[:, :, :300]  # strided rows, even width
    w3 = w[:, :300].contiguous()
    got3 = VnniWeight(w3).mm(x3)
    assert got3.shape == (2, rows, 200)
    assert_close("3-d strided", got3, x3.double() @ w3.double().T, 2**-8)


def test_the_lm_head_row_counts_against_fp64():
    """A 129,280-row head is 4,040 blocks across the threads: each row's columns equal the exact ones."""
    need_core()
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4096 + 17, 1024, generator=g) / 32).bfloat16()
    for rows in (1, 8, 32):
        x = torch.randn(rows, 1024, generator=g).bfloat16()
        assert_close(f"{rows} rows", VnniWeight(w).mm(x), x.double() @ w.double().T, 2**-8)


@pytest.mark.parametrize("rows", [1, 8, 13, 40])
def test_per_head_folds_and_unfolds(rows):
    need_core()
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(5, 24 + 32, 96, generator=g).bfloat16()
    w_uk, w_uv = w[:, :24], w[:, 24:]  # the strided per-head views up_weights gives
    packs = UpPacks(w_uk, w_uv)
    q = torch.randn(rows, 5, 24 + 8, generator=g).bfloat16()[..., :24]  # q_nope: a view beside q_pe
    fold = torch.einsum("mhd,hdl->mhl", q.double(), w_uk.double())
    assert packs.fold.fits(q)
    assert_close("fold", packs.fold.mm(q), fold, 2**-8)
    o = torch.randn(rows, 5, 96, generator=g).bfloat16()
    unfold = torch.einsum("mhl,hvl->mhv", o.double(), w_uv.double())
    assert_close("unfold", packs.unfold.mm(o), unfold, 2**-8)
    assert not packs.fold.fits(q.float()) and not packs.fold.fits(q[:, :4])


def test_absorb_with_packs_equals_absorb_without():
    need_core()
    g = torch.Generator().manual_seed(1)
    heads, lens = 4, [30, 200, 77]
    w = (torch.randn(heads, 32 + 32, 64, generator=g) / 8).bfloat16()
    args = (
        torch.randn(3, 1, heads, 32, generator=g).bfloat16(),
        torch.randn(3, 1, heads, 8, generator=g).bfloat16(),
        torch.randn(3, 200, 64, generator=g).bfloat16(),
        torch.randn(3, 200, 8, generator=g).bfloat16(),
        torch.tensor(lens),
        w[:, :32],
        w[:, 32:],
        0.2,
    )
    plain, plain_lse = absorb(*args)
    packed, packed_lse = absorb(*args, packs=UpPacks(w[:, :32], w[:, 32:]))
    assert torch.equal(packed_lse, plain_lse) or (packed_lse - plain_lse).abs().max() < 1e-2
    assert_close("packed folds vs plain", packed, plain, 2e-2)  # both round their folds to bf16


def test_layer_packs_follow_its_weight():
    """pack_up keeps packs while kv_b_proj's weight is the one packed; an in-place change, a new
    weight or fp32 weights: no packs (the plain path runs)."""
    cfg = tiny_config(kv_lora_rank=64, qk_nope_head_dim=8, v_head_dim=32, qk_rope_head_dim=4)
    layer = MLAAttention(cfg, dtype=torch.bfloat16)
    if not vnni_packs():
        assert not layer.pack_up() and layer.up_packs() is None
        pytest.skip("no packed layout on this CPU")
    assert layer.pack_up() and isinstance(layer.up_packs(), UpPacks)
    w_uk, w_uv = layer.up_weights()
    assert torch.equal(unpack(layer.up_packs().unfold.packed[0], 32, 64), w_uv[0])
    with torch.no_grad():
        layer.kv_b_proj.weight.mul_(2)
    assert layer.up_packs() is None  # stale: not used
    assert layer.pack_up() and layer.up_packs() is not None
    layer.kv_b_proj.weight = torch.nn.Parameter(layer.kv_b_proj.weight.detach().clone())
    assert layer.up_packs() is None
    assert not MLAAttention(cfg).pack_up()  # fp32


def test_refusals():
    with pytest.raises(ValueError, match="VnniWeight: weight must be a 2-d bf16 CPU tensor"):
        VnniWeight(torch.randn(4, 4))
    with pytest.raises(ValueError, match="HeadWeights: weights must be a 3-d bf16 CPU tensor"):
        HeadWeights(torch.randn(2, 4, 4).bfloat16()[0])


@pytest.mark.parametrize("width", [1024, 100, 17])
def test_one_pass_rms_norm_equals_transformers(width):
    """csrc/rows.cpp's RMSNorm against transformers' DeepseekV3RMSNorm in bf16: within one bf16
    rounding (the squares summed in another order), nearly every value identical."""
    need_core()
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    g = torch.Generator().manual_seed(width)
    norm = DeepseekV3RMSNorm(width, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(width, generator=g))
        x = (3 * torch.randn(37, width, generator=g)).bfloat16()
        want = norm(x)
        got = torch.ops.mlakit_cpu.rms_norm(x, norm.weight, 1e-6)
    assert_close("rms_norm", got, want, 2**-7)
    assert (got == want).float().mean() > 0.99


def test_fuse_norms_swaps_only_what_computes_the_same():
    need_core()
    pytest.importorskip("transformers")
    from support.engine import tiny_model
    from torch import nn

    from mlakit.attention import RMSNorm
    from mlakit.engine.packed import fuse_norms

    class OffsetRMSNorm(nn.Module):  # Gemma's form: (1 + weight), not transformers' DeepSeek one
        def __init__(self, width):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(width))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (1 + self.weight) * xf.to(x.dtype)

    model = tiny_model("deepseek-v3").to(torch.bfloat16)
    model.model.norm = OffsetRMSNorm(model.config.hidden_size).bfloat16()
    names = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    swapped = fuse_norms(model)
    assert swapped == len(names) - 1 and isinstance(model.model.norm, OffsetRMSNorm)
    assert isinstance(model.model.layers[0].input_layernorm, RMSNorm)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert fuse_norms(tiny_model("deepseek-v3")) == 0  # fp32: nothing to gain

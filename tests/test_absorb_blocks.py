"""The blocked (online-softmax) absorb core and 16-bit compute paths against the fp64 reference."""

import importlib

import pytest
import torch

from mlakit.linear import Linear, upcast_linear
from mlakit.ops import absorb, materialize, reference
from mlakit.ops.absorb import latent_attention

# the package re-exports the function `absorb`, which shadows the submodule as an attribute
absorb_mod = importlib.import_module("mlakit.ops.absorb")

H, DN, DR, L, DV = 3, 8, 4, 24, 6


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def inputs(batch, new, keys, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return dict(
        q_nope=r(batch, new, H, DN),
        q_pe=r(batch, new, H, DR),
        c_kv=r(batch, keys, L),
        k_pe=r(batch, keys, DR),
        w_uk=r(H, DN, L, s=0.3),
        w_uv=r(H, DV, L, s=0.3),
    )


@pytest.mark.parametrize("block", [1, 5, 16, 1024], ids=lambda b: f"block{b}")
@pytest.mark.parametrize(
    "batch,new,lens",
    [(1, 1, [37]), (2, 1, [37, 12]), (2, 4, [37, 9]), (3, 7, [7, 20, 33])],
    ids=["B1-decode", "B2-ragged-decode", "B2-chunk", "B3-prefill-ragged"],
)
def test_blocked_absorb_matches_reference(monkeypatch, block, batch, new, lens):
    monkeypatch.setattr(absorb_mod, "KEY_BLOCK", block)
    t = inputs(batch, new, max(lens))
    kv_lens = torch.tensor(lens)
    key_mask = torch.ones(batch, max(lens), dtype=torch.bool)
    key_mask[0, :3] = False
    for km in (None, key_mask):
        want, want_lse = reference(**_args(t, kv_lens), key_mask=km)
        with torch.no_grad():
            got, lse = absorb(**_args(t, kv_lens), key_mask=km)
        assert rel_err(got, want) < 1e-5, f"out rel err {rel_err(got, want):.2e}"
        assert torch.allclose(lse, want_lse, atol=1e-5), f"lse max err {(lse - want_lse).abs().max():.2e}"


def _args(t, kv_lens):
    return dict(
        q_nope=t["q_nope"],
        q_pe=t["q_pe"],
        c_kv=t["c_kv"],
        k_pe=t["k_pe"],
        kv_lens=kv_lens,
        w_uk=t["w_uk"],
        w_uv=t["w_uv"],
        scale=0.37,
    )


def test_fully_hidden_block_and_no_keys(monkeypatch):
    monkeypatch.setattr(absorb_mod, "KEY_BLOCK", 4)
    t = inputs(1, 1, 12)
    key_mask = torch.ones(1, 12, dtype=torch.bool)
    key_mask[0, :8] = False  # the first two blocks are hidden entirely
    want, _ = reference(**_args(t, torch.tensor([12])), key_mask=key_mask)
    with torch.no_grad():
        got, _ = absorb(**_args(t, torch.tensor([12])), key_mask=key_mask)
    assert rel_err(got, want) < 1e-5
    out, lse = latent_attention(
        torch.randn(1, 1, 2, 8),
        torch.randn(1, 1, 2, 4),
        torch.randn(1, 0, 8),
        torch.randn(1, 0, 4),
        None,
        0.1,
    )
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()


@pytest.mark.parametrize("path", [absorb, materialize], ids=["absorb", "materialize"])
def test_bf16_storage_stays_close_to_fp32(path):
    t = inputs(2, 3, 40, seed=3)
    kv_lens = torch.tensor([40, 25])
    want, _ = reference(**_args(t, kv_lens))
    tb = {k: v.bfloat16() for k, v in t.items()}
    with torch.no_grad():
        got, _ = path(**_args(tb, kv_lens))
    assert got.dtype == torch.bfloat16
    # bf16 rounding of inputs alone moves outputs by ~1e-2 relative at these widths
    assert rel_err(got, want) < 3e-2


@pytest.mark.parametrize("rows", [1, 7, 8, 33], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_matches_nn_linear(rows, bias, monkeypatch):
    monkeypatch.setattr("mlakit.linear.WEIGHT_BLOCK", 5)
    torch.manual_seed(rows)
    lin = Linear(19, 23, bias=bias).bfloat16()
    x = torch.randn(rows, 19).bfloat16()
    with torch.no_grad():
        want = torch.nn.functional.linear(
            x.double(), lin.weight.double(), None if not bias else lin.bias.double()
        )
        got = lin(x)
        blocked = upcast_linear(x, lin.weight, lin.bias, torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 23)
    assert rel_err(got, want) < 1e-2
    assert rel_err(blocked, want) < 1e-2
    assert list(lin.state_dict()) == list(torch.nn.Linear(19, 23, bias=bias).state_dict())

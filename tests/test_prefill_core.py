"""The fused CPU prefill core (materialize's attention over expanded keys) against fp64 on the same
bf16 inputs; materialize with it against the torch core and the fp64 reference; what it never reads;
the fallback. Skips where the bf16 core cannot run (no AVX512-BF16, no compiler), saying why."""

from __future__ import annotations

import pytest
import torch
from support.common import assert_close, assert_lse_close

from mlakit.ops import cpu_core, materialize, reference
from mlakit.ops.materialize import joined


def need_core() -> None:
    if not cpu_core.available():
        pytest.skip(f"fused core unavailable: {cpu_core.unavailable_reason()}")


def oracle(q_nope, q_pe, k_nope, k_pe, v, lens, scale, key_start=0):
    """fp64 attention over expanded keys: (out [B,S,H,dv], lse [B,S,H]); query i of row b sees key
    positions up to lens[b] - S + i, keys of this call at key_start.."""
    heads, new, keys = q_nope.shape[2], q_nope.shape[1], k_nope.shape[1]
    q = torch.cat([q_nope, q_pe], -1).double()
    k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, heads, -1)], -1).double()
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    last = lens[:, None] - new + torch.arange(new)[None]  # [B, S]
    hidden = (key_start + torch.arange(keys))[None, None, :] > last[:, :, None]
    scores = scores.masked_fill(hidden[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhst,bthd->bshd", probs, v.double()), lse.transpose(1, 2)


def case(batch, new, heads, keys, dn, dr, dv, seed=0):
    """Queries as views of one [B, S, H, dn + dr] tensor and keys / values as views of one
    [B, T, H, dn + dv] tensor (as the layer and the expansion give them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, new, heads, dn + dr, generator=g).bfloat16()
    kv = torch.randn(batch, keys, heads, dn + dv, generator=g).bfloat16()
    k_pe = torch.randn(batch, keys, dr, generator=g).bfloat16()
    return q[..., :dn], q[..., dn:], kv[..., :dn], k_pe, kv[..., dn:]


# (batch, new, heads, keys, dn, dr, dv, lens, key_start): 32-query and 128-key block boundaries ±1,
# ragged rows, a chunk over a cached prefix, keys of a later workspace chunk, V3's widths
SHAPES = {
    "B2-S5-H3-T9": (2, 5, 3, 9, 16, 8, 32, [9, 7], 0),
    "B1-S33-H2-T33": (1, 33, 2, 33, 16, 4, 32, [33], 0),
    "B3-S31-H2-T129-extend": (3, 31, 2, 129, 16, 4, 64, [129, 100, 31], 0),
    "B1-S130-H4-T130-v3": (1, 130, 4, 130, 128, 64, 128, [130], 0),
    "B2-S7-H3-T50-start40": (2, 7, 3, 50, 16, 8, 32, [120, 60], 40),
    "B1-S4-H1-T8-start90-hidden": (1, 4, 1, 8, 2, 2, 32, [95], 90),
}


@pytest.mark.parametrize("need_lse", [True, False], ids=["lse", "no-lse"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_core_against_fp64_on_the_same_inputs(shape, need_lse):
    need_core()
    batch, new, heads, keys, dn, dr, dv, lens, start = shape
    q_nope, q_pe, k_nope, k_pe, v = case(batch, new, heads, keys, dn, dr, dv)
    lens = torch.tensor(lens)
    out, lse = cpu_core.fused_prefill(
        q_nope, q_pe, k_nope, k_pe, v, lens, 0.1, key_start=start, need_lse=need_lse
    )
    want, want_lse = oracle(q_nope, q_pe, k_nope, k_pe, v, lens, 0.1, start)
    # scores in fp32 from exact bf16 products: lse to fp32 round-off; values mixed with bf16
    # probabilities (2^-9 each), normalized by their rounded sum; the bf16 output adds its rounding
    assert out.dtype == (torch.float32 if need_lse else torch.bfloat16)
    assert_close("out", out, want, 4e-3 if need_lse else 8e-3)
    if need_lse:
        assert_lse_close("lse", lse, want_lse, atol=1e-5)
    else:
        assert lse is None


def test_hidden_and_past_length_keys_are_never_read():
    """Keys past each row's length hold NaN and inf (a released slot, a poisoned page): the output
    is finite and equal to the one over clean keys; a query that sees no key gives 0 and lse -inf."""
    need_core()
    q_nope, q_pe, k_nope, k_pe, v = case(2, 6, 3, 300, 16, 8, 32, seed=1)
    lens = torch.tensor([300, 140])
    clean = cpu_core.fused_prefill(q_nope, q_pe, k_nope, k_pe, v, lens, 0.2, need_lse=True)
    for t in (k_nope, k_pe, v):
        t[1, 140:] = float("nan")
        t[1, 200:] = float("inf")
    poisoned = cpu_core.fused_prefill(q_nope, q_pe, k_nope, k_pe, v, lens, 0.2, need_lse=True)
    assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[1], clean[1])
    # keys 200.. of this call: row 1's queries (positions 134..139) see none of them
    out, lse = cpu_core.fused_prefill(
        q_nope, q_pe, k_nope[:, 200:], k_pe[:, 200:], v[:, 200:], lens, 0.2, key_start=200, need_lse=True
    )
    assert torch.isneginf(lse[1]).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(lse[0]).all()


def test_core_error_at_v3_widths_within_the_rounding_of_its_inputs():
    """Against fp64 on the unrounded fp32 inputs: within 1.5x of an exact computation on the
    bf16-rounded inputs (the error the inputs' rounding alone makes), plus the output's rounding."""
    need_core()
    g = torch.Generator().manual_seed(3)
    shapes = [(1, 200, 16, 128), (1, 200, 16, 64), (1, 200, 16, 128), (1, 200, 16, 128), (1, 200, 64)]
    q_nope, q_pe, k_nope, v, k_pe = (torch.randn(*s, generator=g) for s in shapes)
    lens = torch.tensor([200])
    exact, _ = oracle(q_nope, q_pe, k_nope, k_pe, v, lens, 192**-0.5)
    rounded = [t.bfloat16() for t in (q_nope, q_pe, k_nope, k_pe, v)]
    on_rounded, _ = oracle(*rounded, lens, 192**-0.5)
    floor = assert_close("exact on rounded inputs", on_rounded, exact, 1.0)
    out, _ = cpu_core.fused_prefill(*rounded, lens, 192**-0.5, need_lse=True)
    assert_close("fused core, fp32 out", out, exact, 1.5 * floor)
    out16, _ = cpu_core.fused_prefill(*rounded, lens, 192**-0.5)
    assert_close("fused core, bf16 out", out16, exact, 1.5 * floor + 2**-8)


def layer_case(batch, new, heads, keys, latent=64, dn=16, dr=8, dv=32, seed=0):
    """materialize's inputs in bf16: w_uk and w_uv the two per-head halves of one kv_b weight."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(heads, dn + dv, latent, generator=g) / latent**0.5).bfloat16()
    return (
        torch.randn(batch, new, heads, dn, generator=g).bfloat16(),
        torch.randn(batch, new, heads, dr, generator=g).bfloat16(),
        torch.randn(batch, keys, latent, generator=g).bfloat16(),
        torch.randn(batch, keys, dr, generator=g).bfloat16(),
        w[:, :dn],
        w[:, dn:],
    )


@pytest.mark.parametrize("workspace", [4096, 50], ids=["one-shot", "chunks-of-50"])
@pytest.mark.parametrize(
    "lens,new", [([120, 120], 120), ([130, 77], 20), ([64, 200], 1)], ids=["prefill", "extend", "decode-row"]
)
def test_materialize_fused_against_torch_and_fp64(lens, new, workspace):
    need_core()
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = layer_case(2, new, 3, max(lens))
    kv_lens = torch.tensor(lens)
    args = (q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, 0.15)
    ref, ref_lse = reference(*[t.double() if t.is_floating_point() else t for t in args[:7]], 0.15)
    for need_lse in (True, False):
        kw = dict(workspace_tokens=workspace, need_lse=need_lse)
        fused, fused_lse = materialize(*args, core="fused", **kw)
        slow, slow_lse = materialize(*args, core="torch", **kw)
        assert fused.dtype == torch.bfloat16 and fused.shape == ref.shape
        # both expand keys and values through a bf16 GEMM (rounded to bf16) and return bf16
        assert_close("fused vs fp64", fused, ref, 2e-2)
        assert_close("fused vs torch", fused, slow, 2e-2)
        if need_lse or fused_lse is not None:
            assert_lse_close("lse fused vs fp64", fused_lse, ref_lse, atol=2e-2)
        if slow_lse is not None and fused_lse is not None:
            # the torch core's explicit scores come out of a bf16 matmul, rounded to bf16 (the fused
            # core keeps them in fp32): its lse is the coarser of the two
            assert_lse_close("lse fused vs torch", fused_lse, slow_lse, atol=5e-3)
    # a bucket of keys past every length (a plan's max_keys): NaN there is never read
    padded_c = torch.cat([c_kv, torch.full((2, 9, c_kv.shape[-1]), float("nan")).bfloat16()], 1)
    padded_r = torch.cat([k_pe, torch.full((2, 9, k_pe.shape[-1]), float("nan")).bfloat16()], 1)
    bucket, _ = materialize(
        q_nope, q_pe, padded_c, padded_r, kv_lens, w_uk, w_uv, 0.15, core="fused", max_keys=max(lens) + 9
    )
    assert_close("bucketed", bucket, ref, 2e-2)


def test_materialize_core_choice_and_refusals(monkeypatch):
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = layer_case(1, 4, 2, 4)
    lens = torch.tensor([4])
    f32 = [t.float() for t in (q_nope, q_pe, c_kv, k_pe)]
    with pytest.raises(ValueError, match="core='fused' cannot run here: dtype torch.float32"):
        materialize(*f32, lens, w_uk.float(), w_uv.float(), 0.1, core="fused")
    with pytest.raises(ValueError, match="core must be one of"):
        materialize(q_nope, q_pe, c_kv, k_pe, lens, w_uk, w_uv, 0.1, core="amx")
    mask = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="key_mask"):
        materialize(q_nope, q_pe, c_kv, k_pe, lens, w_uk, w_uv, 0.1, key_mask=mask, core="fused")
    monkeypatch.setitem(cpu_core._state, "loaded", False)
    monkeypatch.setitem(cpu_core._state, "why", "no compiler here")
    with pytest.raises(ValueError, match="no compiler here"):
        materialize(q_nope, q_pe, c_kv, k_pe, lens, w_uk, w_uv, 0.1, core="fused")
    auto, _ = materialize(q_nope, q_pe, c_kv, k_pe, lens, w_uk, w_uv, 0.1)  # auto: the torch core runs
    slow, _ = materialize(q_nope, q_pe, c_kv, k_pe, lens, w_uk, w_uv, 0.1, core="torch")
    assert torch.equal(auto, slow)
    v = torch.zeros(1, 4, 2, 32).bfloat16()
    with pytest.raises(ValueError, match="cannot run here: no compiler here"):
        cpu_core.fused_prefill(q_nope, q_pe, q_nope, k_pe, v, lens, 0.1)


def test_joined_weight_is_a_view_of_kv_b_when_it_can_be():
    w = torch.randn(3, 5 + 7, 8)
    whole = joined(w[:, :5], w[:, 5:])
    assert whole.data_ptr() == w.data_ptr() and torch.equal(whole, w.reshape(36, 8))
    apart = joined(w[:, :5].clone(), w[:, 5:].clone())
    assert torch.equal(apart, w.reshape(36, 8))
    swapped = joined(w[:, 7:], w[:, :7])  # halves of one tensor, but not in kv_b's order
    assert torch.equal(swapped, torch.cat([w[:, 7:], w[:, :7]], 1).reshape(36, 8))

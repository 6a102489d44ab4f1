"""The short decode form of a planned absorb call (`MLAAttention._compute_lean`): equal to the general
path and to the fp64 reference, never fooled by stale rows, stale weight views or wrapped projections,
and short (aten ops counted, not timed)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, make_layer, naive_mla, randn
from torch.utils._python_dispatch import TorchDispatchMode

from mlakit import LatentCache, MLAAttention, MLAConfig
from mlakit.cache.paged import PagedLatentCache
from mlakit.ops import common

CFG = MLAConfig(
    hidden_size=40,
    num_heads=3,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
    rope_interleave=True,
)
# the tiny shape of benchmarks/plan_overhead.py
TINY = MLAConfig(
    hidden_size=64,
    num_heads=2,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)
KINDS = ["contiguous", "paged"]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def make_cache(kind: str, cfg=CFG, layers: int = 2, slots: int = 3, dtype=torch.float32):
    if kind == "contiguous":
        return LatentCache(cfg, slots, 48, num_layers=layers, dtype=dtype)
    cache = PagedLatentCache(cfg, 40, 4, max_batch=slots, num_layers=layers, dtype=dtype)
    cache.blocks.shuffle(3)
    return cache


def stack(cfg=CFG, n: int = 2, dtype=torch.float32) -> list[MLAAttention]:
    layers = [make_layer(cfg, seed=50 + i).to(dtype) for i in range(n)]
    for i, layer in enumerate(layers):
        layer.layer_idx = i
    return layers


def step(layers, cache, h, *, general: bool = False, slots=None):
    plan = cache.plan(h.shape[1], slots, mode="absorb", batch=h.shape[0])
    lean = plan.lean
    if general:
        plan.lean = None
    for layer in layers:
        h = layer(h, plan)
    cache.commit(plan)
    return h, lean


def lean_and_general(kind, dtype, x, prefill: int):
    """Two caches given the same `prefill` tokens of x, then one decode step each: (lean output, its
    lean form, general-path output, the layers)."""
    layers = stack(dtype=dtype)
    cache, general = make_cache(kind, dtype=dtype), make_cache(kind, dtype=dtype)
    with torch.no_grad():
        for c in (cache, general):
            step(layers, c, x[:, :prefill])
        got, lean = step(layers, cache, x[:, prefill : prefill + 1])
        want, _ = step(layers, general, x[:, prefill : prefill + 1], general=True)
    return got, lean, want, layers


@pytest.mark.parametrize("kind", KINDS)
def test_lean_decode_equals_the_general_path_and_the_fp64_reference(kind):
    layers = stack()
    lean_cache, general_cache = make_cache(kind), make_cache(kind)
    x = randn(3, 12, CFG.hidden_size, seed=1)
    with torch.no_grad():
        for cache in (lean_cache, general_cache):
            step(layers, cache, x[:, :9], general=True)  # a prefill (never the lean form)
        for t in range(9, 12):
            got, lean = step(layers, lean_cache, x[:, t : t + 1])
            assert lean is not None, "a one-token absorb step over consecutive slots has a lean form"
            want, _ = step(layers, general_cache, x[:, t : t + 1], general=True)
            assert_close(f"{kind} step {t} lean vs general", got, want, rtol=1e-5)
            ref = x[:, : t + 1]
            for layer in layers:
                ref = naive_mla(layer, ref)
            assert_close(f"{kind} step {t} lean vs fp64", got, ref[:, -1:].float(), rtol=2e-5)
    for a, b in zip(lean_cache.buffers(), general_cache.buffers(), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6) if a.is_floating_point() else True


@pytest.mark.parametrize("kind", KINDS)
def test_lean_decode_in_fp64_matches_the_reference_tightly(kind):
    x = randn(3, 6, CFG.hidden_size, seed=2).double()
    got, lean, want, layers = lean_and_general(kind, torch.float64, x, 5)
    assert lean is not None
    assert_close("fp64 lean vs general", got, want, rtol=1e-13)
    ref = x
    for layer in layers:
        ref = naive_mla(layer, ref)
    # rope angles are fp32 in every path (mlakit.rope): ~1e-8 from the reference's fp64 angles
    assert_close("fp64 lean vs fp64 reference", got, ref[:, -1:], rtol=1e-7)


def test_no_lean_form_where_the_general_path_is_needed():
    layers = stack()
    with torch.no_grad():
        cache = make_cache("contiguous")
        step(layers, cache, randn(3, 4, CFG.hidden_size, seed=3))
        assert cache.plan(2, mode="absorb").lean is None  # two new tokens
        assert cache.plan(1, mode="materialize").lean is None
        assert cache.plan([1, 2, 1], mode="absorb", seq_len=2).lean is None  # ragged
        assert cache.plan(1, [2, 0], mode="absorb").lean is None  # slots not consecutive
        assert cache.plan(1, [1, 2], mode="absorb").lean is not None
        fp8 = PagedLatentCache(CFG.replace(kv_lora_rank=128), 40, 4, max_batch=3, quant="fp8")
        assert fp8.plan(1, mode="absorb").lean is None
        if not bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            bf16 = make_cache("contiguous", dtype=torch.bfloat16)
            assert bf16.plan(1, mode="absorb").lean is None  # matmuls in fp32: the general path


def test_stale_nan_past_a_rolled_back_or_released_length_never_reaches_the_lean_form():
    layers = stack()
    cache, clean = make_cache("contiguous", layers=2), make_cache("contiguous", layers=2)
    x = randn(3, 8, CFG.hidden_size, seed=4)
    bad = torch.full((3, 4, CFG.hidden_size), float("nan"))
    with torch.no_grad():
        step(layers, cache, x[:, :5])
        step(layers, clean, x[:, :5])
        step(layers, cache, bad)  # a draft of NaN, rejected: lengths back to 5
        cache.lengths[:] = 5
        got, lean = step(layers, cache, x[:, 5:6])
        want, _ = step(layers, clean, x[:, 5:6], general=True)
        assert lean is not None
        assert_close("after a rolled-back NaN draft", got, want, rtol=1e-5)
        cache.release(1)  # slot 1 held NaN past 6 tokens, then a short request reuses it
        clean.release(1)
        for c in (cache, clean):
            plan = c.plan(2, [1], mode="absorb")
            h = x[1:2, :2]
            for layer in layers:
                h = layer(h, plan)
            c.commit(plan)
        got, _ = step(layers, cache, x[:, 6:7])
        want, _ = step(layers, clean, x[:, 6:7], general=True)
    assert torch.isfinite(got).all()
    assert_close("a reused slot", got, want, rtol=1e-5)


def test_lean_form_follows_new_weights_and_honours_wrapped_projections():
    layers = stack(n=1)
    layer = layers[0]
    cache = make_cache("contiguous", layers=1)
    x = randn(3, 4, CFG.hidden_size, seed=5)
    with torch.no_grad():
        step(layers, cache, x[:, :3])
        before = cache.lengths.clone()

        def decode(**kw):
            cache.lengths.copy_(before)
            return step(layers, cache, x[:, 3:], **kw)[0]

        first = decode()
        layer.kv_b_proj.weight.data = layer.kv_b_proj.weight.data * 2  # new storage
        layer.o_proj.load_state_dict({"weight": layer.o_proj.weight * 0.5})  # in place
        assert_close("new weights", decode(), decode(general=True), rtol=1e-5)
        assert not torch.allclose(decode(), first)
        calls = []
        hook = layer.o_proj.register_forward_hook(lambda m, args, out: calls.append(1) or out * 3)
        assert_close("a hooked o_proj runs", decode(), decode(general=True), rtol=1e-5)
        assert calls, "the hook ran"
        hook.remove()


class Scaled(torch.nn.Module):
    """An adapter around a projection (what LoRA wrappers look like): no `weight` of its own."""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return 2 * self.base(x)


class Double(torch.nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("how", ["wrapped", "parametrized", "transposed-in-place"])
def test_replaced_or_reparametrized_projections_take_the_general_path(how):
    cfg = CFG.replace(hidden_size=CFG.num_heads * CFG.v_head_dim)  # o_proj square: 15 x 15
    layers = stack(cfg, n=1)
    layer = layers[0]
    cache = make_cache("contiguous", cfg, layers=1)
    x = randn(3, 4, cfg.hidden_size, seed=11)
    with torch.no_grad():
        step(layers, cache, x[:, :3])
        before = cache.lengths.clone()

        def decode(**kw):
            cache.lengths.copy_(before)
            return step(layers, cache, x[:, 3:], **kw)[0]

        decode()  # views kept for the plain module
        if how == "wrapped":
            layer.o_proj = Scaled(layer.o_proj)
        elif how == "parametrized":
            torch.nn.utils.parametrize.register_parametrization(layer.o_proj, "weight", Double())
        else:  # same data pointer, new strides: the kept views must be made again
            layer.o_proj.weight.data = layer.o_proj.weight.data.t()
        got = decode()
        want = decode(general=True)
    assert_close(f"{how} projection", got, want, rtol=1e-5)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad-mode"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_planned_decode_call_at_the_tiny_shape_takes_at_most_30_aten_ops(kind, grad):
    """The op-count target, counted (not timed): batch 4, one new token, hidden 64 / 2 heads / latent 16,
    64 cached tokens, mode absorb; under no_grad and under grad mode (autograd records the call)."""
    layer = make_layer(TINY, seed=6)
    paged = kind == "paged"
    cache = PagedLatentCache(TINY, 8, 64, max_batch=4) if paged else LatentCache(TINY, 4, 128)
    h = randn(4, 1, TINY.hidden_size, seed=7)
    with torch.no_grad():
        layer(randn(4, 64, TINY.hidden_size, seed=8), cache)
    with torch.set_grad_enabled(grad):
        plan = cache.plan(1, mode="absorb")
        layer(h, plan)  # makes the views the calls reuse
        counter = OpCounter()
        with counter:
            out = layer(h, plan)
    assert out.requires_grad == grad
    assert counter.ops <= 30, f"{counter.ops} aten ops"


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_through_the_lean_form_equal_the_general_paths(kind):
    """Under grad mode the lean form records a graph: gradients of the queries' side (hidden states,
    q and o projections, kv_b_proj) equal the general path's; the keys reach attention through the
    cache in both, so kv_a_proj gets none from a planned call in either."""
    layers = stack()
    x = randn(3, 6, CFG.hidden_size, seed=12)
    grads = {}
    for general in (False, True):
        cache = make_cache(kind)
        with torch.no_grad():
            step(layers, cache, x[:, :5])
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        h = x[:, 5:].clone().requires_grad_(True)
        out, lean = step(layers, cache, h, general=general)
        assert lean is not None
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads[general] = {"hidden": h.grad}
        for i, layer in enumerate(layers):
            for name, p in layer.named_parameters():
                grads[general][f"{i}.{name}"] = p.grad
    for name, want in grads[True].items():
        got = grads[False][name]
        if want is None:
            assert got is None or not got.any(), f"{name}: a gradient the general path does not give"
        else:
            assert_close(f"grad {name}", got, want, rtol=1e-5)


def test_copy_from_refills_a_kept_plan_as_a_replayed_cuda_graph_would_use_it():
    layers = stack()
    cache = make_cache("contiguous")
    x = randn(3, 8, CFG.hidden_size, seed=9)
    with torch.no_grad():
        step(layers, cache, x[:, :5])
        static = cache.plan(1, mode="absorb")  # the plan a graph would be captured with
        h = x[:, 5:6]
        for layer in layers:
            h = layer(h, static)
        cache.commit(static)
        with pytest.raises(ValueError, match="differ in shape"):
            static.copy_from(cache.plan(2, mode="absorb"))
        pair = cache.plan(1, [0, 1], mode="absorb")
        with pytest.raises(ValueError, match="differ in shape"):  # other slots: another context view
            pair.copy_from(cache.plan(1, [1, 2], mode="absorb"))
        two = cache.plan(2, mode="absorb")
        with pytest.raises(ValueError, match="differ in shape"):  # ragged rows: other query windows
            two.copy_from(cache.plan([1, 2, 2], mode="absorb", seq_len=2))
        new = cache.plan(1, mode="absorb")
        static.copy_from(new)
        assert torch.equal(static.positions, new.positions) and torch.equal(static.kv_lens, new.kv_lens)
        assert torch.equal(static.lean.bias, new.lean.bias)
        assert torch.equal(static.lean.rotation, new.lean.rotation)
        replayed, fresh = x[:, 6:7], x[:, 6:7]
        for i, layer in enumerate(layers):
            replayed = layer._compute(replayed, static, i)  # what a replay runs: no host checks
        for layer in layers:
            fresh = layer(fresh, new)
    assert torch.equal(replayed, fresh)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_lean_form_where_bf16_matmuls_are_native(kind, monkeypatch):
    """What a GPU (or an AMX CPU) runs: bf16 storage and matmuls, rope in fp32, softmax of bf16 scores."""
    monkeypatch.setitem(common._CPU_FAST, torch.bfloat16, True)
    x = randn(3, 7, CFG.hidden_size, seed=10).bfloat16()
    got, lean, want, layers = lean_and_general(kind, torch.bfloat16, x, 6)
    assert lean is not None and lean.bias.dtype == torch.bfloat16
    assert got.dtype == torch.bfloat16
    assert_close("bf16 lean vs general", got.float(), want.float(), rtol=2e-2)
    ref = x.double()
    for layer in layers:
        ref = naive_mla(layer, ref)
    assert_close("bf16 lean vs fp64", got.float(), ref[:, -1:].float(), rtol=2e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_under_grad_mode_a_backward_must_come_before_the_cache_is_written_again(kind):
    """The lean form saves views of the cache (contiguous) or of a per-layer workspace (paged) for its
    backward: a backward after a later step wrote them is refused by autograd, never silently stale;
    `short_decode = False` (the general path, gathered copies) is there for the paged cache."""
    layers = stack()
    cache = make_cache(kind)
    x = randn(3, 7, CFG.hidden_size, seed=13)
    with torch.no_grad():
        step(layers, cache, x[:, :5])
    first, _ = step(layers, cache, x[:, 5:6])
    first.sum().backward()  # before the next step: fine
    first, _ = step(layers, cache, x[:, 6:7])
    step(layers, cache, x[:, 6:7] * 0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        first.sum().backward()
    if kind == "contiguous":  # a user's write through the public views is seen too
        cache.lengths[:] = 6
        first, _ = step(layers, cache, x[:, 6:7])
        with torch.no_grad():
            cache.c_kv[0, :2] = 7.0
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            first.sum().backward()
    if kind == "paged":
        for layer in layers:
            layer.short_decode = False
        first, lean = step(layers, cache, x[:, 6:7])
        step(layers, cache, x[:, 6:7] * 0)
        first.sum().backward()  # the general path gathered copies
        assert lean is not None and layers[0].short_decode is False


@pytest.mark.parametrize("kind", KINDS)
def test_an_optimizer_loop_over_planned_decode_steps_follows_the_general_path(kind):
    """step → backward → Adam step, four times: the kept weight views survive in-place updates."""
    trajectories = []
    for short in (True, False):
        layers = stack()
        for layer in layers:
            layer.short_decode = short
        opt = torch.optim.Adam([p for layer in layers for p in layer.parameters()], lr=1e-2)
        cache = make_cache(kind)
        x = randn(3, 9, CFG.hidden_size, seed=14)
        with torch.no_grad():
            step(layers, cache, x[:, :5])
        for t in range(5, 9):
            opt.zero_grad()
            out, _ = step(layers, cache, x[:, t : t + 1])
            (out**2).mean().backward()
            opt.step()
        trajectories.append([p.detach().clone() for layer in layers for p in layer.parameters()])
    for a, b in zip(*trajectories, strict=True):
        assert_close("parameters after 4 Adam steps", a, b, rtol=1e-5)


def test_frozen_weights_under_grad_mode_record_nothing_and_share_one_paged_workspace():
    layers = stack()
    for layer in layers:
        layer.requires_grad_(False)
    cache = make_cache("paged")
    x = randn(3, 6, CFG.hidden_size, seed=15)
    with torch.no_grad():
        step(layers, cache, x[:, :5])
    out, lean = step(layers, cache, x[:, 5:])
    assert lean is not None and not out.requires_grad
    lean_entries = [entry for key, entry in cache._views.items() if key[0] == "lean"]
    workspaces = {id(ws) for entry in lean_entries for ws, _, _ in entry}
    assert len(workspaces) == 1, "one gather workspace for every layer when nothing is recorded"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_cache_and_layers_copied_after_lean_calls_keep_decoding_exactly(kind, how):
    import copy
    import pickle

    layers = stack()
    cache = make_cache(kind)
    x = randn(3, 8, CFG.hidden_size, seed=16)
    with torch.no_grad():
        step(layers, cache, x[:, :5])
        step(layers, cache, x[:, 5:6])  # kept views and workspaces exist now
        dup = (
            pickle.loads(pickle.dumps((layers, cache))) if how == "pickle" else copy.deepcopy((layers, cache))
        )
        for t in (6, 7):
            want, _ = step(layers, cache, x[:, t : t + 1])
            got, lean = step(dup[0], dup[1], x[:, t : t + 1])
            assert lean is not None
            assert torch.equal(got, want), f"{how} step {t}"
    for a, b in zip(cache.buffers(), dup[1].buffers(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_bucket_false_attends_over_exactly_the_longest_context(kind):
    layers = stack()
    cache, ref = make_cache(kind), make_cache(kind)
    x = randn(3, 19, CFG.hidden_size, seed=17)
    with torch.no_grad():
        for c in (cache, ref):
            step(layers, c, x[:, :17])
        exact = cache.plan(1, mode="absorb", bucket=False)
        assert exact.key_len == 18 and exact.lean is not None
        bucketed = ref.plan(1, mode="absorb")
        assert bucketed.key_len == 32
        a, b = x[:, 17:18], x[:, 17:18]
        for layer in layers:
            a, b = layer(a, exact), layer(b, bucketed)
    assert_close("exact keys vs the bucket", a, b, rtol=1e-5)

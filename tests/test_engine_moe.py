"""The engine's GroupedMoE against transformers' own MoE block of every served family.

Blocks are built from each family's config at small widths (random weights, the router's correction
bias drawn so sigmoid routing is not all ties); the grouped block holds the very same modules. fp32:
equal to transformers' block (its "eager" expert loop and its default "grouped_mm") within 1e-5 on
the family's own routing (V2: softmax + greedy / group-limited greedy; V3, V3.2, GLM-5, GLM-4.7-Flash:
sigmoid + bias, group-limited, `norm_topk_prob` on and off, `routed_scaling_factor`), and on forced
routings: every token on one expert, experts nobody picks, the same expert twice in one token's
top-k, many tokens sharing experts, router ties. bf16: both implementations against an fp64
reference on the same routing; the documented bound is BF16_BOUND relative to the output's largest
magnitude, and the grouped rms error is within 1.25x transformers' lowest. Engine: greedy tokens equal
transformers' generate() of each prompt alone for every served family with the grouped MoE installed,
and with transformers' blocks put back (install_moe(model, impl="transformers"))."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from mlakit.engine import packed as packed_mod  # noqa: E402
from mlakit.engine.moe import MOE_BLOCKS, NOAUX_ROUTERS, GroupedMoE, install_moe, route  # noqa: E402
from mlakit.engine.packed import packs  # noqa: E402

# family -> (config class, module, MoE block class)
BLOCKS = {
    "deepseek-v2": ("DeepseekV2Config", "deepseek_v2.modeling_deepseek_v2", "DeepseekV2Moe"),
    "deepseek-v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
    "deepseek-v3.2": ("DeepseekV32Config", "deepseek_v32.modeling_deepseek_v32", "DeepseekV32MoE"),
    "glm-moe-dsa": ("GlmMoeDsaConfig", "glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaMoE"),
    "glm-4.7-flash": ("Glm4MoeLiteConfig", "glm4_moe_lite.modeling_glm4_moe_lite", "Glm4MoeLiteMoE"),
}
WIDTHS = dict(hidden_size=64, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3)
# routings: V2's two top-k methods; the sigmoid families with 4 groups of 2 (2 kept), with and
# without normalization, and with one group
ROUTINGS = {
    "deepseek-v2": [
        dict(topk_method="greedy", routed_scaling_factor=1.0),
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0),
    ],
    "sigmoid": [
        dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
        dict(n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0),
        dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8),
    ],
}
CASES = [
    (f, i) for f in BLOCKS for i in range(len(ROUTINGS["deepseek-v2" if f == "deepseek-v2" else "sigmoid"]))
]
TOL = 1e-5
# bf16: max |out - fp64 reference| / max |reference| of the grouped block (measured 6e-3 to 8.4e-3, rms
# 4.2e-3 to 4.6e-3, transformers' eager / grouped_mm 4.4e-3 to 5.1e-3 rms: bf16 GEMM outputs, routed +
# shared accumulated in fp32, rounded once); the errors of all three are printed
BF16_BOUND = 1.6e-2


def make_block(family: str, routing: dict, shared: int = 1, seed: int = 0, dtype=torch.float32):
    config_cls, module, block_cls = BLOCKS[family]
    kw = dict(WIDTHS, n_shared_experts=shared, num_hidden_layers=2, **routing)
    config = getattr(transformers, config_cls)(**kw)
    config._experts_implementation = "eager"
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), block_cls)
    torch.manual_seed(seed)
    block = cls(config)
    with torch.no_grad():
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            t.normal_(0.0, 0.3 if name.endswith("e_score_correction_bias") else 0.15)
    return block.to(dtype).eval()


def routing_of(family: str, index: int) -> dict:
    return ROUTINGS["deepseek-v2" if family == "deepseek-v2" else "sigmoid"][index]


class ForcedRouter(nn.Module):
    """A router slot returning the given (weights, indices) whatever the hidden states."""

    def __init__(self, weights: torch.Tensor, index: torch.Tensor):
        super().__init__()
        self.w, self.i = weights, index

    def forward(self, hidden_states):
        return None, self.w, self.i


def transformers_out(block, x, impl: str):
    block.config._experts_implementation = impl
    try:
        with torch.no_grad():
            return block(x)
    finally:
        block.config._experts_implementation = "eager"


def grouped_out(block, x):
    with torch.no_grad():
        return GroupedMoE(block)(x)


@pytest.mark.parametrize("family,routing", CASES)
def test_family_routing_equals_transformers(family, routing):
    block = make_block(family, routing_of(family, routing))
    x = torch.randn(2, 29, WIDTHS["hidden_size"])
    got = grouped_out(block, x)
    assert got.shape == x.shape and got.dtype == x.dtype
    # the routing really spreads: several experts hit, not all tokens on the same pair
    _, _, idx = block.gate(x.view(-1, x.shape[-1]))
    assert len(idx.unique()) >= 4
    for impl in ("eager", "grouped_mm"):
        want = transformers_out(block, x, impl)
        err = (got - want).abs().max().item()
        assert err <= TOL * max(1.0, want.abs().max().item()), f"{family} vs {impl}: {err:.3g}"


@pytest.mark.parametrize("shared", [1, 2])
@pytest.mark.parametrize(
    "case", ["one_expert", "unpicked", "same_twice_in_row", "many_share", "single_token", "zero_weights"]
)
def test_forced_routing(case, shared):
    block = make_block("deepseek-v3", routing_of("deepseek-v3", 0), shared=shared)
    n, k, e = 23, WIDTHS["num_experts_per_tok"], WIDTHS["n_routed_experts"]
    g = torch.Generator().manual_seed(7)
    if case == "single_token":
        n = 1
    weights = torch.rand(n, k, generator=g) + 0.1
    if case == "one_expert":  # every token's slots on experts 5 (twice) and 2
        index = torch.tensor([5, 2, 5]).repeat(n, 1)
    elif case == "unpicked":  # experts 0, 3, 4, 7 never picked
        index = torch.tensor([1, 2, 5, 6])[torch.randint(0, 4, (n, k), generator=g)]
    elif case == "same_twice_in_row":  # token t picks expert t % 8 in two of its slots
        index = torch.stack([torch.arange(n) % e, torch.arange(n) % e, (torch.arange(n) + 3) % e], 1)
    elif case == "many_share":
        index = torch.randint(0, e, (n, k), generator=g)
        index[::2] = torch.tensor([0, 1, 2])
    elif case == "zero_weights":
        index = torch.randint(0, e, (n, k), generator=g)
        weights[:, 1:] = 0.0
    else:
        index = torch.tensor([[7, 0, 3]])
    block.gate = ForcedRouter(weights, index)
    x = torch.randn(1, n, WIDTHS["hidden_size"])
    got = grouped_out(block, x)
    want = transformers_out(block, x, "eager")
    err = (got - want).abs().max().item()
    assert err <= TOL * max(1.0, want.abs().max().item()), f"{case}: {err:.3g}"
    # the grouped block is not just its shared experts: drop a slot and the output changes
    block.gate = ForcedRouter(weights * torch.tensor([1.0, 0.0, 1.0]), index)
    assert (grouped_out(block, x) - got).abs().max() > 1e-4 or case == "zero_weights"


def test_router_ties():
    """A zero router: every score ties; both implementations see the router's own (same) choice."""
    block = make_block("deepseek-v3", routing_of("deepseek-v3", 0))
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.e_score_correction_bias.zero_()
    x = torch.randn(1, 17, WIDTHS["hidden_size"])
    got, want = grouped_out(block, x), transformers_out(block, x, "eager")
    assert (got - want).abs().max().item() <= TOL * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,routing", CASES)
def test_route_is_the_routers_own(family, routing, dtype):
    """`route` gives exactly the router's (weights, experts), its shortcut taken only where the group
    limit keeps every group; ties (a zero router) included."""
    block = make_block(family, routing_of(family, routing), dtype=dtype)
    gate = block.gate
    x = torch.randn(40, WIDTHS["hidden_size"]).to(dtype)
    for zero in (False, True):
        if zero:
            with torch.no_grad():
                gate.weight.zero_()
        with torch.no_grad():
            _, want_w, want_i = gate(x)
            got_w, got_i = route(gate, x)
        assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w)
    short = type(gate).__name__ in NOAUX_ROUTERS and gate.num_group == gate.topk_group
    assert short == (family != "deepseek-v2" and routing == 2)
    calls = []
    gate.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        route(gate, x)
    assert len(calls) == (0 if short else 1)


def test_route_checks_the_router_class_once_against_its_own_forward():
    """A router class of a known name that routes otherwise (another transformers version, say) keeps
    its own forward: `route` compares the short form with it once per class, on random rows."""
    block = make_block("deepseek-v3", routing_of("deepseek-v3", 2))  # n_group == topk_group
    real = type(block.gate)

    def forward(self, hidden_states):  # the same, but weights not normalized
        _, w, i = real.forward(self, hidden_states)
        return None, w * 2.0, i

    block.gate.__class__ = type(real.__name__, (real,), {"forward": forward})
    x = torch.randn(40, WIDTHS["hidden_size"])
    with torch.no_grad():
        _, want_w, want_i = block.gate(x)
        got_w, got_i = route(block.gate, x)
    assert torch.equal(got_w, want_w) and torch.equal(got_i, want_i)


@pytest.mark.parametrize("family", list(BLOCKS))
def test_bf16_bound(family):
    block = make_block(family, routing_of(family, 0), dtype=torch.bfloat16)
    x = torch.randn(1, 64, WIDTHS["hidden_size"]).to(torch.bfloat16)
    with torch.no_grad():
        _, w, i = block.gate(x.view(-1, x.shape[-1]))
    # fp64 reference on the bf16 run's routing (fp64 scores could break a near-tie differently)
    ref_block = copy.deepcopy(block).double()
    ref_block.gate = ForcedRouter(w.double(), i)
    ref = transformers_out(ref_block, x.double(), "eager")
    scale = ref.abs().max().item()
    errs = {}
    for impl in ("eager", "grouped_mm", "grouped"):
        out = grouped_out(block, x) if impl == "grouped" else transformers_out(block, x, impl)
        assert out.dtype == torch.bfloat16
        diff = out.double() - ref
        errs[impl] = (diff.abs().max().item() / scale, (diff.norm() / ref.norm()).item())
    shown = ", ".join(f"{k} {a:.2e} {b:.2e}" for k, (a, b) in errs.items())
    print(f"\n{family} bf16 max err / max|ref|, rms err / rms ref: {shown}")
    assert errs["grouped"][0] <= BF16_BOUND
    assert errs["grouped"][1] <= 1.25 * max(errs["eager"][1], errs["grouped_mm"][1])


def test_install_keeps_parameters_and_names():
    from support.engine import tiny_model

    model = tiny_model("deepseek-v3", num_hidden_layers=3)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    blocks = [type(m).__name__ for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"]
    assert install_moe(model) == len(blocks) == 2
    after = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert after == before  # same keys, same storage: nothing copied
    assert install_moe(model) == 2  # idempotent
    assert install_moe(model, impl="transformers") == 0
    assert sum(type(m).__name__ == "DeepseekV3MoE" for m in model.modules()) == 2
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert install_moe(tiny_model("minicpm3")) == 0  # dense family: nothing to replace


def test_refusals_change_nothing():
    from support.engine import tiny_model

    model = tiny_model("deepseek-v3", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"impl='fast'.*'grouped', 'transformers'"):
        install_moe(model, impl="fast")
    with pytest.raises(ValueError, match="model: expected a torch.nn.Module"):
        install_moe("demo")
    # a block whose experts carry biases is not what GroupedMoE computes: refused by name, nothing swapped
    model.model.layers[2].mlp.experts.has_bias = True
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp .*biases"):
        install_moe(model)
    assert not any(isinstance(m, GroupedMoE) for m in model.modules())


pytest.importorskip("xxhash")

from support.engine import FAMILIES, prompts, reference, tiny_model  # noqa: E402

from mlakit.engine import LLM, SamplingParams  # noqa: E402

NEW = 5


@pytest.mark.parametrize("impl", ["grouped", "transformers"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_greedy_equals_generate(family, impl):
    ps = prompts(6, [1, 9, 70, 33, 120, 4], seed=5, shared=30)
    want = reference(tiny_model(family), ps, NEW)
    llm = LLM(tiny_model(family), num_blocks=40, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    model = llm.llm_engine.runner.model
    installed = sum(isinstance(m, GroupedMoE) for m in model.modules())  # the runner installs it
    assert installed == (0 if family == "minicpm3" else 1)  # tiny models: layer 0 dense, layer 1 MoE
    assert install_moe(model, impl=impl) == (installed if impl == "grouped" else 0)
    left = sum(type(m).__name__ in MOE_BLOCKS for m in model.modules())
    assert left == (installed if impl == "transformers" else 0)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate(ps, params, use_tqdm=False)
    for i, (out, (tokens, lps)) in enumerate(zip(outs, want, strict=True)):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {i} ({len(ps[i])} tokens): {got.token_ids} != {tokens}"
        for step, (entry, lp) in enumerate(zip(got.logprobs, lps, strict=True)):
            assert abs(entry[got.token_ids[step]] - lp) <= 1e-4, f"prompt {i} step {step}"
    llm.llm_engine.check()


def test_packed_bf16_experts(monkeypatch):
    """bf16 experts prepacked for oneDNN: the same products (within the bf16 bound of the unpacked
    grouped block, measured identical), repacked when the weights change in place; fp32 packs only
    where the fp32 probe finds a gain (here: told it finds none)."""
    monkeypatch.setattr(packed_mod, "_FP32", [False])
    block = make_block("deepseek-v3", routing_of("deepseek-v3", 0), dtype=torch.bfloat16)
    plain, packed = GroupedMoE(block), GroupedMoE(block)
    if not packed.pack():
        assert not packs(torch.bfloat16, "cpu")  # refused only where bf16 does not run natively
        pytest.skip("this CPU's oneDNN has no native bf16 (AVX2-only): bf16 experts stay plain")
    x = torch.randn(1, 40, WIDTHS["hidden_size"]).to(torch.bfloat16)
    with torch.no_grad():
        want = plain(x)
        scale = want.float().abs().max().item()
        assert (packed(x).float() - want.float()).abs().max().item() <= BF16_BOUND * scale
        block.experts.down_proj.mul_(-1.0)  # in place: the packed copy is stale, and rebuilt
        block.shared_experts.down_proj.weight.mul_(-1.0)
        assert (packed(x).float() + want.float()).abs().max().item() <= BF16_BOUND * scale
    assert not GroupedMoE(make_block("deepseek-v3", routing_of("deepseek-v3", 0))).pack()
    model = tiny_model("deepseek-v3")
    assert install_moe(model, pack=True) == 1  # fp32 model: nothing packed
    assert all(m.packed is None for m in model.modules() if isinstance(m, GroupedMoE))
    with pytest.raises(ValueError, match="pack='yes'"):
        install_moe(model, pack="yes")
    model = tiny_model("deepseek-v3").to(torch.bfloat16)
    install_moe(model)  # the default keeps one copy of the weights
    assert all(m.packed is None for m in model.modules() if isinstance(m, GroupedMoE))
    install_moe(model, pack=True)
    assert all(m.packed is not None for m in model.modules() if isinstance(m, GroupedMoE))


# (tokens, forced routing or None): a decode step's few rows, a prefill chunk's many, one expert for
# every token (the others unpicked), an expert picked by every row; one expert and the shared MLP over
# more rows than the op takes in one pass over a weight block (256: chunks of 256, 256 and 89 rows)
FUSED_CASES = {
    "rows-1": (1, None),
    "rows-5": (5, None),
    "rows-70": (70, None),
    "one-expert": (9, "one"),
    "rows-601": (601, "one"),
}


@pytest.mark.parametrize("case", list(FUSED_CASES), ids=list(FUSED_CASES))
@pytest.mark.parametrize("family", list(BLOCKS))
def test_fused_block_equals_the_unfused_one(family, case, monkeypatch):
    """Released packs in mlakit's layout run the block after routing as one op (`moe_experts`): the
    same bf16 products, gating and fp32 sums as the op-by-op path (the SiLU's exp differs in its last
    bits: at most one bf16 rounding apart), and within the bf16 bound of fp64."""
    from mlakit.ops.vnni import vnni_packs

    if not vnni_packs():
        pytest.skip("no packed layout of mlakit's on this CPU: the op-by-op path runs")
    tokens, forced = FUSED_CASES[case]
    block = make_block(family, routing_of(family, 0), dtype=torch.bfloat16)
    x = torch.randn(1, tokens, WIDTHS["hidden_size"]).to(torch.bfloat16)
    with torch.no_grad():
        _, w, i = block.gate(x.view(-1, x.shape[-1]))
    if forced == "one":
        i = torch.full_like(i, 5)
        i[:, 1:] = torch.arange(
            1, i.shape[1]
        )  # expert 5 first for all, then 1, 2, ...: 0, 3, 4, 6, 7 unpicked
    block.gate = ForcedRouter(w, i)
    fused, unfused = GroupedMoE(copy.deepcopy(block)), GroupedMoE(copy.deepcopy(block))
    assert fused.pack(release=True) and unfused.pack(release=True)
    calls, run = [], GroupedMoE._fused_experts
    monkeypatch.setattr(GroupedMoE, "_fused_experts", lambda self, *a: calls.append(1) or run(self, *a))
    with torch.no_grad():
        got = fused(x)
        monkeypatch.setattr(GroupedMoE, "_fused", lambda self, packed, x: False)
        want = unfused(x)
    assert calls, "the fused op did not run"
    ref_block = copy.deepcopy(block).double()
    ref_block.gate = ForcedRouter(w.double(), i)
    ref = transformers_out(ref_block, x.double(), "eager")
    scale = ref.abs().max().item()
    assert (got.double() - want.double()).abs().max().item() <= 2**-7 * scale
    assert (got.double() - ref).abs().max().item() <= BF16_BOUND * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traceable_for_compile(dtype):
    """Under torch.compile(fullgraph=True) the block takes its sync-free path (offsets as a tensor,
    transformers' opaque grouped-mm op): no graph break, the same output as eager."""
    block = make_block("glm-4.7-flash", routing_of("glm-4.7-flash", 0), dtype=dtype)
    grouped = GroupedMoE(block)
    grouped.pack()
    x = torch.randn(1, 21, WIDTHS["hidden_size"]).to(dtype)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = grouped(x)
            got = torch.compile(grouped, backend="eager", fullgraph=True, dynamic=False)(x)
    finally:
        torch._dynamo.reset()
    tol = TOL if dtype == torch.float32 else BF16_BOUND
    assert (got.float() - want.float()).abs().max().item() <= tol * max(1.0, want.float().abs().max().item())

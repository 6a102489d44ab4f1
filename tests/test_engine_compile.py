"""The engine's compiled step (mlakit/engine/compiled.py, warmup.py) on tiny fp32 models of every family:
greedy tokens of compiled steps equal transformers' generate() of each prompt alone (dynamo's
"aot_eager" backend for every family, inductor for one), eager steps likewise, the step mode in
`stats`, `enforce_eager` refused before anything changes, the measured verdict that None reads, and
the fallback to eager steps (one warning) where compiling is unavailable or fails."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("xxhash")

from support.engine import FAMILIES, prompts, reference, tiny_model  # noqa: E402

from mlakit.cli import build_parser  # noqa: E402
from mlakit.engine import LLM, SamplingParams, compiled, warmup  # noqa: E402

LENGTHS = [9, 40, 3, 17]
NEW = 5
ENGINE = dict(num_blocks=40, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Verdicts in a fresh folder; dynamo's aot_eager backend unless a test says otherwise."""
    monkeypatch.setenv("MLAKIT_STEP_MODES", str(tmp_path / "step_modes.json"))
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


def check_tokens(llm, family, ps):
    want = reference(tiny_model(family), ps, NEW)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    for i, (out, (tokens, _)) in enumerate(zip(outs, want, strict=True)):
        assert out.outputs[0].token_ids == tokens, f"prompt {i} ({len(ps[i])} tokens)"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_greedy_equals_generate(family):
    llm = LLM(tiny_model(family), **ENGINE, enforce_eager=False)
    stats = llm.llm_engine.stats
    assert stats.compiled_buckets == ("1", "2-16", "17-64") and stats.compile_seconds > 0
    ps = prompts(4, LENGTHS, seed=5)
    check_tokens(llm, family, ps)  # a 64-token budget chunk, then 4-row and 1-row decode steps
    assert llm.llm_engine.stats.step_mode == "compiled" and llm.llm_engine.stats.compiled_steps >= NEW
    check_tokens(llm, family, ps[2:3])  # one sequence: 3 tokens, then 1-token steps
    assert llm.llm_engine.stats.step_mode == "compiled"
    llm.llm_engine.check()


def test_inductor_greedy_equals_generate(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    monkeypatch.setattr(compiled, "BUCKETS", ((2, 64),))  # one graph: 1-token steps run eager
    llm = LLM(tiny_model("deepseek-v3"), **ENGINE, enforce_eager=False)
    assert llm.llm_engine.stats.compiled_buckets == ("2-64",)
    check_tokens(llm, "deepseek-v3", prompts(4, LENGTHS, seed=6))
    assert llm.llm_engine.stats.compiled_steps > 0


def test_eager_steps():
    llm = LLM(tiny_model("minicpm3"), **ENGINE, enforce_eager=True)
    stats = llm.llm_engine.stats
    assert (stats.step_mode, stats.compile_seconds, stats.compiled_buckets) == ("eager", 0.0, ())
    check_tokens(llm, "minicpm3", prompts(4, LENGTHS, seed=7))
    assert llm.llm_engine.stats.step_mode == "eager" and llm.llm_engine.stats.compiled_steps == 0


@pytest.mark.parametrize(
    "margin, want", [(float("inf"), ("1", "2-16", "17-64")), (0.0, ())], ids=["pays", "not"]
)
def test_default_reads_the_measured_verdict(monkeypatch, margin, want):
    # no measurement on this machine yet: eager, nothing compiled
    assert LLM(tiny_model("deepseek-v2"), **ENGINE).llm_engine.stats.compiled_buckets == ()
    monkeypatch.setattr(warmup, "KEEP_MARGIN", margin)  # every bucket measured to pay / none
    LLM(tiny_model("deepseek-v2"), **ENGINE, enforce_eager=False)
    llm = LLM(tiny_model("deepseek-v2"), **ENGINE)
    stats = llm.llm_engine.stats
    assert stats.compiled_buckets == want
    assert stats.step_mode == ("compiled" if want else "eager")
    # a different thread count, dtype or model is another measurement
    other = LLM(tiny_model("deepseek-v2", num_hidden_layers=3), **ENGINE)
    assert other.llm_engine.stats.compiled_buckets == ()


@pytest.mark.parametrize("value", ["yes", 1, 0, 1.5], ids=["str", "one", "zero", "float"])
def test_enforce_eager_refused_before_any_change(value):
    model = tiny_model("deepseek-v3")
    before = type(model.model.layers[0].self_attn).__name__
    with pytest.raises(ValueError, match=rf"enforce_eager must be None, True or False, got {value!r}"):
        LLM(model, **ENGINE, enforce_eager=value)
    assert type(model.model.layers[0].self_attn).__name__ == before


def test_fallback_without_a_compiler(monkeypatch, capsys):
    monkeypatch.setattr(compiled, "available", lambda: "no C++ compiler for inductor (test)")
    llm = LLM(tiny_model("glm-4.7-flash"), **ENGINE, enforce_eager=False)
    err = capsys.readouterr().err
    assert "compiled step unavailable (no C++ compiler for inductor (test)); running eager steps" in err
    assert llm.llm_engine.stats.step_mode == "eager" and llm.llm_engine.stats.compiled_buckets == ()
    check_tokens(llm, "glm-4.7-flash", prompts(2, LENGTHS, seed=8))


def test_fallback_when_compiling_fails(monkeypatch, capsys):
    def broken(gm, example_inputs):
        raise RuntimeError("the compiler broke")

    monkeypatch.setattr(compiled, "BACKEND", broken)
    llm = LLM(tiny_model("deepseek-v3.2"), **ENGINE, enforce_eager=False)
    err = capsys.readouterr().err
    assert "compiled step unavailable" in err and "the compiler broke" in err
    eng = llm.llm_engine
    assert eng.stats.step_mode == "eager" and not eng.requests and eng.kv.pool.num_used == 0
    check_tokens(llm, "deepseek-v3.2", prompts(2, LENGTHS, seed=9))
    assert eng.stats.prompt_tokens == 9 + 40  # the warm-up left no trace in the counters


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_step_mode_flags(command, capsys):
    parser = build_parser()
    extra = ["--prompt", "hi"] if command == "generate" else []
    for flags, want in (([], None), (["--enforce-eager"], True), (["--compile"], False)):
        assert parser.parse_args([command, *extra, *flags]).enforce_eager is want
    with pytest.raises(SystemExit):
        parser.parse_args([command, *extra, "--enforce-eager", "--compile"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_eager_call_returns_what_its_fake_promises():
    """The opaque op's result is contiguous, as its fake says, whatever layout the module returns (the
    bf16 upcast product of mlakit.linear is a transposed view: inductor's stride check refused it)."""
    import torch
    from torch import nn

    class Transposed(nn.Module):
        def eager(self, x):
            return (x @ torch.ones(x.shape[-1], 5)).t().contiguous().t()  # [N, 5], strides (1, N)

    module = Transposed()
    key = compiled.register(module)
    x = torch.randn(7, 3)
    assert not module.eager(x).is_contiguous()
    out = torch.ops.mlakit.eager_call([x], key, 5)
    assert out.is_contiguous() and torch.equal(out, module.eager(x))

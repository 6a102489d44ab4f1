"""A patched transformers model under torch.compile(fullgraph=True) and torch.export, against the
unpatched model run eagerly (the oracle); tiny, random, fp32, CPU, dynamo's "eager" backend for speed."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.common import tiny_config  # noqa: E402
from test_hf import PAD, assert_close, prompts, tiny_model  # noqa: E402
from torch._dynamo.testing import CompileCounter  # noqa: E402
from transformers import CompileConfig, DynamicCache, StaticCache  # noqa: E402

import mlakit.hf as mhf  # noqa: E402
from mlakit.config import MLAConfig  # noqa: E402
from mlakit.dispatch import choose  # noqa: E402
from mlakit.hf.traced import traced_mode  # noqa: E402

FAMILIES = ["deepseek-v3", "minicpm3"]
ALL_FAMILIES = ["deepseek-v3", "deepseek-v2-lite", "glm4-moe-lite", "minicpm3"]
MAX_CACHE = 24
DECODE_STEPS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no graph of another test may be reused or counted."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pair(name: str, attn: str = "sdpa", mode: str = "auto"):
    """(unpatched, patched) copies of the same random model."""
    return tiny_model(name, attn=attn), mhf.patch(tiny_model(name, attn=attn), mode=mode)


def grow(mask, width: int | None = None):
    """The next step's 2D mask (one more real column) and the new token's position ids [B,1]; the mask
    to pass is zero-padded to `width` columns (a static cache's length) so its shape never changes."""
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    positions = mask.cumsum(-1)[:, -1:] - 1
    passed = mask if width is None else torch.nn.functional.pad(mask, (0, width - mask.shape[1]))
    return mask, passed, positions


def prefill(model, ids, mask, cache):
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, cache=cache)
    return out.logits[:, -1:].argmax(-1)  # [B, 1]


def decode(forward, model, ids, mask, cache_cls, steps: int):
    """Greedy steps through `forward` after an eager prefill; returns the logits of every step."""
    static = cache_cls is StaticCache
    cache = StaticCache(model.config, max_cache_len=MAX_CACHE) if static else DynamicCache()
    token, logits = prefill(model, ids, mask, cache), []
    for _ in range(steps):
        mask, passed, positions = grow(mask, MAX_CACHE if static else None)
        with torch.no_grad():
            out = forward(token, attention_mask=passed, position_ids=positions, cache=cache)
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits)  # [steps, B, V]


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v2-lite", "tiny"])
@pytest.mark.parametrize("new, cached", [(1, 0), (1, 4096), (7, 40), (26, 3), (200, 8), (512, 512)], ids=str)
def test_traced_mode_is_choose(preset, new, cached):
    cfg = tiny_config() if preset == "tiny" else MLAConfig.preset(preset)
    assert traced_mode(cfg, new, cached) == choose(cfg, new, cached)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_static_decode_matches_unpatched(name):
    plain, patched = pair(name)
    ids, mask = prompts()
    counter = CompileCounter()
    compiled = torch.compile(patched.forward, fullgraph=True, backend=counter)
    want = decode(plain.forward, plain, ids, mask, StaticCache, DECODE_STEPS)
    got = decode(compiled, patched, ids, mask, StaticCache, DECODE_STEPS)
    assert_close(f"{name} compiled decode logits", got, want)
    assert counter.frame_count == 1  # a static cache keeps every shape: one graph for every step


@pytest.mark.slow
def test_compiled_dynamic_cache_prefill_and_decode():
    """One compiled forward serves a DynamicCache's prefill and decode steps; once dynamo has made the
    growing lengths symbolic (within the first steps), a step compiles nothing new."""
    plain, patched = pair("deepseek-v3")
    ids, mask = prompts()
    counter = CompileCounter()
    compiled = torch.compile(patched.forward, fullgraph=True, backend=counter)
    want = decode(plain.forward, plain, ids, mask, DynamicCache, DECODE_STEPS + 1)
    cache, logits, frames = DynamicCache(), [], []
    token = prefill(compiled, ids, mask, cache)
    for _ in range(DECODE_STEPS + 1):
        mask, _, positions = grow(mask)
        with torch.no_grad():
            out = compiled(token, attention_mask=mask, position_ids=positions, cache=cache)
        logits.append(out.logits[:, -1])
        frames.append(counter.frame_count)
        token = out.logits[:, -1:].argmax(-1)
    assert_close("compiled dynamic-cache decode logits", torch.stack(logits), want)
    assert frames[-1] == frames[-2], f"graphs compiled after each step: {frames}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_FAMILIES)
def test_decode_has_no_graph_break(name):
    _, patched = pair(name)
    ids, mask = prompts()
    cache = StaticCache(patched.config, max_cache_len=MAX_CACHE)
    token = prefill(patched, ids, mask, cache)
    _, mask, positions = grow(mask, MAX_CACHE)
    with torch.no_grad():
        report = torch._dynamo.explain(patched.forward)(
            token, attention_mask=mask, position_ids=positions, cache=cache
        )
    assert report.graph_break_count == 0, [str(r.reason)[:200] for r in report.break_reasons]
    assert report.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, attn, mode",
    [
        ("deepseek-v3", "sdpa", "auto"),
        ("deepseek-v3", "eager", "materialize"),
        ("minicpm3", "sdpa", "materialize"),
    ],
    ids=["v3-sdpa-auto", "v3-eager-materialize", "minicpm3-sdpa-materialize"],
)
def test_export_matches_unpatched(name, attn, mode):
    plain, patched = pair(name, attn=attn, mode=mode)
    ids, mask = prompts()
    kwargs = dict(attention_mask=mask, use_cache=False)
    with torch.no_grad():
        program = torch.export.export(patched, (ids,), kwargs=kwargs)
        want = plain(ids, **kwargs).logits
        got = program.module()(ids, **kwargs).logits
        eager = patched(ids, **kwargs).logits
    keep = mask.bool()  # padding queries attend to nothing: their logits are not compared
    assert_close(f"{name} exported logits", got[keep], want[keep])
    assert_close(f"{name} exported vs eager patched", got[keep], eager[keep])


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_generate_static_cache_compiled(name):
    plain, patched = pair(name)
    ids, mask = prompts()
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    want = plain.generate(ids, **common)
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told otherwise
    got = patched.generate(ids, cache_implementation="static", compile_config=config, **common)
    assert hasattr(patched, "_compiled_call"), "generate did not compile the forward"
    assert torch.equal(got, want)


@pytest.mark.slow
def test_bf16_forward_has_no_graph_break():
    """bf16 weights make the layer ask whether this CPU has native bf16 GEMMs: asked once, not traced."""
    _, patched = pair("deepseek-v3")
    patched.to(torch.bfloat16)
    ids, mask = prompts()
    with torch.no_grad():
        report = torch._dynamo.explain(patched.forward)(ids, attention_mask=mask, use_cache=False)
    assert report.graph_break_count == 0, [str(r.reason)[:200] for r in report.break_reasons]

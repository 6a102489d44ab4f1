"""A patched DSA model (DeepSeek-V3.2, GLM-MoE-DSA) under torch.compile(fullgraph=True) and torch.export,
against the unpatched model run eagerly: the traced route of `PatchedDSAAttention` reads nothing back
to the host (no `torch.equal` on the mask, no `int()` of a StaticCache's count). Tiny fp32 models past
index_topk, dynamo's "eager" backend for speed."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_compile import MAX_CACHE, decode, fresh_dynamo, grow, prefill  # noqa: E402, F401
from test_hf_dsa import one_thread, prompts, tiny_model  # noqa: E402, F401
from torch._dynamo.testing import CompileCounter  # noqa: E402
from transformers import StaticCache  # noqa: E402

import mlakit.hf as mhf  # noqa: E402

NAMES = ["v32-k8", "glm5-k12-shared"]


def assert_close(name, got, want, rel=1e-5):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rel * scale, f"{name}: max error {err:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_fullgraph_prefill_past_topk(name):
    plain, patched = tiny_model(name), mhf.patch(tiny_model(name))
    ids, mask = prompts((17, 13))  # 17 > k: the selection is live
    counter = CompileCounter()
    compiled = torch.compile(patched, fullgraph=True, backend=counter)
    with torch.no_grad():
        want = plain(ids, attention_mask=mask, use_cache=False).logits
        got = compiled(ids, attention_mask=mask, use_cache=False).logits
    keep = mask.bool()  # padding queries attend to nothing: their logits are not compared
    assert_close(f"{name} compiled prefill", got[keep], want[keep])
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", NAMES)
def test_fullgraph_static_cache_decode(name):
    """Prefill eagerly into a StaticCache past k, then compiled decode steps: one graph for all."""
    plain, patched = tiny_model(name), mhf.patch(tiny_model(name))
    ids, mask = prompts((15, 11))
    counter = CompileCounter()
    compiled = torch.compile(patched.forward, fullgraph=True, backend=counter)
    want = decode(plain.forward, plain, ids, mask, StaticCache, 3)
    got = decode(compiled, patched, ids, mask, StaticCache, 3)
    assert_close(f"{name} compiled static decode", got, want)
    assert counter.frame_count == 1


def test_export_matches_unpatched():
    plain, patched = tiny_model("v32-k8"), mhf.patch(tiny_model("v32-k8"))
    ids, mask = prompts((17, 12))
    kwargs = dict(attention_mask=mask, use_cache=False)
    with torch.no_grad():
        program = torch.export.export(patched, (ids,), kwargs=kwargs)
        want = plain(ids, **kwargs).logits
        got = program.module()(ids, **kwargs).logits
    keep = mask.bool()
    assert_close("exported logits", got[keep], want[keep])


class WithCache(torch.nn.Module):
    """A decode step over a StaticCache the module holds (how an exported decoder keeps its cache)."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, token, mask, positions):
        return self.model(token, attention_mask=mask, position_ids=positions, cache=self.cache).logits


def test_export_static_cache_decode_step():
    """No data-dependent op in the static-cache route (the count the cache holds is a tensor): the
    patched decode step exports like the unpatched one, and the two programs give the same logits."""
    token, positions = torch.tensor([[5]]), torch.tensor([[15]])
    mask = torch.nn.functional.pad(torch.ones(1, 16, dtype=torch.long), (0, MAX_CACHE - 16))
    logits = []
    for patch in (False, True):
        model = tiny_model("v32-k8")
        if patch:
            mhf.patch(model)
        ids, prompt_mask = prompts((15,))
        cache = StaticCache(model.config, max_cache_len=MAX_CACHE)
        with torch.no_grad():
            model(ids, attention_mask=prompt_mask, cache=cache)  # 15 > k: the step selects
            program = torch.export.export(WithCache(model, cache), (token, mask, positions), strict=False)
            logits.append(program.module()(token, mask, positions))
    assert_close("exported static-cache step, patched vs unpatched", logits[1], logits[0])

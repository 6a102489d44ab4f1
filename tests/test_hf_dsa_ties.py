"""A patched DSA model selects exactly what transformers selects, ties included.

Indexers small enough to tie: one index head, so a key whose dot product is negative scores exactly
0.0 after the ReLU and many keys tie at the k-th place; `torch.topk` keeps some of them, and the
patched model must keep the same ones. `MLAAttention` on its own keeps its documented rule (lowest
positions first, `mlakit.ops.sparse.select_topk`)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_dsa import PAD, TINY, greedy, one_thread  # noqa: E402, F401

import mlakit.hf as mhf  # noqa: E402
from mlakit.hf.dsa import PatchedDSAAttention  # noqa: E402
from mlakit.hf.dsa_index import hf_index_topk  # noqa: E402
from mlakit.ops.sparse import select_topk  # noqa: E402

CLASSES = {"v32": "DeepseekV32", "glm5": "GlmMoeDsa"}


def tie_model(family: str, topk: int, seed: int, dtype=torch.float32):
    config = getattr(transformers, f"{CLASSES[family]}Config")(**dict(TINY, index_n_heads=1), index_topk=topk)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, f"{CLASSES[family]}ForCausalLM")(config).eval().to(dtype)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def their_selections(model, ids):
    """transformers' top-k of every indexer layer for one prefill (the indexer's own forward)."""
    got = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: got.append(out.long().sort(-1).values))
        for m in model.modules()
        if type(m).__name__.endswith("Indexer")
    ]
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    return logits, got


def our_selections(model, ids, monkeypatch):
    import mlakit.hf.dsa as dsa

    got = []

    def record(*args, **kwargs):
        out = hf_index_topk(*args, **kwargs)
        got.append(out.long().sort(-1).values)
        return out

    monkeypatch.setattr(dsa, "hf_index_topk", record)
    with torch.no_grad():
        logits = model(ids).logits
    monkeypatch.undo()
    return logits, got


def ties_at_kth(model, ids) -> int:
    """Query rows of the first indexer whose k-th score ties with an unselected visible key."""
    layer = next(m for m in model.modules() if type(m).__name__.endswith("Indexer"))
    scores = []
    original = torch.Tensor.topk

    def spy(self, k, *args, **kwargs):
        scores.append(self.detach().clone())
        return original(self, k, *args, **kwargs)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "topk", spy)
        layer(*layer_inputs(model, ids))
    rows = scores[0][0]  # [S, T]
    kth = rows.topk(layer.index_topk, dim=-1).values[:, -1:]
    return int(((rows == kth).sum(-1) > 1)[torch.isfinite(kth[:, 0])].sum())


def layer_inputs(model, ids):
    """The first indexer's inputs as the first decoder layer hands them (no cache)."""
    attn = model.model.layers[0].self_attn
    attn = attn.original if isinstance(attn, PatchedDSAAttention) else attn
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    positions = torch.arange(ids.shape[1])[None]
    n = ids.shape[1]
    mask = torch.zeros(1, n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    return x, q_resid, model.model.rotary_emb(x, positions), mask, positions


CASES = [("v32", 8, 40, 0), ("v32", 32, 72, 1), ("v32", 64, 90, 2), ("glm5", 16, 48, 3)]


@pytest.mark.parametrize("family, topk, n, seed", CASES, ids=[f"{c[0]}-k{c[1]}-T{c[2]}" for c in CASES])
def test_patched_selects_transformers_topk_ties_included(family, topk, n, seed, monkeypatch):
    model = tie_model(family, topk, seed)
    ids = torch.randint(4, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))
    assert ties_at_kth(model, ids) > 0, "the test needs ties at the k-th place"
    want_logits, want = their_selections(model, ids)
    want_tokens, _, _ = greedy(model, ids, torch.ones_like(ids), new_tokens=6)
    mhf.patch(model)
    got_logits, got = our_selections(model, ids, monkeypatch)
    assert len(got) == len(want) > 0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"layer {i}: selection differs in {(a != b).any(-1).sum()} queries"
    err = (got_logits - want_logits).abs().max().item()
    assert err <= 1e-5 * want_logits.abs().max().item(), f"prefill logits differ by {err:.3g}"
    got_tokens, _, _ = greedy(model, ids, torch.ones_like(ids), new_tokens=6)
    assert torch.equal(got_tokens, want_tokens)


def test_bf16_first_indexer_selects_as_transformers(monkeypatch):
    """bf16: the scores are transformers' (fp32 products of the bf16 q and k), so the first layer, whose
    inputs are identical, selects identically; later layers see bf16 attention that rounds differently
    (absorb vs expanded K/V), so only the gap is printed."""
    model = tie_model("v32", 8, 0, torch.bfloat16)
    ids = torch.randint(4, TINY["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    want_logits, want = their_selections(model, ids)
    mhf.patch(model)
    got_logits, got = our_selections(model, ids, monkeypatch)
    assert torch.equal(got[0], want[0])
    gap = (got_logits.float() - want_logits.float()).abs().max().item()
    print(f"bf16 prefill logit gap {gap:.3g} (scale {want_logits.float().abs().max().item():.3g})")


def test_hf_index_topk_is_their_indexer():
    """Against transformers' own indexer module on tie-heavy inputs: the same indices, in order."""
    model = tie_model("v32", 8, 4)
    ids = torch.randint(4, TINY["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(4))
    indexer = model.model.layers[0].self_attn.indexer
    x, q_resid, (cos, sin), mask, positions = layer_inputs(model, ids[:1])
    with torch.no_grad():
        want = indexer(x, q_resid, (cos, sin), mask, positions)
        q = indexer.wq_b(q_resid).view(1, 30, 1, -1)
        k = indexer.k_norm(indexer.wk(x)).unsqueeze(2)
        dr = model.config.qk_rope_head_dim
        rope = transformers.models.deepseek_v32.modeling_deepseek_v32.apply_rotary_pos_emb
        q_rot, k_rot = rope(q[..., :dr], k[..., :dr], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., dr:]], -1)
        k = torch.cat([k_rot, k[..., dr:]], -1).squeeze(2)
        got = hf_index_topk(indexer, q, k, x, mask, 8)
    assert torch.equal(got, want)


def test_mlakit_own_tie_rule_is_kept():
    """`select_topk` (MLAAttention's DSA) keeps the lowest positions among tied keys."""
    scores = torch.zeros(1, 1, 12)
    scores[0, 0, 9] = 1.0
    assert select_topk(scores, 4).tolist() == [[[0, 1, 2, 9]]]

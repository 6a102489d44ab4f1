"""PatchedDSAAttention: transformers' DeepseekV32Attention / GlmMoeDsaAttention on mlakit's sparse ops.

Like `PatchedMLAAttention` (same submodules, the model's own rope and cache), plus the layer's own
`indexer` (absent on GLM-5's "shared" layers, which reuse the previous layer's top-k). The indexer key
goes to transformers' indexer cache (`cache.update_indexer`) exactly as the original writes it. The
top-k is transformers' own (`mlakit.hf.dsa_index`: their scores, op for op, and `torch.topk`, so a
patched model selects what the unpatched one selects, ties included); the attention over the
selected latents is mlakit's (`mlakit.ops.sparse`), never expanding a latent per head. While every
query sees <= index_topk keys the attention is dense (absorb or materialize, as the base class
picks). Under torch.compile / torch.export or for a custom mask, transformers' mask is read at the
selected keys (`mlakit.hf.traced.sparse_absorb_masked`: k gathered latents per query); when the
weights are asked for, the selection joins the mask over all keys (the base class's masked route).
GLM's layer keeps its (out, weights, topk_indices) return.
"""

from __future__ import annotations

import torch

from mlakit.cost.sparse import choose_sparse
from mlakit.hf.attention import PatchedMLAAttention, cached_tokens, key_length
from mlakit.hf.dsa_index import hf_index_topk, with_selection
from mlakit.hf.traced import is_traced, sparse_absorb_masked
from mlakit.ops.sparse import sparse_absorb, sparse_materialize

# attention class name → its modeling module, and whether the indexer's rope is interleaved
DSA_ATTENTION = {
    "DeepseekV32Attention": ("transformers.models.deepseek_v32.modeling_deepseek_v32", False),
    "GlmMoeDsaAttention": ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", True),
}
DSA_MODELS = ("DeepseekV32ForCausalLM", "DeepseekV32Model", "GlmMoeDsaForCausalLM", "GlmMoeDsaModel")
SPARSE_RUNS = {"absorb": "sparse-absorb", "materialize": "sparse-materialize"}


def is_dsa_attention(module) -> bool:
    entry = DSA_ATTENTION.get(type(module).__name__)
    return entry is not None and type(module).__module__ == entry[0]


class PatchedDSAAttention(PatchedMLAAttention):
    """Drop-in for a DSA attention; `last_mode` is e.g. "sparse-absorb" once the context passes k."""

    @classmethod
    def family_of(cls, original) -> tuple[str, str]:
        return DSA_ATTENTION[type(original).__name__][0], "cos_sin"

    def __init__(self, original, mode: str = "auto"):
        super().__init__(original, mode)
        self.indexer = original.indexer  # None on a GLM "shared" layer
        self.index_topk = original.config.index_topk
        self.indexer_interleave = DSA_ATTENTION[type(original).__name__][1]
        self.returns_indices = type(original).__name__ == "GlmMoeDsaAttention"
        self.cfg = self.cfg.replace(
            index_n_heads=original.config.index_n_heads,
            index_head_dim=original.config.index_head_dim,
            index_topk=original.config.index_topk,
            indexer_rope_interleave=self.indexer_interleave,
        )

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        prev = kwargs.pop("prev_topk_indices", None)
        kwargs.pop("position_ids", None)
        self._check_call(position_embeddings, kwargs)
        if self.indexer is None and prev is None:
            raise ValueError("a shared DSA layer needs prev_topk_indices from a previous full indexer layer")
        batch, new, _ = hidden_states.shape
        lengths = (dsa_cached_tokens, dsa_key_length)
        past, total, context, key_mask = self._keys(cache, attention_mask, batch, new, kwargs, lengths)
        # every query sees <= k keys: dense attention (transformers' top-k then keeps every key); a
        # traced call decides from the static key count, an eager one from the tokens written
        sparse = (total if is_traced() else context + new) > self.index_topk
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q_nope, q_rot, c_kv, k_rot = self._project(hidden_states, position_embeddings, kwargs)
        q_idx = k_idx = None
        if self.indexer is not None:
            q_idx, k_idx = self._index_qk(hidden_states, q_resid if sparse else None, position_embeddings)
        if cache is not None:
            c_kv, k_rot = cache.update(c_kv, k_rot, self.layer_idx, kwargs=kwargs)
            if k_idx is not None:
                k_idx = cache.update_indexer(k_idx, self.layer_idx)
        c_kv, k_rot = c_kv[:, 0], k_rot[:, 0]
        mask = None
        if past is None or (sparse and self.indexer is not None):
            mask = self._full_mask(attention_mask, cache, batch, new, total, hidden_states.device)
        if not sparse:
            width = min(total, self.index_topk)  # their shape: every position a query may see
            topk = torch.arange(width, dtype=torch.int32, device=hidden_states.device).expand(
                batch, new, width
            )
        elif self.indexer is None:
            topk = prev
        else:
            topk = hf_index_topk(self.indexer, q_idx, k_idx, hidden_states, mask[:, 0], self.index_topk)
        weights = None
        if past is None and sparse and not self.wants_weights(kwargs):
            # the masked route over the k selected latents of each query, not all T
            args = (q_nope, q_rot, c_kv, k_rot, *self.up_weights(), self.scaling, mask, topk.long())
            run, out = "sparse-absorb", sparse_absorb_masked(*args)
        elif past is None:
            if sparse:  # the weights of all T keys: transformers' mask with the unselected hidden
                mask = with_selection(mask, topk, total, hidden_states.dtype)
            run, out, weights = self._attend_masked(q_nope, q_rot, c_kv, k_rot, mask, context, kwargs)
            run = SPARSE_RUNS[run] if sparse else run
        else:
            run, out = self._attend_plain(sparse, q_nope, q_rot, c_kv, k_rot, past, topk, key_mask)
        self.last_mode = run
        out = self.o_proj(out.reshape(batch, new, -1))
        return (out, weights, topk) if self.returns_indices else (out, weights)

    def _attend_plain(self, sparse: bool, q_nope, q_rot, c_kv, k_rot, past: int, topk, key_mask):
        """(path, out [B,S,H,dv]) from row lengths: the dense ops, or the sparse ops over topk."""
        batch, new = q_nope.shape[:2]
        kv_lens = torch.full((batch,), past + new, dtype=torch.long)
        args = (q_nope, q_rot, c_kv, k_rot, kv_lens)
        if not sparse:
            run = self._dense_run(new, past)
            return run, self._attend(run, *args, key_mask)
        run = choose_sparse(self.cfg, new, past) if self.mode == "auto" else SPARSE_RUNS[self.mode]
        op = sparse_absorb if run == "sparse-absorb" else sparse_materialize
        out, _ = op(*args, *self.up_weights(), self.scaling, indices=topk.long(), key_mask=key_mask)
        return run, out

    def _dense_run(self, new: int, past: int) -> str:
        from mlakit.dispatch import choose

        return choose(self.cfg, new, past) if self.mode == "auto" else self.mode

    def _rotate(self, q_rot, k_rot, position_embeddings):
        """MLA's rope of both DSA families: interleaved pairs (their configs have no switch)."""
        cos, sin = position_embeddings
        return self.rope_module.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)

    def _index_qk(self, hidden, q_resid, position_embeddings):
        """(q_I [B,S,H_I,d_I] or None without q_resid, k_I [B,S,d_I]) rotated in the indexer's layout,
        as their indexer rotates them (k_I is what their indexer cache holds)."""
        ix, dr = self.indexer, self.cfg.qk_rope_head_dim
        batch, new, _ = hidden.shape
        k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)  # [B, S, 1, d_I]
        q = k if q_resid is None else ix.wq_b(q_resid).view(batch, new, ix.n_heads, ix.head_dim)
        cos, sin = position_embeddings
        m = self.rope_module
        rope = m.apply_rotary_pos_emb_interleave if self.indexer_interleave else m.apply_rotary_pos_emb
        q_rot, k_rot = rope(q[..., :dr], k[..., :dr], cos, sin, unsqueeze_dim=2)
        k = torch.cat([k_rot, k[..., dr:]], dim=-1).squeeze(2)
        return (None if q_resid is None else torch.cat([q_rot, q[..., dr:]], dim=-1)), k


def dsa_cached_tokens(cache, layer_idx: int, new: int) -> tuple[int, int]:
    """`cached_tokens` for transformers' indexed cache layers (DynamicIndexedLayer, StaticIndexedLayer)."""
    if cache is None:
        return 0, new
    from transformers.cache_utils import DynamicIndexedLayer, StaticIndexedLayer

    layers = getattr(cache, "layers", [])
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    if type(layer) is DynamicIndexedLayer:
        past = layer.get_seq_length()
        return past, past + new
    if type(layer) is StaticIndexedLayer:
        past = int(layer.get_seq_length())
        if past + new > layer.max_cache_len:
            raise ValueError(
                f"static cache layer {layer_idx} holds {past} of {layer.max_cache_len} tokens; "
                f"{new} more do not fit"
            )
        return past, layer.max_cache_len
    return cached_tokens(cache, layer_idx, new)


def dsa_key_length(cache, layer_idx: int, new: int) -> tuple[int, int | None]:
    """`key_length` for transformers' indexed cache layers: sizes and types only, nothing read from a
    tensor (under torch.compile / torch.export)."""
    if cache is None:
        return new, 0
    from transformers.cache_utils import DynamicIndexedLayer, StaticIndexedLayer

    layers = getattr(cache, "layers", [])
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    if type(layer) is DynamicIndexedLayer:
        return layer.get_seq_length() + new, None
    if type(layer) is StaticIndexedLayer:
        return layer.max_cache_len, layer.max_cache_len
    return key_length(cache, layer_idx, new)

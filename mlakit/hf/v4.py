"""PatchedV4Attention: transformers' DeepseekV4Attention served by mlakit's V4Attention.

The patched layer shares the original's parameters (no copy) and keeps its compressed state in a
`V4Cache` attached to transformers' own cache layer (`cache.layers[i]`), whose length bookkeeping it
advances as the original would, so `DynamicCache`, `generate` and the model's masks keep working.
Beam search follows: the layer's reorder_cache (and batch_select_indices / batch_repeat_interleave)
reorder the V4Cache too. One sequence per row, no padding (transformers' compressors pool left padding
into the first entries, so padded batches differ from their rows alone there too).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from mlakit.v4.attention import V4Attention
from mlakit.v4.cache import V4Cache
from mlakit.v4.config import V4Config

V4_ATTENTION = {"DeepseekV4Attention": "transformers.models.deepseek_v4.modeling_deepseek_v4"}
_STATE = "_mlakit_v4"  # attribute of transformers' cache layer holding mlakit's V4Cache


def is_v4_attention(module) -> bool:
    path = V4_ATTENTION.get(type(module).__name__)
    return path is not None and type(module).__module__ == path


def _share(ours: nn.Module, original: nn.Module) -> None:
    """Point every parameter of `ours` at the original's parameter of the same name."""
    theirs = dict(original.named_parameters())
    for name, p in list(ours.named_parameters()):
        if name not in theirs or theirs[name].shape != p.shape:
            raise ValueError(f"{type(original).__name__} has no parameter {name} of shape {tuple(p.shape)}")
        parent = ours.get_submodule(name.rpartition(".")[0]) if "." in name else ours
        setattr(parent, name.rpartition(".")[2], theirs[name])


class PatchedV4Attention(nn.Module):
    """Drop-in for DeepseekV4Attention; `original` is kept (outside the module tree) for unpatch."""

    def __init__(self, original: nn.Module, mode: str = "auto"):
        super().__init__()
        self.__dict__["original"] = original
        self.mode = mode
        self.layer_idx = original.layer_idx
        self.cfg = V4Config.from_hf(original.config)
        self.v4 = V4Attention(self.cfg, layer_idx=original.layer_idx)
        _share(self.v4, original)
        self.v4.to(device=original.q_a_proj.weight.device)

    def forward(
        self,
        hidden_states,
        position_embeddings=None,
        position_ids=None,
        attention_mask=None,
        cache=None,
        **kwargs,
    ):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if kwargs.get("output_attentions"):
            raise ValueError(
                "output_attentions=True: mlakit never forms the attention weights (unpatch first)"
            )
        _refuse_padding(attention_mask, hidden_states.shape[1])
        if cache is None:
            return self.v4(hidden_states), None
        layer = cache.layers[self.layer_idx]
        state = self._state(layer, hidden_states)
        b, s, _ = hidden_states.shape
        state.grow(_capacity(int(state.lengths[0]) + s, state.max_seq_len))
        plan = state.plan(s)
        out = self.v4(hidden_states, plan)
        state.commit(plan)
        # transformers' layer keeps counting tokens (masks and get_seq_length read it); its keys are unused
        layer.update(hidden_states.new_zeros(b, 1, s, 1), hidden_states.new_zeros(b, 1, s, 1))
        return out, None

    def _state(self, layer, hidden) -> V4Cache:
        state = getattr(layer, _STATE, None)
        seen = layer.get_seq_length()
        if seen == 0:  # a new or reset cache layer
            state = None
        if state is None:
            if seen:
                raise ValueError(
                    f"layer {self.layer_idx}'s cache holds {seen} tokens mlakit did not see; patch before "
                    "the first forward of a cache"
                )
            state = V4Cache(
                self.cfg,
                hidden.shape[0],
                _capacity(hidden.shape[1], 0),
                dtype=hidden.dtype,
                device=hidden.device,
                layers=[self.layer_idx],
            )
            setattr(layer, _STATE, state)
            _follow(layer)
        elif int(state.lengths[0]) != seen or state.batch_size != hidden.shape[0]:
            raise ValueError(
                f"layer {self.layer_idx}: the cache was changed outside mlakit (cropped or "
                f"reset: {seen} tokens, mlakit holds {int(state.lengths[0])}); use a fresh cache"
            )
        return state


def _follow(layer) -> None:
    """Make transformers' batch edits of `layer` (beam search's reorder_cache, batch_select_indices,
    batch_repeat_interleave) move mlakit's V4Cache too: each is checked by V4Cache.reorder first, so a
    bad index is refused before either side changes. Bound per instance (deepcopy keeps them)."""
    for name, fn in _FOLLOWED.items():
        if not hasattr(type(layer), name):
            continue
        bound = getattr(layer, name)
        if getattr(bound, "__func__", None) is not fn:
            setattr(layer, name, types.MethodType(fn, layer))


def _reorder_state(layer, index) -> None:
    state = getattr(layer, _STATE, None)
    if state is not None and layer.get_seq_length() > 0:
        state.reorder(index)


def _reorder_cache(layer, beam_idx) -> None:
    _reorder_state(layer, beam_idx)
    type(layer).reorder_cache(layer, beam_idx)


def _batch_select_indices(layer, indices) -> None:
    index = torch.as_tensor(indices)
    if index.dtype == torch.bool:
        index = index.nonzero().flatten()
    _reorder_state(layer, index)
    type(layer).batch_select_indices(layer, indices)


def _batch_repeat_interleave(layer, repeats) -> None:
    state = getattr(layer, _STATE, None)
    if state is not None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
        _reorder_state(layer, torch.arange(state.batch_size).repeat_interleave(repeats))
    type(layer).batch_repeat_interleave(layer, repeats)


_FOLLOWED = {
    "reorder_cache": _reorder_cache,
    "batch_select_indices": _batch_select_indices,
    "batch_repeat_interleave": _batch_repeat_interleave,
}


def _refuse_padding(mask, new: int) -> None:
    """A padded token masks its own key: refuse (the compressors would pool it, as transformers' do)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] < new:
        return
    own = mask[:, 0, -new:, -new:].diagonal(dim1=-2, dim2=-1)  # [B, new]: each token's own key
    hidden = ~own if own.dtype == torch.bool else own < 0
    if bool(hidden.any()):
        raise ValueError(
            "padded rows are not supported by mlakit's DeepSeek-V4 attention (transformers' compressors "
            "pool padding into the first entries too): run one sequence per row, unpadded"
        )


def _capacity(needed: int, current: int) -> int:
    """Room for `needed` tokens: the current size, else the next power of two from 1,024."""
    if needed <= current:
        return current
    size = 1024
    while size < needed:
        size *= 2
    return size

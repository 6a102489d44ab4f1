"""Sampler: logits [M, V] of the rows that sample -> one token each (and log-probabilities when asked).

Greedy rows take the argmax. Sampled rows: temperature, top-k, top-p, min-p, then the exponential race
(argmax of p / q with q ~ Exp(1), which draws from p): a row with a seed draws its q from its own
generator, so its tokens do not depend on the other rows of the batch.
"""

from __future__ import annotations

import torch

from mlakit.engine.params import SamplingParams


def _filter(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits / temperature with the tokens top-k, top-p and min-p exclude set to -inf."""
    dev = x.device
    temp = torch.tensor([p.temperature for p in params], device=dev)
    x = x / temp[:, None]
    ks = [p.top_k if p.top_k > 0 else x.shape[-1] for p in params]
    if min(ks) < x.shape[-1]:
        k = torch.tensor(ks, device=dev).clamp(max=x.shape[-1])
        top = x.topk(int(k.max()), dim=-1).values
        kth = top.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p[:, None]  # the first token always stays
        x = x.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return x


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list, shared: torch.Generator
) -> tuple[list[int], list[dict[int, float] | None]]:
    """One token per row; `generators[i]`: row i's own generator (a seeded request) or None (`shared`)."""
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        probs = _filter(logits[idx], [params[i] for i in rows]).softmax(-1)
        q = torch.empty_like(probs)
        for j, i in enumerate(rows):
            q[j].exponential_(generator=generators[i] or shared)
        tokens[idx] = (probs / q).argmax(-1)
    chosen = tokens.tolist()
    return chosen, _logprobs(logits, params, chosen)


def _logprobs(logits, params, chosen) -> list[dict[int, float] | None]:
    """The chosen token's and the top-k log-probabilities of the model's distribution (raw logits)."""
    wanted = [p.logprobs for p in params]
    if all(k is None for k in wanted):
        return [None] * len(params)
    lp = logits.log_softmax(-1)
    k = min(max(k or 0 for k in wanted), logits.shape[-1])
    top = lp.topk(k, dim=-1) if k else None
    out = []
    for i, want in enumerate(wanted):
        if want is None:
            out.append(None)
            continue
        entry = {chosen[i]: float(lp[i, chosen[i]])}
        if want:
            for v, t in zip(top.values[i, :want].tolist(), top.indices[i, :want].tolist(), strict=True):
                entry.setdefault(t, v)
        out.append(entry)
    return out

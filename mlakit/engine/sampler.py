"""Sampler: logits [M, V] of the rows that sample -> one token each (and log-probabilities when asked).

First vLLM's logits processing: repetition penalty (over prompt and generated tokens), frequency and
presence penalties (over generated tokens), EOS and stop tokens masked before `min_tokens`. Then
greedy rows take the argmax. Sampled rows: temperature, top-k, top-p, min-p, then the exponential race
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


def process(logits: torch.Tensor, params: list[SamplingParams], history=None, eos=None) -> torch.Tensor:
    """The logits with penalties applied and the tokens `min_tokens` forbids set to -inf (a copy when
    anything changes). `history[i]`: row i's (token ids so far, prompt length)."""
    if history is None:
        if any(p.penalized or p.min_tokens for p in params):
            raise ValueError("sampling with penalties or min_tokens needs each row's history")
        return logits
    banned = [_banned(p, history[i], eos) for i, p in enumerate(params)]
    rows = [i for i, p in enumerate(params) if p.penalized or banned[i]]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        tokens, prompt_len = history[i]
        out[i] = penalize(out[i], params[i], tokens, prompt_len)
        if banned[i]:
            out[i, banned[i]] = float("-inf")
    return out


def penalize(x: torch.Tensor, p: SamplingParams, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """One row's logits [V] after vLLM's penalties: repetition (HF's rule over prompt + output: a seen
    token's positive logit divided by it, a negative one multiplied), then frequency (per occurrence in
    the output) and presence (once per token in the output), both subtracted (OpenAI's)."""
    if not p.penalized:
        return x
    vocab = x.shape[-1]
    ids = torch.tensor(tokens, dtype=torch.long, device=x.device)
    if p.repetition_penalty != 1:
        seen = torch.bincount(ids, minlength=vocab)[:vocab] > 0
        x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(ids[prompt_len:], minlength=vocab)[:vocab].to(x.dtype)
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def _banned(p: SamplingParams, history, eos) -> list[int]:
    """Token ids a row may not sample yet: before `min_tokens` generated, its stop tokens and EOS."""
    if not p.min_tokens or history is None or len(history[0]) - history[1] >= p.min_tokens:
        return []
    stops = list(p.stop_token_ids)
    if eos is not None and not p.ignore_eos:
        stops.append(eos)
    return stops


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list,
    shared: torch.Generator,
    history: list | None = None,
    eos: int | None = None,
) -> tuple[list[int], list[dict[int, float] | None]]:
    """One token per row; `generators[i]`: row i's own generator (a seeded request) or None (`shared`);
    `history[i]`: row i's (token ids so far, prompt length), read by penalties and `min_tokens`; `eos`:
    the model's end token. Log-probabilities are the model's own (before processing, vLLM's default)."""
    raw = logits
    logits = process(logits, params, history, eos)
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
    return chosen, _logprobs(raw, params, chosen)


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

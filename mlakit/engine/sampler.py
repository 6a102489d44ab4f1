"""Sampler: logits [M, V] of the rows that sample -> one token each (and log-probabilities when asked).

First vLLM's logits processing: repetition penalty (over prompt and generated tokens), frequency and
presence penalties (over generated tokens), EOS and stop tokens masked before `min_tokens`. Then
greedy rows take the argmax. Sampled rows: temperature, top-k, top-p, min-p, then one draw from p by
its inverse CDF (one uniform per row against the running sum of p, in fp64): a row with a seed draws
its uniform from its own generator, so its tokens do not depend on the other rows of the batch.

Why not the exponential race vLLM uses (argmax of p / q, q ~ Exp(1)): it draws one random number per
vocabulary entry, and on a CPU that is most of the sampler: 78 ms for 32 rows of 129,280 (one thread,
AMD EPYC Zen 4), as long as a third of the model's decode step, where the running sum takes ~6 ms.
Both draw exactly from p.
"""

from __future__ import annotations

import torch

from mlakit.engine.params import SamplingParams
from mlakit.ops import cpu_core


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
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1]
    if nucleus:
        top_p = torch.tensor([params[i].top_p for i in nucleus], device=dev)
        if len(nucleus) == len(params):
            x = x.masked_fill(~top_p_keep(x, top_p), float("-inf"))
        else:  # rows with top_p 1 keep every token, whatever rounding does to a running sum
            idx = torch.tensor(nucleus, device=dev)
            x = x.clone()
            x[idx] = x[idx].masked_fill(~top_p_keep(x[idx], top_p), float("-inf"))
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


# top-p looks for its set among this many most likely tokens first (a top-k, not a sort of the vocabulary)
TOP_P_CANDIDATES = 256


def top_p_keep(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool [R, V]: the tokens top-p keeps in each row of logits x [R, V]: the most likely ones until
    their probability reaches top_p [R], the most likely token always. A row whose TOP_P_CANDIDATES most
    likely tokens already hold more than top_p finds its set among them (a top-k and a log-sum-exp over
    the row: ~17 ms for 32 rows of 129,280 on one core); the others sort their whole row (~350 ms)."""
    vocab = x.shape[-1]
    keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    rest = torch.arange(x.shape[0], device=x.device)  # the rows that sort
    k = min(vocab, TOP_P_CANDIDATES)
    if k < vocab:
        vals, order = x.topk(k, dim=-1)  # descending
        probs = (vals - torch.logsumexp(x, dim=-1, keepdim=True)).exp()
        ahead = probs.cumsum(-1) - probs  # the probability of the tokens before each one
        keep.scatter_(1, order, ahead <= top_p[:, None])
        # strictly more than top_p among the candidates: every token past them has more ahead of it
        rest = (ahead[:, -1] + probs[:, -1] <= top_p).nonzero().squeeze(1)
        if rest.numel() == 0:
            return keep
    sorted_x, order = x[rest].sort(dim=-1, descending=True)
    probs = sorted_x.softmax(-1)
    stay = probs.cumsum(-1) - probs <= top_p[rest, None]
    keep[rest] = torch.zeros_like(stay).scatter_(1, order, stay)
    return keep


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
    the model's end token. Log-probabilities are the model's own (before processing, vLLM's default).
    `logits` fp32, or bf16 / fp16 (the lm_head's own output): read as they are where that draws exactly
    what their fp32 widening would (`plain`), widened to fp32 first everywhere else (fp64 too)."""
    narrow = logits.dtype in (torch.bfloat16, torch.float16)
    if logits.dtype != torch.float32 and not (narrow and plain(logits, params)):
        logits = logits.float()
    raw = logits
    logits = process(logits, params, history, eos)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        chosen = argmax(logits).tolist()
        return chosen, _logprobs(raw, params, chosen)
    dev = logits.device
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=dev)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        g_idx = torch.tensor(greedy, device=dev)
        tokens[g_idx] = argmax(logits[g_idx])
    idx = torch.tensor(rows, device=dev)
    picked = logits if not greedy else logits[idx]  # no copy of the logits when every row samples
    sampled = [params[i] for i in rows]
    u = _uniforms([generators[i] for i in rows], shared, dev)
    if _fused_draw(picked):
        # from the logits in one op: temperature, exp and the running sums without the softmax's copies
        filtered = any(map(_filters, sampled))
        x = _filter(picked, sampled) if filtered else picked
        inv = torch.tensor([1.0 if filtered else 1.0 / p.temperature for p in sampled], dtype=torch.float32)
        tokens[idx] = torch.ops.mlakit_cpu.inverse_cdf_logits(x.contiguous(), inv, u)
    else:
        tokens[idx] = inverse_cdf(_filter(picked, sampled).softmax(-1), u)
    chosen = tokens.tolist()
    return chosen, _logprobs(raw, params, chosen)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of logits [R, V] (the same indices: the first largest, NaN the largest),
    through `argmax_rows` where a fused core is loaded: the bf16 core's (mlakit/csrc/rows.cpp, fp32 or
    bf16 logits), else the fp32 core's for fp32 logits (latent_decode_f32.cpp: AVX2-only CPUs, where
    mlakit computes in fp32). ATen's bf16 argmax runs a scalar loop (7.4 ms for 32 rows of 129,280 on 2
    cores of an AMD EPYC Zen 4, against ~0.3 ms), its fp32 one 1.7 ms."""
    if x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1 and 0 < x.shape[-1] < 2**31 - 16:
        if x.dtype in (torch.float32, torch.bfloat16) and cpu_core.available(torch.bfloat16):
            return torch.ops.mlakit_cpu.argmax_rows(x)
        if x.dtype == torch.float32 and cpu_core.available(torch.float32):
            return torch.ops.mlakit_cpu_f32.argmax_rows(x)
    return x.argmax(-1)


def _fused_draw(x: torch.Tensor) -> bool:
    """Whether `inverse_cdf_logits` (mlakit/csrc/rows.cpp) draws these rows: fp32 or bf16 logits on a
    CPU where the bf16 core is loaded, rows wider than two CDF blocks (the two-level sum it computes)."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.shape[-1] > 2 * CDF_BLOCK
        and cpu_core.available(torch.bfloat16)
    )


def _filters(p: SamplingParams) -> bool:
    """Whether a row's draw is filtered (top-k, top-p or min-p)."""
    return p.top_k > 0 or p.top_p < 1 or p.min_p > 0


def plain(logits: torch.Tensor, params: list[SamplingParams]) -> bool:
    """Whether `sample` reads these (bf16) logits as they are: no row asks for log-probabilities,
    penalties, `min_tokens` or a top-k / top-p / min-p filter, and every sampled row is drawn by
    `inverse_cdf_logits`, which widens each logit exactly (an argmax picks the same token in either
    dtype). Saves a [rows, vocabulary] fp32 copy per step (32 x 129,280: ~0.7 ms on 2 cores)."""
    if any(p.logprobs is not None or p.penalized or p.min_tokens for p in params):
        return False
    sampled = [p for p in params if not p.greedy]
    if any(map(_filters, sampled)):
        return False
    return not sampled or _fused_draw(logits)


def _uniforms(generators: list, shared: torch.Generator, device) -> torch.Tensor:
    """One fp64 uniform in [0, 1) per row: from the row's own generator, else from `shared` (the
    unseeded rows' in one call, in row order)."""
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    common = [j for j, g in enumerate(generators) if g is None]
    if common:
        draws = torch.rand(len(common), dtype=torch.float64, device=device, generator=shared)
        u[torch.tensor(common, device=device)] = draws
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand((), dtype=torch.float64, device=device, generator=g)
    return u


# the running sum is taken over sums of this many tokens first, then inside the one block a row lands in
CDF_BLOCK = 1024


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (rows of non-negative weights, not necessarily summing to 1), u [R] uniforms in
    [0, 1) -> [R] token ids: the first token whose running sum (fp64) exceeds u x the row's total. A
    token of weight 0 is never returned: its running sum equals the one before it.

    Rows wider than 2 x CDF_BLOCK go in two levels: the running sum of block sums (each summed in the
    weights' dtype), then the running sum inside the block the target falls in, both fp64, the target
    rescaled to the block's own fp64 total. The draw is then p's to the rounding of one block sum
    (~1e-7 of that block's mass in fp32), and 10x cheaper: 32 rows of 129,280, one core: 0.6 ms
    against 5.5 ms for one fp64 running sum over the whole row."""
    if probs.dim() != 2 or u.shape != probs.shape[:1]:
        raise ValueError(f"probs [R, V] and u [R] expected, got {list(probs.shape)} and {list(u.shape)}")
    rows, vocab = probs.shape
    u = u.to(torch.float64)
    if vocab <= 2 * CDF_BLOCK:
        return _search(probs.to(torch.float64).cumsum(-1), u)[0]
    whole = vocab // CDF_BLOCK * CDF_BLOCK
    parts = [probs[:, :whole].reshape(rows, -1, CDF_BLOCK).sum(-1)]
    if whole < vocab:
        parts.append(probs[:, whole:].sum(-1, keepdim=True))
    sums = torch.cat(parts, 1).to(torch.float64)  # [R, blocks]
    cdf = sums.cumsum(-1)
    block, target = _search(cdf, u)  # a block of sum 0 is never chosen, as a token of weight 0
    before = cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1).masked_fill(block == 0, 0.0)
    share = ((target - before) / sums.gather(1, block[:, None]).squeeze(1)).clamp(0.0, 1.0)
    ids = block[:, None] * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)
    weights = probs.gather(1, ids.clamp(max=vocab - 1)).to(torch.float64) * (ids < vocab)
    inner, _ = _search(weights.cumsum(-1), share)
    return ids.gather(1, inner[:, None]).squeeze(1).clamp_(max=vocab - 1)


def _search(cdf: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first index whose running sum exceeds the target, the target): u x the row's total, kept
    strictly below the total, which u x total rounds up to for u within 2^-53 of 1. The index is
    clamped for a degenerate row (all weights 0 or NaN), which has no token to pick."""
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return index.clamp_(max=cdf.shape[-1] - 1), target


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

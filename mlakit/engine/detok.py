"""Incremental detokenization and the stop rules (vLLM's), per sequence."""

from __future__ import annotations


class Detokenizer:
    """Text of a sequence's generated tokens as they arrive (`tokenizers.decoders.DecodeStream`):
    multi-byte characters split across tokens come out whole; special tokens are skipped unless
    `skip_special_tokens=False`."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.backend = backend_of(tokenizer)
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token: int) -> str:
        piece = self.stream.step(self.backend, token)
        return piece or ""


def backend_of(tokenizer):
    """The `tokenizers.Tokenizer` under a transformers tokenizer (or the object itself)."""
    for name in ("backend_tokenizer", "_tokenizer"):
        inner = getattr(tokenizer, name, None)
        if inner is not None:
            return inner
    return tokenizer


def find_stop(text: str, new: int, stops: list[str]) -> tuple[int, str] | None:
    """(where the earliest stop string starts, which) among those ending in the last `new` characters."""
    best = None
    for s in stops:
        at = text.find(s, max(0, len(text) - new - len(s) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best


def advance(seq, token: int, eos: int | None, max_model_len: int) -> str | None:
    """Account one sampled `token` (already appended to `seq.tokens`) in `seq.text` and return why the
    sequence ends ("stop" | "length") or None. vLLM's rules: before `min_tokens` nothing stops it but
    the length; a stop token's (EOS's) text stays out of `text` and a stop string is cut off, unless
    `include_stop_str_in_output`; a stop string is looked for once more than `min_tokens` are out."""
    params = seq.request.params
    generated = len(seq.tokens) - seq.prompt_len
    stop_token = generated >= params.min_tokens and (
        token in params.stop_token_ids or (not params.ignore_eos and token == eos)
    )
    if seq.detok is not None and (not stop_token or params.include_stop_str_in_output):
        piece = seq.detok.step(token)
        seq.text += piece
        hit = None
        if params.stop and piece and generated > params.min_tokens:
            hit = find_stop(seq.text, len(piece), params.stop)
        if hit is not None:
            end = hit[0] + len(hit[1]) if params.include_stop_str_in_output else hit[0]
            seq.text = seq.text[:end]
            seq.stop_reason = hit[1]
            return "stop"
    if stop_token:
        seq.stop_reason = token
        return "stop"
    if (params.max_tokens is not None and generated >= params.max_tokens) or len(seq.tokens) >= max_model_len:
        return "length"
    return None

"""Incremental detokenization and stop strings, per sequence."""

from __future__ import annotations


class Detokenizer:
    """Text of a sequence's generated tokens as they arrive (`tokenizers.decoders.DecodeStream`):
    multi-byte characters split across tokens come out whole; special tokens are skipped."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.backend = backend_of(tokenizer)
        self.stream = DecodeStream(skip_special_tokens=True)

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

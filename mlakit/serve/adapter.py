"""What the server needs from an engine and its tokenizer, in one place.

The engine is `mlakit.engine.LLMEngine` (or anything with its four methods); the tokenizer is a
transformers tokenizer or a `tokenizers.Tokenizer`. Everything here is read-only on the engine except
`make_params`, and runs on either thread.
"""

from __future__ import annotations

from mlakit.engine.chat import render


class EngineAdapter:
    def __init__(self, engine, tokenizer=None, max_model_len: int | None = None, sampling_params_cls=None):
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.max_model_len = int(max_model_len or _max_model_len(engine))
        self.max_num_seqs = int(getattr(engine, "max_num_seqs", 0) or _config(engine, "max_num_seqs", 64))
        self._params_cls = sampling_params_cls

    def make_params(self, **kw):
        cls = self._params_cls
        if cls is None:
            from mlakit.engine import SamplingParams as cls
        return cls(**kw)

    @property
    def vocab_size(self) -> int:
        tok = self.tokenizer
        size = tok.get_vocab_size() if hasattr(tok, "get_vocab_size") else len(tok)
        return int(size)

    def encode(self, text: str) -> list[int]:
        engine_encode = getattr(self.engine, "encode", None)
        if callable(engine_encode):
            return list(engine_encode(text))
        out = self.tokenizer.encode(text)
        return list(getattr(out, "ids", out))

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` alone, without the special tokens a prompt gets (BOS)."""
        out = self.tokenizer.encode(text, add_special_tokens=False)
        return list(getattr(out, "ids", out))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)])

    def render_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation: the tokenizer's chat template, else the plain one."""
        return render(self.tokenizer, messages, encode=self.encode)[1]

    def stats(self) -> dict:
        """running, waiting, kv_cache_usage (0..1) from the engine when it tells; None where it does not."""
        raw = getattr(self.engine, "stats", None)  # LLMEngine: a property giving an EngineStats
        raw = raw() if callable(raw) else raw
        raw = raw if isinstance(raw, dict) else vars(raw) if raw is not None else {}
        return {
            "running": raw.get("num_running", raw.get("running")),
            "waiting": raw.get("num_waiting", raw.get("waiting")),
            "kv_cache_usage": raw.get("kv_cache_usage", raw.get("kv_cache_usage_perc")),
        }


def _config(engine, name: str, default):
    for holder in (engine, getattr(engine, "config", None), getattr(engine, "scheduler_config", None)):
        if holder is not None and getattr(holder, name, None) is not None:
            return getattr(holder, name)
    return default


def _max_model_len(engine) -> int:
    value = _config(engine, "max_model_len", None)
    if value is None:
        raise ValueError("the engine does not say its max_model_len; pass max_model_len=")
    return value

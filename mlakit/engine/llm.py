"""LLM: the offline entry point (vLLM's name): prompts in, finished RequestOutputs out."""

from __future__ import annotations

import sys
import time

from mlakit.engine.chat import check_messages, render, template_options
from mlakit.engine.engine import LLMEngine
from mlakit.engine.limits import check_context
from mlakit.engine.params import RequestOutput, SamplingParams

PROGRESS_EVERY = 5.0  # seconds


class LLM:
    """`LLM(model, *, engine keywords)` (LLMEngine's, same names and defaults); `generate(prompts,
    sampling_params)` runs them to the end. Every argument is checked before anything changes; a model
    instance is then taken over (cast/moved, its attention modules replaced)."""

    def __init__(
        self,
        model,
        *,
        tokenizer=None,
        dtype=None,
        device=None,
        cache_dtype=None,
        block_size: int = 64,
        num_blocks=None,
        cache_memory=None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        enforce_eager: bool | None = None,
    ):
        self.llm_engine = LLMEngine(
            model,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            cache_dtype=cache_dtype,
            block_size=block_size,
            num_blocks=num_blocks,
            cache_memory=cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            enforce_eager=enforce_eager,
        )
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """`prompts`: a string, a list of strings, or token-id lists (one list of ints is one prompt);
        `sampling_params`: one for all or a list with one per prompt. Outputs in the prompts' order."""
        prompts = _as_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, list | tuple) and len(sampling_params) == len(prompts):
            params = list(sampling_params)
        else:
            raise ValueError(
                f"sampling_params must be a SamplingParams or a list of {len(prompts)} (one per prompt), "
                f"got {type(sampling_params).__name__}"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params holds a {type(p).__name__}, expected SamplingParams")
        eng = self.llm_engine
        for prompt, p in zip(prompts, params, strict=True):  # every prompt checked before any is queued
            check_context(len(eng._tokenize(prompt)[1]), p.max_tokens, eng.max_model_len)
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            rid = f"llm-{self._counter}"
            self._counter += 1
            eng.add_request(rid, prompt, p)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """`messages`: one conversation (a list of {"role", "content"} dicts) or a list of them; rendered
        as the server's /v1/chat/completions does (the tokenizer's chat template, or `chat_template`,
        else the plain one) and generated as `generate` does. vLLM's keywords: `continue_final_message`
        (the last message left open for the model to go on, no generation prompt: not with
        `add_generation_prompt`), `chat_template_kwargs` (more variables for the template).
        `RequestOutput.prompt` is the rendered text."""
        convs = (
            [messages]
            if isinstance(messages, list | tuple) and messages and isinstance(messages[0], dict)
            else messages
        )
        if not isinstance(convs, list | tuple) or not convs:
            raise ValueError(f"messages must be a conversation or a list of conversations, got {messages!r}")
        options = template_options(
            chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs
        )
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer: pass tokenizer= to LLM")
        name = "messages" if convs is not messages else "messages[{}]"
        rendered = [render(tok, check_messages(c, name.format(i)), **options) for i, c in enumerate(convs)]
        outs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm=use_tqdm)
        for out, (text, _) in zip(outs, rendered, strict=True):
            out.prompt = text
        return outs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        eng, done, start, last = self.llm_engine, {}, time.perf_counter(), 0.0
        try:
            while len(done) < len(ids):
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out
                now = time.perf_counter()
                if use_tqdm and now - max(last, start) > PROGRESS_EVERY:
                    last = now  # a long run says where it is on stderr, one line every few seconds
                    print(
                        f"generate: {len(done)}/{len(ids)} requests done, {now - start:.0f} s, "
                        f"{eng.generation_tokens} tokens generated",
                        file=sys.stderr,
                    )
        except BaseException:
            for rid in ids:
                if rid not in done and rid in eng.requests:
                    eng.abort_request(rid)
            eng._report()
            raise
        return [done[rid] for rid in ids]


def _as_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, list | tuple) and prompts:
        return list(prompts)
    raise ValueError(f"prompts must be a string, a list of strings or of token-id lists, got {prompts!r}")

"""LLMEngine: requests in, one planned step at a time, RequestOutputs out (the server drives it).

One step: schedule (running first, then waiting, one token budget) -> one `cache.plan` -> the model
(every layer `layer(h, plan)`) -> `cache.commit` -> sample -> detokenize, stop, free what finished.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from mlakit.cache.blocks import BlockPool
from mlakit.cache.paged import PagedLatentCache
from mlakit.cache.quant import token_layout
from mlakit.engine import load, warmup
from mlakit.engine.detok import Detokenizer, advance
from mlakit.engine.kv import KVManager
from mlakit.engine.limits import check_cache_dtype, check_context
from mlakit.engine.malloc import keep_heap
from mlakit.engine.params import RequestOutput, SamplingParams
from mlakit.engine.report import EngineStats, check_args, eos_of, output_of
from mlakit.engine.request import FINISHED, WAITING, Request, Sequence
from mlakit.engine.runner import ModelRunner, check_family
from mlakit.engine.sampler import sample
from mlakit.engine.scheduler import schedule

PENDING = "pending"  # a sibling of n > 1 waiting for the prompt to be computed once
KEEP_FINISHED_IDS = 100_000


class LLMEngine:
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
        # every argument is checked, and a model instance's family, before anything (the user's model
        # included) changes
        check_args(cache_dtype, block_size, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, seed)
        warmup.check_enforce_eager(enforce_eager)
        device = load.check_device(device)
        dtype = load.resolve_dtype(dtype, device)
        tokenizer = load.check_tokenizer(tokenizer)
        sizes = (cache_dtype, block_size, num_blocks, cache_memory, max_num_seqs)
        blocks = None
        if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
            cfg, _ = check_family(model)
            param = next(model.parameters())
            blocks = _cache_size(cfg, model.config, dtype or param.dtype, device or param.device, *sizes)
        model, self.tokenizer = load.load_model(model, tokenizer, dtype, device)
        self.runner = ModelRunner(model)
        # a CPU step's buffers stay in the heap between steps (mlakit/engine/malloc.py)
        self.malloc = keep_heap() if self.runner.device.type == "cpu" else "device memory"
        cfg, config = self.runner.cfg, model.config
        if blocks is None:
            blocks = _cache_size(cfg, config, self.runner.dtype, self.runner.device, *sizes)
        max_pos = getattr(config, "max_position_embeddings", None) or 2**20
        # the engine owns the pages: one pool, the cache stores them, the KVManager shares them
        pool = BlockPool(blocks, block_size, max_num_seqs)
        self.cache = PagedLatentCache(
            cfg,
            blocks,
            block_size,
            max_batch=max_num_seqs,
            num_layers=cfg.num_layers,
            dtype=self.runner.dtype,
            quant=cache_dtype,
            device=self.runner.device,
            pool=pool,
        )
        self.kv = KVManager(pool, self.cache, enable_prefix_caching)
        self.max_model_len = min(max_pos, blocks * block_size)
        # key buckets repeat shapes for captured graphs (CUDA); eager CPU steps attend over exactly the
        # longest context (no masked work)
        self.bucket = self.runner.device.type == "cuda"
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.eos_token_id = eos_of(self.tokenizer, config)
        self.generator = torch.Generator(self.runner.device).manual_seed(seed)
        self.requests: dict[str, Request] = {}
        self.finished_ids: OrderedDict[str, None] = OrderedDict()
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self._changed: dict[str, Request] = {}
        self._arrivals = 0
        self.prompt_tokens = self.generation_tokens = self.num_preemptions = 0
        # host seconds spent per part of the step (the benchmark reads them)
        self.timings = dict.fromkeys(("schedule", "plan", "model", "sample", "steps"), 0.0)
        # eager steps, or compiled ones where they pay (mlakit/engine/warmup.py)
        self.compile_seconds = warmup.set_up(self, enforce_eager)
        self._warm_steps = self.runner.compiled_steps

    # ---- requests
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request; every refusal (ValueError naming the argument) comes before any change."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests or request_id in self.finished_ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        check_context(len(ids), params.max_tokens, self.max_model_len)
        req = Request(request_id, text, ids, params, self._arrivals)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        self._arrivals += 1
        for i in range(params.n):
            seq = Sequence(req, i, list(ids), len(ids), status=WAITING if i == 0 else PENDING)
            if self.tokenizer is not None:
                seq.detok = Detokenizer(self.tokenizer, params.skip_special_tokens)
            if params.seed is not None:
                seq.generator = torch.Generator(self.runner.device).manual_seed(params.seed + i)
            if params.logprobs is not None:
                seq.logprobs = []
            req.seqs.append(seq)
        self.requests[request_id] = req
        if params.max_tokens == 0 and not req.scoring:
            self._finish_request(req, "length")
        else:
            self.waiting.append(req.seqs[0])

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt is text but the engine has no tokenizer: pass token ids or tokenizer="
                )
            ids = list(self.tokenizer(prompt)["input_ids"])
            text = prompt
        elif isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids, text = list(prompt), None
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty; expected at least one token")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt holds token ids outside 0..{vocab - 1}")
        return text, ids

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its pages; an unknown id is a ValueError, a finished one a no-op."""
        req = self.requests.get(request_id)
        if req is None:
            if request_id in self.finished_ids:
                return
            raise ValueError(f"request_id {request_id!r} is not a known request")
        if req.finished:
            return
        for seq in req.seqs:
            if not seq.finished:
                self._finish(seq, "abort")
        self._changed[request_id] = req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step
    def step(self) -> list[RequestOutput]:
        """Run at most one plan; returns the requests that changed (finished ones once, last)."""
        t0 = time.perf_counter()
        args = (self.running, self.waiting, self.kv, self.max_num_batched_tokens, self.max_num_seqs)
        sched = schedule(*args)
        self.timings["schedule"] += time.perf_counter() - t0
        self.num_preemptions += len(sched.preempted)
        for seq in sched.admitted:
            if seq.cached_tokens < 0:
                seq.cached_tokens = seq.computed
                if seq.index == 0:
                    seq.request.num_cached_tokens = seq.computed
                    self.prompt_tokens += seq.prompt_len
        if sched.seqs:
            self._run(sched)
        return self._report()

    def _run(self, sched) -> None:
        t0 = time.perf_counter()
        plan = t1 = None
        try:  # a failing plan undoes its own reservations; a failing forward discards the plan
            plan = self.cache.step_plan(sched.counts, [s.slot for s in sched.seqs], bucket=self.bucket)
            # the step's tokens packed in the plan's row order (decode -> extend -> prefill)
            ids, positions, keep, sampling, scored, done = [], [], [], [], [], []
            for row in plan.order:
                seq, n = sched.seqs[row], sched.counts[row]
                start = seq.computed
                scored += [(seq.request, p, len(ids) + p - start) for p in _scored_positions(seq, n)]
                ids += seq.tokens[start : start + n]
                positions += range(start, start + n)
                if start + n == len(seq.tokens) and seq.request.params.max_tokens == 0:
                    done.append(seq)  # prompt_logprobs with max_tokens=0: scored, nothing to sample
                elif start + n == len(seq.tokens):
                    keep.append(len(ids) - 1)
                    sampling.append(seq)
            # rows [0, len(sampling)) sample; the rest score prompt tokens, in the same forward
            keep += [i for _, _, i in scored]
            t1 = time.perf_counter()
            hidden = self.runner.forward(plan, ids, positions, keep)
        except BaseException:
            if plan is not None:
                self.cache.discard(plan)
            for seq in reversed(sched.admitted):  # back to where they were: nothing lost, nothing leaked
                self.kv.release(seq)
                self.running.remove(seq)
                seq.status = WAITING
                self.waiting.insert(0, seq)
            raise
        self.cache.commit(plan)
        # the lm_head (the runner applies it to the kept rows) is model time
        logits = self.runner.logits(hidden[: len(sampling)], fp32=False) if sampling else None
        if scored:
            self._score(scored, hidden[len(sampling) :])
        t2 = time.perf_counter()
        for seq, n in zip(sched.seqs, sched.counts, strict=True):
            seq.computed += n
            self.kv.register(seq)
        for seq in done:
            self._finish_request(seq.request, "length")
        if sampling:
            params = [s.request.params for s in sampling]
            history = [(s.tokens, s.prompt_len) for s in sampling]
            gens = [s.generator for s in sampling]
            tokens, lps = sample(logits, params, gens, self.generator, history, self.eos_token_id)
            for seq, token, lp in zip(sampling, tokens, lps, strict=True):
                self._append(seq, token, lp)
        t3 = time.perf_counter()
        for name, dt in (("plan", t1 - t0), ("model", t2 - t1), ("sample", t3 - t2)):
            self.timings[name] += dt
        self.timings["steps"] += 1

    def _score(self, scored: list, hidden) -> None:
        """Fill the prompt log-probabilities of the rows scored this step: position p's logits give
        prompt token p + 1's entry (the actual token's log-probability and the top-k)."""
        targets = [req.prompt_ids[p + 1] for req, p, _ in scored]
        k = max(req.params.prompt_logprobs for req, _, _ in scored)
        chosen, values, indices = self.runner.token_logprobs(hidden, targets, k)
        for j, (req, p, _) in enumerate(scored):
            entry = {targets[j]: chosen[j]}
            want = req.params.prompt_logprobs
            for t, v in zip(indices[j][:want], values[j][:want], strict=True):
                entry.setdefault(t, v)
            req.prompt_logprobs[p + 1] = entry

    def _append(self, seq: Sequence, token: int, lp) -> None:
        req = seq.request
        first = len(seq.tokens) == seq.prompt_len
        seq.tokens.append(token)
        self.generation_tokens += 1
        self._changed[req.request_id] = req
        if lp is not None:
            seq.logprobs.append(lp)
        if first and seq.index == 0:
            self._fork(seq)
        reason = advance(seq, token, self.eos_token_id, self.max_model_len)
        if reason is not None:
            return self._finish(seq, reason)

    def _fork(self, parent: Sequence) -> None:
        """Siblings of n > 1 start on the prompt pages just computed (one more reference each)."""
        siblings = [s for s in parent.request.seqs if s.status == PENDING]
        for s in reversed(siblings):
            self.kv.fork(parent, s)
            s.status = WAITING
            self.waiting.insert(0, s)

    def _finish_request(self, req: Request, reason: str) -> None:
        for seq in req.seqs:
            if not seq.finished:
                self._finish(seq, reason)
        self._changed[req.request_id] = req

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.kv.release(seq)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.status, seq.finish_reason = FINISHED, reason
        if reason == "abort":
            for s in seq.request.seqs:  # siblings never forked: done with the parent
                if s.status == PENDING:
                    s.status, s.finish_reason = FINISHED, reason

    def _report(self) -> list[RequestOutput]:
        out = []
        for rid, req in self._changed.items():
            done = req.finished
            out.append(output_of(req, done))
            if done:
                del self.requests[rid]
                self.finished_ids[rid] = None
                if len(self.finished_ids) > KEEP_FINISHED_IDS:
                    self.finished_ids.popitem(last=False)
        self._changed = {}
        return out

    # ---- introspection
    @property
    def stats(self) -> EngineStats:
        running = {s.request.request_id for s in self.running}
        return EngineStats(
            num_running=len(running),
            num_waiting=len(self.requests) - len(running),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.queries,
            prefix_cache_hits=self.kv.hits,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_preemptions=self.num_preemptions,
            packed_modules=self.runner.packed_modules,
            step_mode=self.runner.last_mode,
            compile_seconds=self.compile_seconds,
            compiled_buckets=self.runner.compiled_ranges(),
            compiled_steps=self.runner.compiled_steps - self._warm_steps,
        )

    def check(self) -> None:
        """Page and reference-count invariants (tests call it after every step)."""
        seqs = [s for r in self.requests.values() for s in r.seqs]
        self.kv.check(seqs)


def _scored_positions(seq: Sequence, n: int) -> range:
    """Positions of this chunk of `seq` whose logits score a prompt token (the next one): the first
    completion of a request still scoring, up to the second-to-last prompt token (the last one samples)."""
    req = seq.request
    if seq.index != 0 or not req.scoring:
        return range(0)
    return range(seq.computed, min(seq.computed + n, seq.prompt_len - 1))


def _cache_size(
    cfg, config, dtype, device, cache_dtype, block_size, num_blocks, cache_memory, max_seqs
) -> int:
    """Pages of the cache (every refusal a ValueError naming its argument)."""
    check_cache_dtype(cache_dtype, cfg.kv_lora_rank)
    max_pos = getattr(config, "max_position_embeddings", None) or 2**20
    page = token_layout(cfg, dtype, cache_dtype).row_bytes * block_size * cfg.num_layers
    return load.cache_blocks(
        num_blocks, cache_memory, page, torch.device(device), max_seqs * -(-max_pos // block_size)
    )

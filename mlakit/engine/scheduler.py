"""The scheduler: one function over two queues with one token budget.

Running sequences first (those with one token left to compute, then unfinished prompt chunks), then
waiting ones in arrival order, every step: a step's tokens are packed (no padding anywhere), so decode
rows and prompt chunks share a step and the budget counts real tokens; a long prompt is cut into the
chunk that fits beside the step's decode rows (chunked prefill). When pages run out for a running
sequence, the most recently admitted running sequence is preempted (its pages freed; it is recomputed
later). Tensor-free: `kv` is the engine's KVManager (or a fake).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlakit.engine.request import RUNNING, WAITING, Sequence


@dataclass
class Schedule:
    seqs: list[Sequence] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # tokens each computes this step
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)

    def fits(self, chunk: int, budget: int) -> int:
        """The largest chunk <= `chunk` one more row may take within `budget` real tokens (0: none)."""
        return max(0, min(chunk, budget - self.num_tokens))


def schedule(running: list[Sequence], waiting: list[Sequence], kv, budget: int, max_seqs: int) -> Schedule:
    """Pick this step's rows and chunks; admits and preempts through `kv`, updating both queues. Decode
    rows come first (they never wait behind a prompt), then running prompt chunks, then waiting
    prompts while the token budget, the pages and `max_seqs` allow."""
    out = Schedule()
    reserved = 0  # pages the rows scheduled so far will take at the plan
    by_need = sorted(running, key=lambda s: (len(s.tokens) - s.computed > 1, s.admitted))
    for seq in by_need:
        if seq not in running:
            continue  # preempted for an earlier row
        chunk = out.fits(len(seq.tokens) - seq.computed, budget)
        if chunk == 0:
            continue
        while kv.need(seq, chunk) + reserved > kv.num_free:
            victim = _victim(running, out.seqs, seq)
            _preempt(victim, running, waiting, kv, out)
            if victim is seq:
                break
        if seq.status == RUNNING:
            reserved += kv.need(seq, chunk)
            out.seqs.append(seq)
            out.counts.append(chunk)
    if out.preempted:
        return out  # pages are short: admit nothing new this step
    while waiting and len(running) < max_seqs:
        seq = waiting[0]
        pages, free_held = kv.probe(seq)
        start = len(pages) * kv.block_size
        chunk = out.fits(len(seq.tokens) - start, budget)
        if chunk == 0:
            break
        fresh = -(-(start + chunk) // kv.block_size) - len(pages)
        if fresh + free_held + reserved > kv.num_free:
            break
        reserved += fresh
        waiting.pop(0)
        kv.admit(seq, pages)
        seq.status = RUNNING
        running.append(seq)
        out.admitted.append(seq)
        out.seqs.append(seq)
        out.counts.append(chunk)
    return out


def _victim(running: list[Sequence], scheduled: list[Sequence], seq: Sequence) -> Sequence:
    """The most recently admitted running sequence not scheduled yet (`seq` itself when none is left)."""
    for cand in sorted(running, key=lambda s: s.admitted, reverse=True):
        if cand is not seq and cand not in scheduled:
            return cand
    return seq


def _preempt(seq: Sequence, running, waiting, kv, out: Schedule) -> None:
    kv.release(seq)
    seq.status = WAITING
    running.remove(seq)
    waiting.insert(0, seq)
    out.preempted.append(seq)

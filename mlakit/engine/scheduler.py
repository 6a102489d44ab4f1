"""The scheduler: one function over two queues with one token budget.

Running sequences first (those with one token left to compute, then unfinished prompt chunks), then
waiting ones in arrival order. A step's hidden states are a rectangle (rows × the longest chunk), so the
budget bounds rows × width: a long prompt is cut into chunks that fit beside the step's other rows.
When pages run out for a running sequence, the most recently admitted running sequence is preempted
(its pages freed; it is recomputed later). While decode rows and prompt work are both pending, decode
and prefill steps alternate (`kind_of`): padded queries made mixed rectangles mostly padding.
Tensor-free: `kv` is the engine's KVManager (or a fake).
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
    def width(self) -> int:
        return max(self.counts, default=0)

    def fits(self, chunk: int, budget: int) -> int:
        """The largest chunk <= `chunk` one more row may take within `budget` (0: none)."""
        rows = len(self.seqs) + 1
        chunk = min(chunk, budget // rows)
        if chunk < 1 or rows * max(self.width, chunk) > budget:
            return 0
        return chunk


def kind_of(running: list[Sequence], waiting: list[Sequence], last: str) -> str:
    """ "mixed" unless there are both decode rows and prompt work: then "decode" and "prefill" alternate
    (a decode row beside a chunk of width S pays S padded queries: at 64 rows and chunks of 32, a
    mixed rectangle computed ~40% real tokens)."""
    decode = any(len(s.tokens) - s.computed == 1 for s in running)
    prompt = bool(waiting) or any(len(s.tokens) - s.computed > 1 for s in running)
    if decode and prompt:
        return "decode" if last == "prefill" else "prefill"
    return "mixed"


def schedule(
    running: list[Sequence], waiting: list[Sequence], kv, budget: int, max_seqs: int, kind: str = "mixed"
) -> Schedule:
    """Pick this step's rows and chunks; admits and preempts through `kv`, updating both queues.
    `kind`: "mixed" (every row), "decode" (running rows with one token left only) or "prefill" (prompt
    chunks only: running ones first, then waiting ones)."""
    out = Schedule()
    reserved = 0  # pages the rows scheduled so far will take at the plan
    by_need = sorted(running, key=lambda s: (len(s.tokens) - s.computed > 1, s.admitted))
    if kind != "mixed":
        by_need = [s for s in by_need if (len(s.tokens) - s.computed == 1) == (kind == "decode")]
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
    if out.preempted or kind == "decode":
        return out  # pages are short (or a decode step): admit nothing new this step
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

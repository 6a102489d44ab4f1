"""KVManager: the engine's policy over its page pool (slots, prefix hits, forks, the prefix index).

Tensor-free. The engine builds one `BlockPool` and gives it to the cache; the cache keeps doing what
it does (plan / commit / release, `adopt` to start a slot on pages already written); this object
decides which pages a slot starts on: a prefix hit (pages found by their chain hash) or a fork of
`n > 1` (the first completion's prompt pages, held until the child starts), and registers every
whole page a step completes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Tokens

import xxhash

from mlakit.cache.blocks import BlockPool, blocks_for
from mlakit.engine.request import Sequence


def page_hashes(tokens: Tokens[int], block_size: int, start: int = 0, parent: int | None = None) -> list[int]:
    """Hash chain of the whole pages of `tokens` from page `start` on: each page's hash covers its
    parent's hash and its own token ids, so equal hashes mean equal prefixes."""
    out = []
    for p in range(start, len(tokens) // block_size):
        h = xxhash.xxh3_64()
        h.update(b"root" if parent is None else parent.to_bytes(8, "little"))
        for t in tokens[p * block_size : (p + 1) * block_size]:
            h.update(int(t).to_bytes(4, "little"))
        parent = h.intdigest()
        out.append(parent)
    return out


class KVManager:
    def __init__(self, pool: BlockPool, cache, prefix_caching: bool):
        if cache.blocks is not pool:
            raise ValueError("pool must be the BlockPool the cache was built on (PagedLatentCache(pool=...))")
        self.cache = cache
        self.pool = pool
        self.block_size = pool.block_size
        self.prefix_caching = prefix_caching
        self.free_slots = list(range(cache.max_batch - 1, -1, -1))
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found
        self.admissions = 0

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of pages some request holds."""
        return self.pool.usage

    def table_len(self, seq: Sequence) -> int:
        return 0 if seq.slot is None else len(self.pool.tables[seq.slot])

    def need(self, seq: Sequence, new: int) -> int:
        """Pages `seq` must be given to cache `new` more tokens."""
        return max(0, blocks_for(seq.computed + new, self.block_size) - self.table_len(seq))

    def probe(self, seq: Sequence) -> tuple[list[int], int]:
        """(pages a waiting `seq` can start on, how many of them are free now: holding them takes them
        off the free list). At least its last token is always left to compute (it gives the logits).
        A request still scoring its prompt (prompt_logprobs) reads no prefix: every position's logits
        are needed (vLLM's rule)."""
        limit = (len(seq.tokens) - 1) // self.block_size
        pages = list(seq.shared[:limit])
        if self.prefix_caching and not seq.request.scoring:
            self._hash(seq, limit)
            found = self.pool.lookup(seq.hashes[:limit])
            if len(found) > len(pages):
                pages = found
        return pages, sum(self.pool.refs[p] == 0 for p in pages)

    def _hash(self, seq: Sequence, pages: int) -> None:
        if len(seq.hashes) < pages:
            parent = seq.hashes[-1] if seq.hashes else None
            tokens = seq.tokens[: pages * self.block_size]
            seq.hashes += page_hashes(tokens, self.block_size, len(seq.hashes), parent)

    def admit(self, seq: Sequence, pages: list[int]) -> None:
        """Give `seq` a slot starting on `pages` (its first len(pages) whole pages, already computed)."""
        slot = self.free_slots.pop()
        tokens = len(pages) * self.block_size
        self.cache.adopt(slot, pages)
        self._drop_shared(seq)
        seq.slot, seq.computed = slot, tokens
        self.admissions += 1
        seq.admitted = self.admissions
        seq.registered = len(pages) if self.prefix_caching else 0
        self.queries += len(seq.tokens)
        self.hits += tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Hold the whole prompt pages of `parent` for `child` until it is admitted."""
        pages = self.pool.tables[parent.slot][: (parent.prompt_len - 1) // self.block_size]
        for p in pages:
            self.pool.hold(p)
        child.shared = list(pages)

    def release(self, seq: Sequence) -> None:
        """Free `seq`'s slot and its references (pages the prefix index knows stay findable)."""
        if seq.slot is not None:
            self.cache.release(seq.slot)
            self.free_slots.append(seq.slot)
            seq.slot = None
        seq.computed = 0
        seq.registered = 0
        self._drop_shared(seq)

    def _drop_shared(self, seq: Sequence) -> None:
        for p in seq.shared:
            self.pool.drop(p)
        seq.shared = []

    def register(self, seq: Sequence) -> None:
        """Enter the whole pages `seq` has computed into the prefix index."""
        if not self.prefix_caching:
            return
        whole = seq.computed // self.block_size
        if whole <= seq.registered:
            return
        self._hash(seq, whole)
        table = self.pool.tables[seq.slot]
        for p in range(seq.registered, whole):
            self.pool.register(table[p], seq.hashes[p])
        seq.registered = whole

    def check(self, seqs) -> None:
        """Invariants: the pool's own; its holds are the fork holds of `seqs`; a free slot holds nothing."""
        self.pool.check()
        holds = Counter(p for seq in seqs for p in seq.shared)
        if holds != Counter(self.pool.holds):
            raise AssertionError(f"pool holds {self.pool.holds}, the waiting forks hold {dict(holds)}")
        pool = self.pool
        held = {s for s in range(self.cache.max_batch) if pool.tables[s] or pool.tokens[s]}
        if held & set(self.free_slots) or len(set(self.free_slots)) != len(self.free_slots):
            raise AssertionError("a free slot holds pages")

"""KVManager: the engine's side of the paged latent cache (slots, shared pages, prefix index).

Tensor-free except for the cache's `lengths` entries it sets when a slot starts on shared pages. The
cache keeps doing what it does (plan / commit / release); this object decides which pages a slot starts
on: a prefix hit (pages found by their chain hash) or a fork of `n > 1` (the first completion's
prompt pages), and registers every whole page a step completes.
"""

from __future__ import annotations

from mlakit.cache.blocks import blocks_for
from mlakit.engine.blocks import PagePool, SharedBlockManager, page_hashes
from mlakit.engine.request import Sequence


class KVManager:
    def __init__(self, cache, prefix_caching: bool):
        self.cache = cache
        self.block_size = cache.block_size
        self.pool = PagePool(cache.num_blocks)
        # the cache hands out pages through the pool: slots may share them
        cache.blocks = SharedBlockManager(self.pool, cache.block_size, cache.max_batch)
        self.blocks = cache.blocks
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
        return self.pool.num_used / self.pool.num_pages

    def table_len(self, seq: Sequence) -> int:
        return 0 if seq.slot is None else len(self.blocks.tables[seq.slot])

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
        self.blocks.adopt(slot, pages, tokens)
        self.cache.lengths[slot] = tokens
        self._drop_shared(seq)
        seq.slot, seq.computed = slot, tokens
        self.admissions += 1
        seq.admitted = self.admissions
        seq.registered = len(pages) if self.prefix_caching else 0
        self.queries += len(seq.tokens)
        self.hits += tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Hold the whole prompt pages of `parent` for `child` until it is admitted."""
        pages = self.blocks.tables[parent.slot][: (parent.prompt_len - 1) // self.block_size]
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
        table = self.blocks.tables[seq.slot]
        for p in range(seq.registered, whole):
            self.pool.register(table[p], seq.hashes[p])
        seq.registered = whole

    def check(self, seqs) -> None:
        """Invariants: every page free or held, each reference accounted for by a table or a fork hold."""
        self.pool.check()
        counts = [0] * self.pool.num_pages
        for table in self.blocks.tables:
            for p in table:
                counts[p] += 1
        for seq in seqs:
            for p in seq.shared:
                counts[p] += 1
        if counts != self.pool.refs:
            bad = [p for p, (a, b) in enumerate(zip(counts, self.pool.refs, strict=True)) if a != b]
            raise AssertionError(f"reference counts wrong for pages {bad[:8]}")
        held = {s for s in range(self.cache.max_batch) if self.blocks.tables[s] or self.blocks.tokens[s]}
        if held & set(self.free_slots) or len(set(self.free_slots)) != len(self.free_slots):
            raise AssertionError("a free slot holds pages")

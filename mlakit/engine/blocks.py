"""Pages shared by requests: reference counts, a prefix index (hash chain over whole pages), LRU eviction.

Plain Python over integers (page ids, hashes, counts); no tensor. `PagePool` is the pool;
`SharedBlockManager` is the `BlockManager` a `PagedLatentCache` uses when an engine owns its pages: a
slot's table may start with pages other slots hold too (a prefix hit, a fork of `n > 1`), every page
is handed out and taken back through the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash

from mlakit.cache.blocks import BlockManager, blocks_for


def page_hashes(
    tokens: Sequence[int], block_size: int, start: int = 0, parent: int | None = None
) -> list[int]:
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


class PagePool:
    """`num_pages` pages: reference counts, a free list in least-recently-used order (pages with a
    hash stay findable until handed out again), and the index hash -> page of whole computed pages."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        # free pages, the next handed out first: pages with no hash at the front, cached ones by age
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.hash_of: dict[int, int] = {}
        self.page_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Pages no request holds (cached ones included: they are evicted when handed out)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise ValueError(f"out of pages: all {self.num_pages} are held")
        page, _ = self.free.popitem(last=False)
        h = self.hash_of.pop(page, None)
        if h is not None:
            del self.page_of[h]  # evicted: the least recently used cached page
        self.refs[page] = 1
        return page

    def hold(self, page: int) -> None:
        if self.refs[page] == 0:
            del self.free[page]
        self.refs[page] += 1

    def drop(self, page: int) -> None:
        if self.refs[page] <= 0:
            raise AssertionError(f"page {page} dropped with no reference")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free[page] = None
            if page not in self.hash_of:
                self.free.move_to_end(page, last=False)  # nothing to keep: reused first

    def register(self, page: int, h: int) -> None:
        """Page `page` (held) now holds the whole page whose chain hash is `h`."""
        if h in self.page_of or page in self.hash_of:
            return  # the same prefix computed twice (or already known): keep the first
        self.page_of[h] = page
        self.hash_of[page] = h

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """Pages of the longest run of `hashes` the index holds (not yet held: the caller holds them)."""
        out = []
        for h in hashes:
            page = self.page_of.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def check(self) -> None:
        """Every page free (refcount 0) or held (> 0); the index is consistent."""
        for p, r in enumerate(self.refs):
            if r < 0 or (r == 0) != (p in self.free):
                raise AssertionError(f"page {p}: {r} references, free={p in self.free}")
        if len(self.free) + sum(r > 0 for r in self.refs) != self.num_pages:
            raise AssertionError("pages lost")
        if any(self.hash_of.get(p) != h for h, p in self.page_of.items()) or len(self.page_of) != len(
            self.hash_of
        ):
            raise AssertionError("prefix index inconsistent")


class SharedBlockManager(BlockManager):
    """A `BlockManager` whose pages come from a `PagePool`: `append` allocates, `truncate` drops a
    reference (a page other slots hold stays), `adopt` starts a slot on pages already written."""

    def __init__(self, pool: PagePool, block_size: int, num_slots: int):
        self.pool = pool
        super().__init__(pool.num_pages, block_size, num_slots)

    @property
    def free(self) -> list[int]:  # the pool's free pages (the base class sets a list: ignored)
        return list(self.pool.free)

    @free.setter
    def free(self, value) -> None:
        pass

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def check_append(self, slots, counts) -> None:
        slots, counts = list(slots), list(counts)
        need = sum(self.needed(s, c) for s, c in zip(slots, counts, strict=True))
        if need > self.pool.num_free:
            raise ValueError(
                f"out of blocks: appending {counts} tokens to slots {slots} needs {need} more blocks of "
                f"{self.block_size} tokens, {self.pool.num_free} of {self.num_blocks} are free"
            )

    def append(self, slot: int, new_tokens: int) -> list[int]:
        grow = self.needed(slot, new_tokens)
        if grow > self.pool.num_free:
            raise ValueError(f"out of blocks: slot {slot} needs {grow}, {self.pool.num_free} are free")
        table = self.tables[slot]
        evicted = []  # (page, the cached hash its allocation evicted or None), for `undo`
        for _ in range(grow):
            h = self.pool.hash_of.get(next(iter(self.pool.free)))
            table.append(self.pool.allocate())
            evicted.append((table[-1], h))
        start = self.tokens[slot]
        self._record("append", slot, grow, (start, evicted))
        self.tokens[slot] = start + new_tokens
        size = self.block_size
        return [table[t // size] * size + t % size for t in range(start, start + new_tokens)]

    def truncate(self, slot: int, tokens: int) -> list[int]:
        if not 0 <= tokens <= self.tokens[slot]:
            raise ValueError(f"slot {slot} holds {self.tokens[slot]} tokens, cannot keep {tokens}")
        table = self.tables[slot]
        keep = blocks_for(tokens, self.block_size)
        dropped = table[keep:]
        self._record("truncate", slot, len(dropped), (self.tokens[slot], list(dropped)))
        del table[keep:]
        for page in reversed(dropped):
            self.pool.drop(page)
        self.tokens[slot] = tokens
        return dropped

    def undo(self, journal: list) -> None:
        """Take back the appends and truncations recorded in `journal`, newest first: reference counts,
        the free list's order, the prefix index (pages an append evicted are findable again), tables and
        token counts are as they were before the first."""
        pool = self.pool
        for op, slot, _blocks, (tokens, pages) in reversed(journal):
            table = self.tables[slot]
            if op == "append":
                del table[len(table) - len(pages) :]
                for page, h in reversed(pages):  # allocate popped each from the front of the free list
                    pool.refs[page] = 0
                    pool.free[page] = None
                    pool.free.move_to_end(page, last=False)
                    if h is not None:
                        pool.hash_of[page], pool.page_of[h] = h, page
            else:
                for page in pages:  # dropped newest first: re-held oldest first
                    if pool.refs[page] == 0:
                        del pool.free[page]
                    pool.refs[page] += 1
                table.extend(pages)
            self.tokens[slot] = tokens
        journal.clear()

    def adopt(self, slot: int, pages: Sequence[int], tokens: int) -> None:
        """Start the empty `slot` on `pages` (already written, whole): one more reference each."""
        if self.tables[slot] or self.tokens[slot]:
            raise ValueError(f"slot {slot} is not empty")
        if tokens != len(pages) * self.block_size:
            raise ValueError(f"{tokens} tokens do not fill {len(pages)} pages of {self.block_size}")
        for page in pages:
            self.pool.hold(page)
        self.tables[slot] = list(pages)
        self.tokens[slot] = tokens

    def shuffle(self, seed: int) -> None:
        raise ValueError("a shared pool's free list keeps its LRU order")

    def check(self) -> None:
        """Every page's reference count equals the tables that hold it (plus `extra` holds)."""
        self.pool.check()
        for slot, (table, tokens) in enumerate(zip(self.tables, self.tokens, strict=True)):
            if len(table) != blocks_for(tokens, self.block_size):
                raise AssertionError(f"slot {slot} holds {tokens} tokens in {len(table)} blocks")

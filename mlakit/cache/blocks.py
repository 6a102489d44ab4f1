"""BlockPool: the pages of a paged cache, who holds them, and which prefix a cached one holds.
Plain Python over integers, no tensors.

A slot holding `n` tokens owns `ceil(n / block_size)` pages, listed in `tables[slot]` in token order:
token `t` lives at row `t % block_size` of page `tables[slot][t // block_size]`. Pages may be shared:
`refs[p]` counts the tables listing p plus the holds on it (`hold`: pages kept for a slot not yet
started, a fork's prompt). A page nothing references is free; `free` lists them in the order they are
handed out: pages holding nothing first (the last freed first), then pages a prefix hash still finds
(`register`, `lookup`), the least recently freed first: handing one out evicts its hash. A pool with
no hash registered is a last-in-first-out free list.

`begin` records every change until `end`; `undo` takes them back: reference counts, holds, the free
queue's order, the prefix map (evicted hashes included), tables and token counts as at `begin`.
"""

from __future__ import annotations

import random
from bisect import bisect
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import partial


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` tokens."""
    return -(-tokens // block_size)


def _int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in {lo}..{hi}, got {value!r}")
    return value


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        from mlakit.cache.checks import check_allocation

        # per page a count, a queue entry and an order key, a table per slot: refused before building
        check_allocation(
            f"BlockPool(num_blocks={num_blocks}, num_slots={num_slots})",
            40 * num_blocks + 128 * num_slots,
            "cpu",
            "num_blocks or num_slots",
        )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.holds: dict[int, int] = {}  # page -> references held outside any table
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # order keys, increasing along `free` (what `undo` puts a page back by); the next at each end
        self._key, self._front, self._back = list(range(num_blocks)), 0, num_blocks
        self.hash_of: dict[int, int] = {}
        self.page_of: dict[int, int] = {}
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        self.tokens = [0] * num_slots
        self._journal: list | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(num_blocks, block_size, num_slots)."""
        return self.num_blocks, self.block_size, len(self.tables)

    def __repr__(self) -> str:
        return "BlockPool(num_blocks={}, block_size={}, num_slots={})".format(*self.shape)

    @property
    def num_free(self) -> int:
        """Pages nothing references (cached ones included: evicted when handed out)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of pages referenced."""
        return self.num_used / self.num_blocks

    def _slot(self, slot) -> int:
        return _int("slot", slot, 0, len(self.tables) - 1)

    def needed(self, slot: int, new_tokens: int) -> int:
        """Pages `slot` must be given to take `new_tokens` more tokens."""
        return max(0, blocks_for(self.tokens[slot] + new_tokens, self.block_size) - len(self.tables[slot]))

    def append(self, slot: int, new_tokens: int) -> list[int]:
        """Give `slot` room for `new_tokens` more tokens; returns their flat rows (page·size + offset).
        Refused when the free pages are too few, or when the slot's partly filled last page is shared."""
        slot, size = self._slot(slot), self.block_size
        new_tokens = _int("new_tokens", new_tokens, 0, self.num_blocks * size)
        table, start = self.tables[slot], self.tokens[slot]
        grow = self.needed(slot, new_tokens)
        if grow > len(self.free):
            raise ValueError(
                f"new_tokens {new_tokens}: out of blocks, slot {slot} needs {grow}, {len(self.free)} are free"
            )
        last = table[-1] if new_tokens and start % size else None
        if last is not None and self.refs[last] > 1:
            raise ValueError(f"slot {slot}: its partly filled last page {last} is shared, cannot write it")
        if last in self.hash_of:
            self._map(last, None)  # rows of it are rewritten: no longer the prefix its hash names
        pages = [self._allocate() for _ in range(grow)]
        self._table(slot, len(table), pages, start + new_tokens)
        return [table[t // size] * size + t % size for t in range(start, start + new_tokens)]

    def _allocate(self) -> int:
        page = next(iter(self.free))
        self._ref(page, 1)  # off the front of the free queue
        if page in self.hash_of:
            self._map(page, None)  # evicted: the least recently used cached page
        return page

    def truncate(self, slot: int, tokens: int) -> list[int]:
        """Keep the first `tokens` tokens of `slot`; drops its references to the pages no longer used
        (the last first: a cached prefix is evicted from its end) and returns those pages."""
        slot = self._slot(slot)
        tokens = _int("tokens", tokens, 0, self.tokens[slot])
        keep = blocks_for(tokens, self.block_size)
        dropped = self.tables[slot][keep:]
        self._table(slot, keep, [], tokens)
        for page in reversed(dropped):
            self._ref(page, -1)
        return dropped

    def release(self, slot: int) -> list[int]:
        """Drop every page of `slot`."""
        return self.truncate(slot, 0)

    def _readable(self, name: str, pages: Iterable[int]) -> list[int]:
        pages = list(pages)
        for p in pages:
            _int(name, p, 0, self.num_blocks - 1)
        lost = [p for p in pages if self.refs[p] == 0 and p not in self.hash_of]
        if lost:
            raise ValueError(f"{name} {lost}: free pages no prefix hash names hold nothing to share")
        return pages

    def adopt(self, slot: int, pages: Sequence[int], tokens: int) -> None:
        """Start the empty `slot` on `pages` (whole pages already written, held or cached): one more
        reference each; the slot holds `tokens` = len(pages)·block_size tokens."""
        slot = self._slot(slot)
        if self.tables[slot] or self.tokens[slot]:
            raise ValueError(f"slot {slot} holds {self.tokens[slot]} tokens, expected an empty slot")
        pages = self._readable("pages", pages)
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} has duplicates")
        if tokens != len(pages) * self.block_size or isinstance(tokens, bool):
            raise ValueError(
                f"tokens {tokens!r}: expected {len(pages) * self.block_size}, the {len(pages)} whole pages"
            )
        for page in pages:
            self._ref(page, 1)
        self._table(slot, 0, pages, tokens)

    def hold(self, page: int) -> None:
        """One more reference to `page` (held or cached) outside any table, until `drop(page)`."""
        (page,) = self._readable("page", [page])
        self._ref(page, 1, hold=True)

    def drop(self, page: int) -> None:
        """Give back one `hold` of `page`."""
        if not self.holds.get(_int("page", page, 0, self.num_blocks - 1)):
            raise ValueError(f"page {page} has no hold to drop")
        self._ref(page, -1, hold=True)

    def register(self, page: int, h: int) -> None:
        """The referenced `page` holds the whole page whose prefix hash is `h`; a hash or a page already
        in the map keeps its first entry (the same prefix computed twice)."""
        if self.refs[_int("page", page, 0, self.num_blocks - 1)] == 0:
            raise ValueError(f"page {page} is free: only a referenced page can be registered")
        if not isinstance(h, int) or isinstance(h, bool):
            raise ValueError(f"h must be an integer hash, got {h!r}")
        if h not in self.page_of and page not in self.hash_of:
            self._map(page, h)

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """Pages of the longest leading run of `hashes` the map holds (not held: the caller adopts)."""
        out = []
        for h in hashes:
            if h not in self.page_of:
                break
            out.append(self.page_of[h])
        return out

    # every change goes through these five; while a journal is open each records its inverse

    def _log(self, inverse) -> None:
        if self._journal is not None:
            self._journal.append(inverse)

    def _ref(self, page: int, delta: int, hold: bool = False) -> None:
        self._log(partial(self._count, page, -delta, hold))
        if self.refs[page] == 0:
            self._take(page)
        self._count(page, delta, hold)
        if self.refs[page] == 0:
            self._put(page)

    def _count(self, page: int, delta: int, hold: bool) -> None:
        self.refs[page] += delta
        if hold and (n := self.holds.pop(page, 0) + delta):
            self.holds[page] = n

    def _take(self, page: int) -> None:
        self._log(partial(self._reinsert, page, self._key[page]))
        del self.free[page]

    def _put(self, page: int) -> None:
        """Free `page`: at the front when it holds nothing, else at the back (evicted last)."""
        back = page in self.hash_of
        self._log(partial(self.free.__delitem__, page))
        self.free[page] = None
        if back:
            self._key[page], self._back = self._back, self._back + 1
        else:
            self._front = self._key[page] = self._front - 1
            self.free.move_to_end(page, last=False)

    def _map(self, page: int, h: int | None) -> None:
        self._log(partial(self._map, page, self.hash_of.get(page)))
        if h is None:
            del self.page_of[self.hash_of.pop(page)]
        else:
            self.hash_of[page], self.page_of[h] = h, page

    def _table(self, slot: int, keep: int, pages: list[int], tokens: int) -> None:
        table = self.tables[slot]
        self._log(partial(self._table, slot, keep, table[keep:], self.tokens[slot]))
        del table[keep:]
        table.extend(pages)
        self.tokens[slot] = tokens

    def _reinsert(self, page: int, key: int) -> None:
        """Put `page` back into the free queue at the place of its order key."""
        self._key[page], free = key, self.free
        if not free or key < self._key[next(iter(free))]:
            free[page] = None
            free.move_to_end(page, last=False)
        elif key > self._key[next(reversed(free))]:
            free[page] = None
        else:  # from the middle (a cached page taken by a hit): rare, rebuilt
            order = list(free)
            order.insert(bisect([self._key[p] for p in order], key), page)
            free.clear()
            free.update(dict.fromkeys(order))

    def begin(self) -> None:
        """Record every change from now on (a journal still open is dropped)."""
        self._journal = []

    def end(self) -> None:
        """Keep the changes recorded since `begin`; stop recording."""
        self._journal = None

    def undo(self) -> None:
        """Take back every change since `begin`, newest first; stop recording."""
        journal, self._journal = self._journal or [], None
        for inverse in reversed(journal):
            inverse()

    def shuffle(self, seed: int) -> None:
        """Reorder the free pages that hold nothing (a seeded permutation; cached ones keep their LRU
        order). Tests use it so that a slot's pages are never consecutive by accident."""
        if self._journal is not None:
            raise ValueError("shuffle while changes are recorded (begin ... end): it cannot be undone")
        empty = [p for p in self.free if p not in self.hash_of]
        keys = sorted(self._key[p] for p in empty)
        random.Random(seed).shuffle(empty)
        for p, k in zip(empty, keys, strict=True):
            self._key[p] = k
        order = empty + [p for p in self.free if p in self.hash_of]
        self.free.clear()
        self.free.update(dict.fromkeys(order))

    def check(self) -> None:
        """Every invariant: references = table entries + holds; free exactly when unreferenced, in order
        (empty pages before cached ones, order keys increasing); the prefix map one to one; every
        table as long as its tokens need, without repeats."""
        count = [self.holds.get(p, 0) for p in range(self.num_blocks)]
        for slot, (table, tokens) in enumerate(zip(self.tables, self.tokens, strict=True)):
            if len(table) != blocks_for(tokens, self.block_size) or len(set(table)) != len(table):
                raise AssertionError(f"slot {slot} holds {tokens} tokens in pages {table}")
            for p in table:
                count[p] += 1
        if count != self.refs or any(h <= 0 for h in self.holds.values()):
            bad = [p for p in range(self.num_blocks) if count[p] != self.refs[p]]
            raise AssertionError(f"reference counts wrong for pages {bad[:8]} (holds {self.holds})")
        if [p for p in range(self.num_blocks) if not self.refs[p]] != sorted(self.free):
            raise AssertionError(f"free pages {sorted(self.free)} are not the unreferenced ones")
        keys = [self._key[p] for p in self.free]
        cached = [p in self.hash_of for p in self.free]
        if keys != sorted(set(keys)) or cached != sorted(cached):
            raise AssertionError(f"free queue out of order: {list(self.free)}")
        if {p: h for h, p in self.page_of.items()} != self.hash_of or len(self.page_of) != len(self.hash_of):
            raise AssertionError("prefix map inconsistent")

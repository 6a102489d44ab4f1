"""BlockPool: hand-out order, token rows, shared pages, the prefix map's LRU eviction, undo; and a seeded
random driver (allocate, truncate, share/adopt, fork holds, register/lookup with eviction under churn,
undo, release, refused calls) against a reference model of the pool, compared after every operation."""

from __future__ import annotations

import random

import pytest

from mlakit.cache.blocks import BlockPool


def pool_state(m) -> tuple:
    """Everything that decides what the pool does next (the free queue's order included)."""
    return (
        list(m.free),
        list(m.refs),
        dict(m.holds),
        dict(m.hash_of),
        dict(m.page_of),
        [list(t) for t in m.tables],
        list(m.tokens),
    )


# hand-out order and token rows


def test_hands_out_in_order_and_maps_tokens_to_rows():
    m = BlockPool(num_blocks=4, block_size=3, num_slots=2)
    assert m.append(0, 4) == [0, 1, 2, 3]  # block 0 rows 0-2, block 1 row 0
    assert m.append(1, 1) == [6]  # block 2
    assert m.append(0, 2) == [4, 5]  # fills block 1 exactly: no new block
    assert m.tables == [[0, 1], [2]] and m.tokens == [6, 1] and m.num_free == 1
    assert m.needed(0, 1) == 1 and m.needed(1, 2) == 0 and m.usage == 0.75
    m.check()


def test_truncate_frees_whole_blocks_last_in_first_out():
    m = BlockPool(num_blocks=6, block_size=2, num_slots=2)
    m.append(0, 5)  # blocks 0, 1, 2
    assert m.truncate(0, 3) == [2]  # 3 tokens still need 2 blocks
    assert m.truncate(0, 2) == [1]
    assert m.truncate(0, 2) == []
    assert m.release(0) == [0]
    assert list(m.free)[:3] == [0, 1, 2]
    assert m.append(1, 1) == [0]  # the last block freed is handed out first
    m.check()


def test_out_of_blocks_is_refused_before_any_change():
    m = BlockPool(num_blocks=3, block_size=2, num_slots=2)
    m.append(0, 1)
    before = pool_state(m)
    with pytest.raises(ValueError, match="new_tokens 6: out of blocks, slot 1 needs 3, 2 are free"):
        m.append(1, 6)
    assert pool_state(m) == before


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.truncate(1, 1), r"tokens must be an integer in 0..0, got 1"),
        (lambda m: m.append(2, 1), r"slot must be an integer in 0..1, got 2"),
        (lambda m: m.append(0, -1), r"new_tokens must be an integer in 0..8, got -1"),
        (lambda m: m.append(True, 1), r"slot must be an integer in 0..1, got True"),
        (lambda m: m.hold(1), r"page \[1\]: free pages no prefix hash names hold nothing"),
        (lambda m: m.drop(0), r"page 0 has no hold to drop"),
        (lambda m: m.register(1, 5), r"page 1 is free: only a referenced page can be registered"),
        (lambda m: m.register(0, "h"), r"h must be an integer hash, got 'h'"),
        (lambda m: m.adopt(0, [], 0), r"slot 0 holds 4 tokens, expected an empty slot"),
        (lambda m: m.adopt(1, [0, 0], 8), r"pages \[0, 0\] has duplicates"),
        (lambda m: m.adopt(1, [0], 3), r"tokens 3: expected 4, the 1 whole pages"),
        (lambda m: m.adopt(1, [7], 4), r"pages must be an integer in 0..1, got 7"),
    ],
)
def test_refusals_name_the_argument_and_change_nothing(call, match):
    m = BlockPool(num_blocks=2, block_size=4, num_slots=2)
    m.append(0, 4)  # slot 0 holds page 0, page 1 is free and holds nothing
    before = pool_state(m)
    with pytest.raises(ValueError, match=match):
        call(m)
    assert pool_state(m) == before
    m.check()


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks must be a positive integer, got 0"):
        BlockPool(0, 4, 1)
    with pytest.raises(ValueError, match="num_slots must be a positive integer, got True"):
        BlockPool(2, 4, True)


def test_shuffled_free_list_is_a_permutation_and_cached_pages_keep_their_order():
    m = BlockPool(num_blocks=50, block_size=1, num_slots=1)
    m.shuffle(3)
    assert sorted(m.free) == list(range(50)) and list(m.free) != list(range(50))
    m.check()
    m.append(0, 3)
    pages = list(m.tables[0])
    for i, p in enumerate(pages):
        m.register(p, 100 + i)
    m.release(0)
    m.shuffle(4)
    assert list(m.free)[-3:] == pages[::-1]  # cached, evicted from the prefix's end
    m.check()
    m.begin()
    with pytest.raises(ValueError, match="shuffle while changes are recorded"):
        m.shuffle(5)


# shared pages and the prefix map


def test_prefix_map_evicts_the_least_recently_used_cached_page():
    pool = BlockPool(3, 1, 3)
    pool.append(0, 1)
    pool.append(1, 1)
    p, q = pool.tables[0][0], pool.tables[1][0]
    pool.register(p, 11)
    pool.release(0)
    pool.release(1)  # no hash: handed out first
    assert list(pool.free) == [q, 2, p] and pool.lookup([11, 12]) == [p]
    assert pool.append(2, 1) == [q]
    pool.append(1, 1)
    assert pool.append(0, 1) == [p] and pool.lookup([11]) == []  # evicted, least recently used
    pool.check()


def test_a_cached_page_is_shared_by_adopt_and_hold():
    pool = BlockPool(4, 2, 3)
    pool.append(0, 4)
    a, b = pool.tables[0]
    pool.register(a, 1)
    pool.register(b, 2)
    pool.register(a, 3)  # a page already known: keeps its first hash
    pool.release(0)
    assert pool.lookup([1, 2, 9]) == [a, b] and pool.hash_of == {a: 1, b: 2}
    pool.adopt(1, [a, b], 4)
    pool.hold(a)  # a fork of slot 1's first page
    assert pool.refs[a] == 2 and pool.holds == {a: 1} and pool.num_free == 2
    pool.release(1)
    assert pool.refs == [1 if p == a else 0 for p in range(4)] and b in pool.free
    pool.adopt(2, [a], 2)
    pool.drop(a)
    assert pool.refs[a] == 1 and not pool.holds
    pool.check()


def test_a_shared_partial_page_is_not_written_and_a_rewritten_page_loses_its_hash():
    pool = BlockPool(4, 2, 2)
    pool.append(0, 2)
    (p,) = pool.tables[0]
    pool.register(p, 5)
    pool.adopt(1, [p], 2)
    pool.truncate(1, 1)  # slot 1 keeps half of the shared page
    with pytest.raises(ValueError, match=f"slot 1: its partly filled last page {p} is shared"):
        pool.append(1, 1)
    pool.release(0)
    assert pool.append(1, 1) == [2 * p + 1] and pool.lookup([5]) == []  # rewritten: unregistered
    pool.check()


def test_undo_restores_refcounts_free_order_evicted_hashes_tables_and_tokens():
    pool = BlockPool(6, 4, 3)
    pool.append(0, 8)
    pool.adopt(1, pool.tables[0], 8)  # two pages held twice
    pool.append(2, 4)
    pool.register(pool.tables[2][0], 111)
    pool.truncate(2, 0)  # a cached free page (evicted when handed out again)
    pool.append(1, 2)
    before = pool_state(pool)
    pool.begin()
    pool.truncate(1, 4)  # drops a private page and a shared one
    pool.truncate(0, 0)
    pool.append(2, 16)  # takes every free page: evicts the cached one
    pool.undo()
    assert pool_state(pool) == before
    pool.check()


# the random driver


class Model:
    """The pool as plain lists and dicts: `free` a list in hand-out order; undo restores a copy."""

    def __init__(self, n: int, size: int, slots: int):
        self.n, self.size = n, size
        self.free, self.refs, self.holds = list(range(n)), [0] * n, {}
        self.hash_of, self.page_of = {}, {}
        self.tables, self.tokens = [[] for _ in range(slots)], [0] * slots
        self.saved = None

    def ref(self, p: int) -> None:
        if self.refs[p] == 0:
            self.free.remove(p)
        self.refs[p] += 1

    def unref(self, p: int) -> None:
        self.refs[p] -= 1
        if self.refs[p] == 0:  # nothing in it: reused first; cached: after every other free page
            self.free.insert(len(self.free) if p in self.hash_of else 0, p)

    def unhash(self, p: int) -> None:
        if p in self.hash_of:
            del self.page_of[self.hash_of.pop(p)]

    def readable(self, p: int) -> bool:
        return self.refs[p] > 0 or p in self.hash_of

    def append(self, slot: int, n: int):
        table, t, size = self.tables[slot], self.tokens[slot], self.size
        grow = -(-(t + n) // size) - len(table)
        if grow > len(self.free) or (n and t % size and self.refs[table[-1]] > 1):
            return None
        if n and t % size:
            self.unhash(table[-1])
        for _ in range(grow):
            p = self.free.pop(0)
            self.unhash(p)
            self.refs[p] = 1
            table.append(p)
        self.tokens[slot] = t + n
        return [table[i // size] * size + i % size for i in range(t, t + n)]

    def truncate(self, slot: int, tokens: int):
        if not 0 <= tokens <= self.tokens[slot]:
            return None
        keep = -(-tokens // self.size)
        dropped = self.tables[slot][keep:]
        del self.tables[slot][keep:]
        for p in reversed(dropped):
            self.unref(p)
        self.tokens[slot] = tokens
        return dropped

    def adopt(self, slot: int, pages: list[int], tokens: int):
        ok = not self.tables[slot] and not self.tokens[slot] and len(set(pages)) == len(pages)
        if not ok or tokens != len(pages) * self.size or not all(map(self.readable, pages)):
            return None
        for p in pages:
            self.ref(p)
        self.tables[slot], self.tokens[slot] = list(pages), tokens
        return True

    def hold(self, p: int):
        if not self.readable(p):
            return None
        self.ref(p)
        self.holds[p] = self.holds.get(p, 0) + 1
        return True

    def drop(self, p: int):
        if not self.holds.get(p):
            return None
        self.holds[p] -= 1
        if not self.holds[p]:
            del self.holds[p]
        self.unref(p)
        return True

    def register(self, p: int, h: int):
        if self.refs[p] == 0:
            return None
        if h not in self.page_of and p not in self.hash_of:
            self.hash_of[p], self.page_of[h] = h, p
        return True

    def lookup(self, hashes: list[int]) -> list[int]:
        out = []
        for h in hashes:
            if h not in self.page_of:
                break
            out.append(self.page_of[h])
        return out

    def shuffle(self, seed: int):
        if self.saved is not None:
            return None
        empty = [p for p in self.free if p not in self.hash_of]
        random.Random(seed).shuffle(empty)
        self.free = empty + [p for p in self.free if p in self.hash_of]
        return True

    def begin(self):
        self.saved = pool_state(self)
        return True

    def end(self):
        self.saved = None
        return True

    def undo(self):
        free, self.refs, self.holds, self.hash_of, self.page_of, self.tables, self.tokens = self.saved or (
            pool_state(self)
        )
        self.free, self.saved = free, None
        return True


def random_call(rng: random.Random, model: Model, slots: int) -> tuple[str, tuple]:
    """One operation with arguments that mostly make sense (and sometimes do not)."""
    size = model.size
    slot = rng.randrange(slots)
    held = [p for t in model.tables for p in t] + list(model.holds)
    cached = list(model.hash_of)
    pick = rng.random()
    if pick < 0.25:
        return "append", (slot, rng.choice([0, 1, 1, 2, size, size + 1, 3 * size, 20 * size]))
    if pick < 0.38:
        return "truncate", (slot, rng.randint(0, model.tokens[slot] + (rng.random() < 0.1)))
    if pick < 0.45:
        return "truncate", (slot, 0)  # release
    if pick < 0.55:
        whole = model.tokens[slot] // size
        if whole and rng.random() < 0.9:
            page = model.tables[slot][rng.randrange(whole)]
        else:
            page = rng.randrange(model.n)
        return "register", (page, rng.randrange(12))  # few hashes: the same prefix computed twice
    if pick < 0.67:
        empty = [s for s in range(slots) if not model.tokens[s]] or [slot]
        source = rng.choice(["hit", "other", "junk"])
        if source == "hit":
            pages = model.lookup(rng.sample(range(12), 12))
        elif source == "other":
            other = rng.randrange(slots)
            pages = model.tables[other][: model.tokens[other] // size]
        else:
            pages = [rng.randrange(model.n) for _ in range(rng.randint(0, 2))]
        pages = pages[: rng.randint(0, len(pages))]
        tokens = len(pages) * size + (rng.random() < 0.05)
        return "adopt", (rng.choice(empty), pages, tokens)
    if pick < 0.75:
        choices = held + cached if rng.random() < 0.9 else [rng.randrange(model.n)]
        return "hold", (rng.choice(choices or [0]),)
    if pick < 0.83:
        choices = list(model.holds) if rng.random() < 0.9 else [rng.randrange(model.n)]
        return "drop", (rng.choice(choices or [0]),)
    if pick < 0.86:
        return "lookup", (rng.sample(range(12), rng.randint(0, 4)),)
    if pick < 0.88:
        return "shuffle", (rng.randrange(1000),)
    if model.saved is None:
        return "begin", ()
    return rng.choice(["undo", "undo", "end"]), ()


DONE = {"adopt", "hold", "drop", "register", "shuffle", "begin", "end", "undo"}  # these return None


@pytest.mark.parametrize(
    "seed, num_blocks, block_size, slots",
    [(0, 12, 2, 4), (1, 12, 3, 4), (2, 7, 1, 3), (3, 16, 4, 5), (4, 9, 2, 6)],
)
def test_random_driver_matches_the_reference_model(seed, num_blocks, block_size, slots):
    rng = random.Random(seed)
    pool, model = BlockPool(num_blocks, block_size, slots), Model(num_blocks, block_size, slots)
    seen = dict.fromkeys(["refused", "evicted", "undone", "shared", "hit"], 0)
    for step in range(3000):
        op, args = random_call(rng, model, slots)
        cached = set(model.hash_of)
        want = getattr(model, op)(*args)
        if want is None:
            seen["refused"] += 1
            before = pool_state(pool)
            with pytest.raises(ValueError):
                getattr(pool, op)(*args)
            assert pool_state(pool) == before, f"step {step}: a refused {op}{args} changed the pool"
        else:
            got = getattr(pool, op)(*args)
            assert (got is None) if op in DONE else (got == want), f"step {step}: {op}{args}"
        assert pool_state(pool) == pool_state(model), f"step {step}: {op}{args}"
        pool.check()
        seen["evicted"] += op == "append" and want is not None and bool(cached - set(model.hash_of))
        seen["undone"] += op == "undo"
        seen["shared"] += any(r > 1 for r in model.refs)
        seen["hit"] += op == "adopt" and want is not None and any(p in cached for p in args[1])
    # every kind of event happened, many times
    assert min(seen.values()) >= 20, seen

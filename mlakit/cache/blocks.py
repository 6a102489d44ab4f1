"""BlockManager: which pages of a paged cache each slot owns. Plain Python, no tensors.

A slot holding `n` tokens owns `ceil(n / block_size)` blocks, listed in its block table in token
order: token `t` of the slot lives at row `t % block_size` of block `table[t // block_size]`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` tokens."""
    return -(-tokens // block_size)


class BlockManager:
    """Free list and per-slot block tables of a pool of `num_blocks` blocks of `block_size` tokens.

    `tokens[slot]` counts the tokens written to a slot. Freed blocks go to the end of the free list
    and are handed out first (last in, first out); `shuffle` reorders the free list (tests use it so
    that a slot's blocks are never consecutive by accident).
    """

    def __init__(self, num_blocks: int, block_size: int, num_slots: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        from mlakit.cache.checks import check_allocation

        # a free-list entry per block and a table per slot, on the host: refused before building them
        check_allocation(
            f"BlockManager(num_blocks={num_blocks}, num_slots={num_slots})",
            40 * num_blocks + 128 * num_slots,
            "cpu",
            "num_blocks or num_slots",
        )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # popped from the end: a fresh pool hands out blocks 0, 1, 2, ...
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        self.tokens: list[int] = [0] * num_slots
        # while a list: every append / truncate is recorded there, so that `undo` can take it back
        self.journal: list | None = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    def needed(self, slot: int, new_tokens: int) -> int:
        """Blocks `slot` must be given to take `new_tokens` more tokens."""
        total = blocks_for(self.tokens[slot] + new_tokens, self.block_size)
        return max(0, total - len(self.tables[slot]))

    def check_append(self, slots: Iterable[int], counts: Iterable[int]) -> None:
        """Raise ValueError, changing nothing, if the free list cannot take every row's new tokens."""
        slots, counts = list(slots), list(counts)
        need = sum(self.needed(s, c) for s, c in zip(slots, counts, strict=True))
        if need > len(self.free):
            raise ValueError(
                f"out of blocks: appending {counts} tokens to slots {slots} needs {need} more blocks of "
                f"{self.block_size} tokens, {len(self.free)} of {self.num_blocks} are free"
            )

    def append(self, slot: int, new_tokens: int) -> list[int]:
        """Give `slot` room for `new_tokens` more tokens; returns their flat rows (block·size + offset)."""
        grow = self.needed(slot, new_tokens)
        if grow > len(self.free):
            raise ValueError(f"out of blocks: slot {slot} needs {grow}, {len(self.free)} are free")
        table = self.tables[slot]
        table.extend(self.free.pop() for _ in range(grow))
        start = self.tokens[slot]
        self._record("append", slot, grow, start)
        self.tokens[slot] = start + new_tokens
        size = self.block_size
        return [table[t // size] * size + t % size for t in range(start, start + new_tokens)]

    def truncate(self, slot: int, tokens: int) -> list[int]:
        """Keep the first `tokens` tokens of `slot`; frees whole blocks no longer used, returns them."""
        if not 0 <= tokens <= self.tokens[slot]:
            raise ValueError(f"slot {slot} holds {self.tokens[slot]} tokens, cannot keep {tokens}")
        table = self.tables[slot]
        keep = blocks_for(tokens, self.block_size)
        freed = table[keep:]
        self._record("truncate", slot, len(freed), self.tokens[slot])
        del table[keep:]
        self.free.extend(reversed(freed))
        self.tokens[slot] = tokens
        return freed

    def _record(self, op: str, slot: int, blocks: int, tokens: int) -> None:
        if getattr(self, "journal", None) is not None:
            self.journal.append((op, slot, blocks, tokens))

    def undo(self, journal: list) -> None:
        """Take back the appends and truncations recorded in `journal`, newest first: the free list,
        tables and token counts are as they were before the first (the same blocks in the same order)."""
        for op, slot, blocks, tokens in reversed(journal):
            table = self.tables[slot]
            if op == "append":
                moved = table[len(table) - blocks :]
                del table[len(table) - blocks :]
                self.free.extend(reversed(moved))
            else:
                moved = self.free[len(self.free) - blocks :]
                del self.free[len(self.free) - blocks :]
                table.extend(reversed(moved))
            self.tokens[slot] = tokens
        journal.clear()

    def release(self, slot: int) -> list[int]:
        """Free every block of `slot`."""
        return self.truncate(slot, 0)

    def shuffle(self, seed: int) -> None:
        """Reorder the free list (a seeded permutation)."""
        random.Random(seed).shuffle(self.free)

    def check(self) -> None:
        """Every block is either free or in exactly one table; tables match token counts."""
        owned = [b for table in self.tables for b in table]
        seen = sorted(owned + self.free)
        if seen != list(range(self.num_blocks)):
            raise AssertionError(f"blocks lost or shared: owned {sorted(owned)}, free {sorted(self.free)}")
        for slot, (table, tokens) in enumerate(zip(self.tables, self.tokens, strict=True)):
            if len(table) != blocks_for(tokens, self.block_size):
                raise AssertionError(f"slot {slot} holds {tokens} tokens in {len(table)} blocks")

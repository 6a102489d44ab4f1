"""The sweep: cells of (batch, new tokens, cached tokens) and the default and quick grids."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Cell:
    batch: int  # sequences stepped together
    cached: int  # tokens already in each sequence's cache before the step
    new: int  # tokens the step appends and attends with (1: decode)

    def __post_init__(self) -> None:
        for name, low in (("batch", 1), ("cached", 0), ("new", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"cell {name} must be an integer >= {low}, got {v!r}")

    @property
    def label(self) -> str:
        return f"B{self.batch}-T{self.cached}-S{self.new}"


@dataclass(frozen=True)
class Grid:
    batch: tuple[int, ...]
    context: tuple[int, ...]  # cached tokens
    new: tuple[int, ...]

    def __post_init__(self) -> None:
        for name, low in (("batch", 1), ("context", 0), ("new", 1)):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"--{name} needs at least one value")
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < low]
            if bad:
                raise ValueError(f"--{name} values must be integers >= {low}, got {list(values)}")
            object.__setattr__(self, name, tuple(sorted(set(values))))

    def cells(self) -> list[Cell]:
        """Every cell: by batch, then cached tokens, then new tokens."""
        return [Cell(b, t, n) for b in self.batch for t in self.context for n in self.new]

    @property
    def decode_new(self) -> int:
        """The new-token count the decode-only baselines run at: the grid's smallest."""
        return self.new[0]


# at DeepSeek-V3 widths a layer step of 128 new tokens is ~60 GFLOP, seconds on a shared 2-core CPU:
# the default grid (two contexts, decode to 128 new tokens) stays under 3 minutes there
DEFAULT_GRID = Grid(batch=(1,), context=(256, 1024), new=(1, 16, 128))
QUICK_GRID = Grid(batch=(1,), context=(256,), new=(1, 16, 64))


def parse_ints(text: str, name: str) -> tuple[int, ...]:
    """'1,8' or '1K,4k' → (1, 8) or (1024, 4096); ValueError naming the flag otherwise."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit():
            raise ValueError(f"--{name} takes comma-separated integers (1K = 1024), got {text!r}")
        out.append(int(digits) * scale)
    return tuple(out)

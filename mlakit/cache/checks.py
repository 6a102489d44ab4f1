"""Argument checks every cache shares: slot lists, new-token counts, sizes before allocating.

Each turns what a caller passed into plain Python ints (or refuses with a ValueError naming the
argument, what it got and what it expected) before any tensor of the cache is touched.
"""

from __future__ import annotations

import numbers
import os

import torch

# new tokens of one row in one step: far past any cache, small enough for an int64 sum
MAX_TOKENS = 2**31 - 1


def int_list(value, name: str) -> list[int]:
    """`value` as a list of Python ints: a Python or numpy integer, a flat list/tuple of them, a 0-d
    or 1-d integer tensor or numpy array. Sets, dicts, strings, floats, complex numbers, bools,
    nested lists and meta tensors are refused."""
    if isinstance(value, torch.Tensor):
        return _tensor_ints(value, name)
    if hasattr(value, "__array__") and hasattr(value, "dtype") and not isinstance(value, numbers.Number):
        return _tensor_ints(_numpy_tensor(value, name), name)
    if _is_int(value):
        return [int(value)]
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"{name} must be integers (a list, tuple or integer tensor), got {type(value).__name__}"
        )
    bad = [v for v in value if not _is_int(v)]
    if bad:
        raise ValueError(f"{name} must be integers, got {bad[0]!r} ({type(bad[0]).__name__}) in {value!r}")
    return [int(v) for v in value]


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and type(v).__name__ != "bool_"


def _numpy_tensor(value, name: str) -> torch.Tensor:
    kind = getattr(value.dtype, "kind", "?")
    if kind not in "iu":
        raise ValueError(f"{name} must be integers, got an array of dtype {value.dtype}")
    return torch.as_tensor(value.astype("int64"))


def _tensor_ints(t: torch.Tensor, name: str) -> list[int]:
    if t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (no values); expected integers on a real device")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be integers, got dtype {t.dtype}")
    if t.dim() > 1:
        raise ValueError(f"{name} must be one integer per row, got a tensor of shape {tuple(t.shape)}")
    return [int(v) for v in t.reshape(-1).tolist()]


def check_slots(slots, rows: int, num_slots: int) -> list[int]:
    """Checked slot ids for `rows` batch rows (default: row b -> slot b)."""
    if slots is None:
        if rows > num_slots:
            raise ValueError(f"batch of {rows} rows without slots, but the cache has {num_slots}")
        return list(range(rows))
    s = int_list(slots, "slots")
    if len(s) != rows:
        raise ValueError(f"slots has {len(s)} entries, expected one per batch row ({rows})")
    if any(not 0 <= v < num_slots for v in s):
        raise ValueError(f"slots {s} out of range, expected 0..{num_slots - 1}")
    if len(set(s)) != len(s):
        raise ValueError(f"slots {s} has duplicates; each row needs its own slot")
    return s


def check_counts(new_tokens, rows: int | None, name: str = "new_tokens") -> tuple[list[int], bool]:
    """(count per row, whether one count was given for every row); every count >= 1."""
    single = _is_int(new_tokens)
    counts = int_list(new_tokens, name)
    if single:
        counts = counts * (rows if rows is not None else 1)
    elif rows is not None and len(counts) != rows:
        raise ValueError(f"{name} has {len(counts)} entries, expected one per batch row ({rows})")
    shown = counts[0] if single and counts else counts
    if not counts or min(counts) < 1:
        raise ValueError(f"appending {shown} tokens; {name} must be at least 1")
    if max(counts) > MAX_TOKENS:
        raise ValueError(f"{name} {shown} too large: at most {MAX_TOKENS} tokens per row and step")
    return counts, single


def check_slot(slot, num_slots: int) -> int:
    """One slot id (a Python or numpy integer) in range."""
    if not _is_int(slot) or not 0 <= int(slot) < num_slots:
        raise ValueError(f"slot {slot!r} out of range, expected 0..{num_slots - 1}")
    return int(slot)


def check_positive(name: str, value) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_compute_dtype(dtype) -> torch.dtype:
    """A cache's `dtype` is what its layers compute in: a floating-point type of 16 bits or more.
    Narrower rows are a format of the paged cache (`quant`), not a compute dtype."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(
            f"dtype must be a floating-point compute dtype of 16 bits or more (torch.bfloat16, float16, "
            f"float32, float64), got {dtype}; for int8 or fp8 rows keep the compute dtype and pass "
            "quant='int8' or quant='fp8' to PagedLatentCache"
        )
    return dtype


def memory_limit(device) -> int:
    """Bytes a cache may allocate on `device`: the device's total memory (host RAM for the CPU)."""
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(dev).total_memory
    if dev.type == "meta":
        return 1 << 62
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_allocation(what: str, nbytes: int, device, lower: str | None = None) -> None:
    """Refuse, before allocating, a cache larger than the memory of its device; `lower` names the
    arguments that size it."""
    limit = memory_limit(device)
    if nbytes > limit:
        hint = "" if lower is None else f"; lower {lower}"
        raise ValueError(
            f"{what} would take {nbytes:,} bytes ({nbytes / 2**30:.1f} GiB), more than the "
            f"{limit:,} bytes of {torch.device(device if device is not None else 'cpu')} memory{hint}"
        )

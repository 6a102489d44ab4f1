"""glibc's allocator told to keep a step's big buffers in the heap between steps.

A CPU step allocates and frees tens of megabytes of activations (a 2,048-token prefill: ~100 MB). By
default glibc serves each block above 128 KiB-32 MiB with a fresh mmap and gives it back on free, and
trims the heap's top once 128 KiB is free, so every step faults the same pages in again (the kernel
zeroes each one); threads other than the first get arenas of their own whose heaps stop at 64 MiB. On
the 2-core Xeon of docs/engine.md this cost a 2,048-token prefill ~15% of its time. `keep_heap` sets
what glibc's own GLIBC_TUNABLES would (no mmap for big blocks, no trimming, 256 MiB of slack at the
top, one arena), through mallopt, once per process: memory a step freed stays the process's for the
next step, as a server's would in a caching allocator. Where the user tunes malloc themselves
(GLIBC_TUNABLES naming malloc, or another allocator preloaded) or sets MLAKIT_MALLOC=system, or where
the C library is not glibc, nothing changes.
"""

from __future__ import annotations

import ctypes
import os

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 256 << 20), (M_ARENA_MAX, 1))

_DONE: list[str] = []


def _why_not() -> str | None:
    """Why the allocator is left as it is (None: it can be set)."""
    if os.environ.get("MLAKIT_MALLOC", "").lower() == "system":
        return "MLAKIT_MALLOC=system"
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return "allocator preloaded"
    return None


def keep_heap() -> str:
    """Set glibc's malloc to keep freed step buffers (once per process); a line saying what holds."""
    if _DONE:
        return _DONE[0]
    why = _why_not()
    if why is None:
        try:
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version.restype = ctypes.c_char_p
            libc.gnu_get_libc_version()
            ok = all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
            why = None if ok else "mallopt refused"
        except (OSError, AttributeError):
            why = "not glibc"
    _DONE.append("malloc keeps the heap" if why is None else f"malloc as the system's ({why})")
    return _DONE[0]

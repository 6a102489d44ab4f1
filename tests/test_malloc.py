"""keep_heap: glibc keeps a step's freed buffers (no mmap per big block, one arena), unless told not to."""

import os
import subprocess
import sys

import pytest

from mlakit.engine import malloc

# a 64 MiB tensor allocated and freed on a new thread: with the heap kept, glibc serves it from the
# main heap (no mmap'ed block); by default it is an mmap'ed block (hblks counts them)
PROBE = """
import ctypes, threading, torch
from mlakit.engine.malloc import keep_heap
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
print(keep_heap())
print(keep_heap())
seen = []
def work():
    before = libc.mallinfo2().hblks
    x = torch.empty(64 << 20, dtype=torch.uint8)
    seen.append(libc.mallinfo2().hblks - before)
    del x
t = threading.Thread(target=work)
t.start()
t.join()
print(seen[0])
"""


def _glibc() -> bool:
    try:
        import ctypes

        lib = ctypes.CDLL(None)
        return hasattr(lib, "gnu_get_libc_version") and hasattr(lib, "mallinfo2")
    except OSError:
        return False


def _probe(**env):
    full = {k: v for k, v in os.environ.items() if k not in ("MLAKIT_MALLOC", "GLIBC_TUNABLES", "LD_PRELOAD")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, check=True)
    return out.stdout.split("\n")[:3]


@pytest.mark.skipif(not _glibc(), reason="glibc (with mallinfo2) only")
def test_keep_heap_serves_big_blocks_from_the_heap_on_any_thread():
    first, second, mmapped = _probe()
    assert first == second == "malloc keeps the heap"
    assert mmapped == "0"


@pytest.mark.skipif(not _glibc(), reason="glibc (with mallinfo2) only")
def test_system_malloc_left_alone_when_asked():
    first, _, mmapped = _probe(MLAKIT_MALLOC="system")
    assert first == "malloc as the system's (MLAKIT_MALLOC=system)"
    assert mmapped == "1"  # glibc's default: a fresh mapping for the big block


@pytest.mark.skipif(not _glibc(), reason="glibc (with mallinfo2) only")
def test_user_tunables_win():
    first, _, _ = _probe(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=4194304")
    assert first == "malloc as the system's (GLIBC_TUNABLES)"


def test_preloaded_allocator_left_alone(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")
    monkeypatch.delenv("MLAKIT_MALLOC", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert malloc._why_not() == "allocator preloaded"
    monkeypatch.delenv("LD_PRELOAD")
    assert malloc._why_not() is None

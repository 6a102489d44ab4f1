"""Compute threads of an engine process: how many, checked before any work."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads, name: str = "--threads") -> int:
    """`threads` as a positive integer (None: every usable core); a ValueError naming `name` else."""
    if threads is None:
        return usable_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {threads!r}")
    return threads


def set_threads(threads: int) -> int:
    """Run torch's intra-op work (GEMMs, the fused attention core: both use the same OpenMP pool) on
    `threads` threads, for this thread and every thread started after (the engine's loop thread)."""
    import torch

    torch.set_num_threads(threads)
    return torch.get_num_threads()

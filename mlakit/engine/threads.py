"""Compute threads of an engine process: how many, checked before any work."""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future


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


# what `set_threads` chose for the thread that will run the steps (`enter_compute_thread` applies it)
_PLAN: dict = {"threads": None, "cpus": None}


def compute_cpus(threads: int) -> list[int] | None:
    """The cores the compute threads are pinned to: the first `threads` of this process's affinity
    (sorted), or None when there are fewer (oversubscribed: pinning two threads to one core would only
    hurt) or the platform has no affinity."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return cores[:threads] if threads <= len(cores) else None


def bind_threads(cpus: list[int]) -> list[int] | None:
    """Pin the OpenMP team of the calling thread (the threads torch's GEMMs, oneDNN, MKL and mlakit's
    fused core all run on: one OpenMP runtime in the process) one per core: thread i to cpus[i], the
    calling thread being thread 0. Returns the core of each thread, or None where it cannot (no GNU
    OpenMP runtime in this process, no affinity calls). Run it on the thread that will run the steps:
    each thread that starts parallel work has a team of its own."""
    import ctypes

    path = _gomp_path()
    if path is None or not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        gomp = ctypes.CDLL(path)  # the runtime already loaded (torch's), not a second one
        gomp.omp_get_thread_num.restype = ctypes.c_int
        body_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        gomp.GOMP_parallel.argtypes = [body_t, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    except (OSError, AttributeError):
        return None
    got: dict[int, int] = {}
    errors: list[BaseException] = []

    def body(_):
        i = gomp.omp_get_thread_num()
        try:
            os.sched_setaffinity(0, {cpus[i]})  # 0: the calling thread (Linux)
            got[i] = cpus[i]
        except (OSError, IndexError) as e:
            errors.append(e)

    callback = body_t(body)  # kept alive for the call
    gomp.GOMP_parallel(callback, None, len(cpus), 0)
    if errors or len(got) != len(cpus):
        return None
    return [got[i] for i in range(len(cpus))]


def _gomp_path() -> str | None:
    """The GNU OpenMP library mapped into this process (torch's own build of it), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    return sorted(paths)[0] if len(paths) == 1 else None


def user_pins_threads() -> str | None:
    """The environment variable by which the user already pins OpenMP threads (then mlakit does not)."""
    for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):
        if os.environ.get(name):
            return name
    return None


def plan_threads(threads: int | None, bind: bool = True) -> None:
    """Remember what `enter_compute_thread` applies: `threads` threads (None: torch's), pinned one per
    core if `bind`."""
    _PLAN["threads"] = threads
    _PLAN["cpus"] = compute_cpus(threads) if bind and threads and not user_pins_threads() else None


def keep_off_compute_cores() -> str:
    """Move the calling thread (a server's HTTP event loop: threads it starts inherit it) to the cores
    the planned compute threads leave free; where none are left it stays where it was (the OS shares
    the cores). A line saying what holds."""
    cpus = _PLAN["cpus"]
    user = user_pins_threads()
    if user is not None:
        return f"threads pinned by {user}"
    if cpus is None:
        return "not pinned"
    try:
        rest = set(os.sched_getaffinity(0)) - set(cpus)
        if rest:
            os.sched_setaffinity(0, rest)
            return f"pinned to cores {','.join(map(str, cpus))}, HTTP on {','.join(map(str, sorted(rest)))}"
    except OSError:
        pass
    return f"pinned to cores {','.join(map(str, cpus))}, HTTP shares them"


def enter_compute_thread() -> str:
    """On the thread that runs the engine's steps: torch's pool at the planned size, its team pinned one
    thread per core (where `plan_threads` asked for it and it can be); a line saying what holds."""
    import torch

    threads = _PLAN["threads"] or torch.get_num_threads()
    torch.set_num_threads(threads)
    cpus = _PLAN["cpus"]
    if cpus is None:
        why = user_pins_threads()
        return f"{threads} compute threads, " + (f"pinned by {why}" if why else "not pinned")
    bound = bind_threads(cpus)
    if bound is None:
        return f"{threads} compute threads, not pinned (no GNU OpenMP runtime to pin)"
    return f"{threads} compute threads pinned to cores {','.join(map(str, bound))}"


class ComputeThread:
    """The one thread of a server process that runs torch's parallel work: the engine's construction
    (loading, packing, the probes timed at the planned threads), then its loop (serve's `EngineLoop`).

    Why one: GNU OpenMP gives every thread that starts parallel work a team of its own, and once the
    threads it manages outnumber the cores it stops spinning between regions (100 spins, then a futex
    wait), so every small parallel op pays a wake-up. An engine built on the main thread and stepped on
    a loop thread holds two teams: on 2 cores the demo model's 8-row decode step took 60-75 ms on the
    loop thread against 45-53 ms on the main thread; built and stepped on one thread, 47-49 ms.

    Calls run in order; `call` waits for its result (an exception is raised in the caller)."""

    def __init__(self, name: str = "mlakit-compute"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._started = threading.Event()
        self.line = ""  # what enter_compute_thread said on this thread
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        try:
            self.line = enter_compute_thread()  # the team sized and pinned before any work
        finally:
            self._started.set()  # had it raised, the thread is gone and submit says so
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fn, args, kwargs, future = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # handed to the caller, the thread goes on
                future.set_exception(err)

    def submit(self, fn, *args, **kwargs) -> Future:
        if not self._thread.is_alive():
            raise RuntimeError("the compute thread has stopped")
        future: Future = Future()
        self._tasks.put((fn, args, kwargs, future))
        return future

    def call(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs) on this thread and return its result."""
        return self.submit(fn, *args, **kwargs).result()

    def ident(self) -> int | None:
        return self._thread.ident

    def close(self, timeout: float | None = None) -> None:
        """Stop once the tasks given so far have run."""
        self._tasks.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

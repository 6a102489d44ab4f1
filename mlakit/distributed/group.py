"""Process-group plumbing: failures every rank agrees on, guarded collectives, local launches.

A collective that one rank never reaches would hang the others; so each distributed step first runs its
local work inside `try`, then every rank all-gathers an error flag (with the message) before any data
collective. A rank that dies or stalls is caught by the group's own timeout instead: the collective
raises on the ranks that wait, and `guarded` turns that into a `RankFailure` that says so.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from mlakit.distributed import fingerprint as fp

DEFAULT_TIMEOUT_S = 60.0
# bytes of each rank's error message carried by the error-flag all-gather
_MESSAGE_BYTES = 512
_FLAG_BYTES = 1 + _MESSAGE_BYTES
_LOCALHOST = "127.0.0.1"


class RankFailure(RuntimeError):
    """A rank of the process group raised, exited or timed out; raised on the ranks that did not."""


def rank_and_world(group=None) -> tuple[int, int]:
    """(rank in `group`, size of `group`); raises when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: run under torchrun, call "
            "torch.distributed.init_process_group, or use mlakit.distributed.launch_local"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group=None) -> torch.device:
    """Where the group's collectives want their tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def guarded(what: str, group=None) -> Iterator[None]:
    """Turn a failed collective (peer gone, timeout) into a RankFailure that names the step."""
    try:
        yield
    except RankFailure:
        raise
    except RuntimeError as err:
        rank = dist.get_rank(group)
        raise RankFailure(
            f"rank {rank}: {what}: the collective failed — a peer rank raised, exited or did not "
            f"arrive within the process group's timeout ({type(err).__name__}: {err})"
        ) from err


def agree(group, error: BaseException | None, what: str, fingerprint: dict[str, str] | None = None) -> None:
    """Every rank learns whether any rank failed in `what`; if one did, every rank raises.

    The rank that failed re-raises its own exception (a ValueError stays a ValueError), with a note
    naming the other failures; every other rank raises RankFailure naming the failed ranks. When the
    ranks pass `fingerprint`s of their inputs (see `fingerprint.py`) and these differ, the messages
    name each field that differs and its value on each rank; if no rank failed, every rank raises
    that as a ValueError.
    """
    rank, world = rank_and_world(group)
    mine = torch.cat([_encode(error), fp.encode(fingerprint)]).to(collective_device(group))
    flags = [torch.empty_like(mine) for _ in range(world)]
    with guarded(f"{what} (error check)", group):
        dist.all_gather(flags, mine, group=group)
    flags = [f.cpu() for f in flags]
    failed = {r: _decode(f) for r, f in enumerate(flags) if int(f[0])}
    diffs = fp.differences([fp.decode(f[_FLAG_BYTES:]) for f in flags]) if fingerprint is not None else []
    if not failed and not diffs:
        return
    if not failed:
        raise ValueError(
            f"rank {rank}: {what}: the {world} ranks were called with different inputs (every rank must "
            f"get the same hidden_states, slots, cache state and layout); differs: " + "; ".join(diffs)
        )
    detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed.items())
    if diffs:
        detail += "; the ranks' inputs also differ: " + "; ".join(diffs)
    if error is not None:
        error.add_note(f"{what} failed on rank(s) {sorted(failed)} of {world}: {detail}")
        raise error
    raise RankFailure(f"rank {rank}: {what} failed on rank(s) {sorted(failed)} of {world}: {detail}")


def all_gather_stacked(t: torch.Tensor, group, what: str) -> torch.Tensor:
    """[W, *t.shape]: every rank's `t`, in rank order."""
    _, world = rank_and_world(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    with guarded(what, group):
        dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


def all_reduce_sum(t: torch.Tensor, group, what: str) -> torch.Tensor:
    with guarded(what, group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _encode(error: BaseException | None) -> torch.Tensor:
    buf = torch.zeros(_FLAG_BYTES, dtype=torch.uint8)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES]
        buf[0] = 1
        buf[1 : 1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return buf


def _decode(buf: torch.Tensor) -> str:
    return bytes(buf[1:_FLAG_BYTES].tolist()).rstrip(b"\0").decode(errors="replace")


def launch_local(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline_s: float = 600.0,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` local processes joined in one gloo group; their returns, by rank.

    The group rendezvous on 127.0.0.1 through a store this process holds on a port the OS picks (no
    race for a free port). `fn` must be importable by name and return plain data; a script that calls
    this needs the usual `if __name__ == "__main__":` guard of multiprocessing. Collectives time out
    after `timeout_s`; the whole launch after `deadline_s`. Any rank that raises (or gives nothing by
    the deadline) makes this raise RankFailure with every rank's message.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    for name, value in (("timeout_s", timeout_s), ("deadline_s", deadline_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    # children fork from a server that imported torch once: a launch costs ~0.3 s, not an import each
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "mlakit.distributed"])
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(_LOCALHOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    threads = max(1, (os.cpu_count() or 1) // world_size)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, args, rank, world_size, store.port, timeout_s, threads, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    started = []
    try:
        for p in procs:
            p.start()
            started.append(p)
        outcome = _collect(results, procs, time.monotonic() + deadline_s)
    finally:
        _reap(started)
    return _unpack(outcome, world_size, deadline_s)


def _worker(fn, args, rank, world, port, timeout_s, threads, results) -> None:
    try:
        torch.set_num_threads(threads)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(_LOCALHOST, port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        results.put((rank, True, fn(*args)))
    except BaseException as err:
        results.put((rank, False, f"{type(err).__name__}: {err}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(results, procs, deadline: float) -> dict[int, tuple[bool, Any]]:
    """Each rank's (ok, value) as it arrives; a rank whose process died without one is recorded too."""
    outcome: dict[int, tuple[bool, Any]] = {}
    dead_since: dict[int, float] = {}
    while len(outcome) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
            outcome[rank] = (ok, value)
        except queue.Empty:
            pass
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if rank in outcome or p.is_alive():
                continue
            # a result a rank put just before exiting may still be in the pipe: give it a moment
            if now - dead_since.setdefault(rank, now) > 1.0:
                outcome[rank] = (False, f"process exited with code {p.exitcode} and no result")
    return outcome


def _reap(procs) -> None:
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _unpack(outcome: dict[int, tuple[bool, Any]], world: int, deadline_s: float) -> list[Any]:
    missing = [r for r in range(world) if r not in outcome]
    failed = {r: v for r, (ok, v) in outcome.items() if not ok}
    if not missing and not failed:
        return [outcome[r][1] for r in range(world)]
    lines = [f"rank {r}: {msg}" for r, msg in sorted(failed.items())]
    lines += [f"rank {r}: no result within {deadline_s:g} s (killed)" for r in missing]
    raise RankFailure(f"{len(failed) + len(missing)} of {world} ranks failed:\n  " + "\n  ".join(lines))

"""The correctness gate: a backend's output against its oracle's on the same inputs, before timing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlakit.bench.backends import Backend
from mlakit.bench.context import BenchContext
from mlakit.bench.grid import Cell

# max |got - want| / max |want| allowed, by compute dtype
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Verdict:
    backend: str
    ok: bool
    cells: tuple[str, ...]  # cells checked
    rel_err: float | None  # worst relative error seen; None when the backend raised
    tol: float
    error: str = ""  # why it failed: the exception, or the error against the tolerance

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "ok": self.ok,
            "cells": list(self.cells),
            "rel_err": self.rel_err,
            "tol": self.tol,
            "error": self.error,
        }


def gate_cells(batch: int, context: int) -> list[Cell]:
    """Decode and a 4-token chunk (causal mask inside the chunk) over a short odd context."""
    cached = min(context, 61)
    return [Cell(batch, cached, 1), Cell(batch, cached, 4)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        raise ValueError(f"output has shape {tuple(got.shape)}, the reference {tuple(want.shape)}")
    g, w = got.double(), want.double()
    if not bool(torch.isfinite(g).all()):
        return float("inf")
    return float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))


def check(backend: Backend, ctx: BenchContext, cells: list[Cell], oracles: dict) -> Verdict:
    """Run `backend` on each cell and compare; `oracles` caches reference outputs between backends."""
    tol = TOLERANCE[ctx.dtype]
    worst = 0.0
    labels = tuple(c.label for c in cells)
    for cell in cells:
        x = ctx.inputs(cell)
        key = (id(backend.oracle), backend.kv_heads(ctx) if backend.kv_heads else None, cell)
        try:
            with torch.inference_mode():
                if key not in oracles:
                    oracles[key] = _once(backend.oracle(ctx, cell, x))
                err = relative_error(_once(backend.prepare(ctx, cell, x)), oracles[key])
        except Exception as exc:  # a backend that cannot run is reported, never timed
            return Verdict(backend.name, False, labels, None, tol, f"{type(exc).__name__}: {exc}")
        worst = max(worst, err)
        if not err <= tol:
            msg = f"relative error {err:.2e} > {tol:.0e} at {cell.label}"
            return Verdict(backend.name, False, labels, worst, tol, msg)
    return Verdict(backend.name, True, labels, worst, tol)


def _once(step) -> torch.Tensor:
    step.reset()
    return step.run().detach().float().cpu()

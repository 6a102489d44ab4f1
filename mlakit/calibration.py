"""A measured crossover profile: where absorb and materialize really cross on this machine.

`mlakit calibrate` measures it for a (model widths, dtype, device) and saves it as JSON in the user's
cache folder; `attach(layer)` (or `layer.profile = find_profile(...)`) makes `mode="auto"` follow
it. A profile only decides for the widths it was measured at, and within the new-token counts it
measured; everywhere else `choose` falls back to the analytic model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

from mlakit.config import MLAConfig

SCHEMA = "mlakit-crossover-profile/1"
# the widths the two paths' costs depend on (projections are the same for both)
WIDTH_FIELDS = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def widths_of(cfg: MLAConfig) -> dict[str, int]:
    return {f: getattr(cfg, f) for f in WIDTH_FIELDS}


@dataclass(frozen=True)
class CrossoverProfile:
    model: str  # the model it was measured with (informational: matching is by widths)
    widths: dict[str, int]  # WIDTH_FIELDS of that model
    dtype: str  # "fp32" | "bf16"
    device: str  # "cpu" | "cuda"
    points: tuple[tuple[int, float | None], ...]  # (cached tokens, measured crossover; None: absorb won)
    max_new: int  # the largest new-token count measured
    machine: dict | None = None  # the MachineProfile (peak matmul rates, bandwidth) measured with it
    extra: dict = field(default_factory=dict, compare=False)  # threads, versions, grid, timestamp

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a crossover profile needs at least one (context, crossover) point")
        pts = tuple(sorted((int(t), None if x is None else float(x)) for t, x in self.points))
        object.__setattr__(self, "points", pts)
        if set(self.widths) != set(WIDTH_FIELDS):
            raise ValueError(f"profile widths must name {list(WIDTH_FIELDS)}, got {sorted(self.widths)}")

    def matches(self, cfg: MLAConfig, dtype: str | None = None, device: str | None = None) -> bool:
        if widths_of(cfg) != self.widths:
            return False
        return (dtype is None or dtype == self.dtype) and (device is None or device == self.device)

    def crossover_at(self, context: int) -> float | None:
        """Measured crossover at `context`, linear in log(context) between the measured contexts and
        held at the ends; None where absorb won at every measured count (no crossover up to max_new)."""
        pts = self.points
        below = [p for p in pts if p[0] <= context] or [pts[0]]
        above = [p for p in pts if p[0] >= context] or [pts[-1]]
        (t0, x0), (t1, x1) = below[-1], above[0]
        if x0 is None or x1 is None:
            return None
        if t0 == t1:
            return x0
        w = (math.log(max(context, 1)) - math.log(max(t0, 1))) / (math.log(max(t1, 1)) - math.log(max(t0, 1)))
        return x0 + w * (x1 - x0)

    def decide(self, cfg: MLAConfig, new: int, context: int) -> str | None:
        """ "absorb" / "materialize" from the measurement, or None where it does not apply."""
        if widths_of(cfg) != self.widths or not self.consistent:
            return None
        point = self.crossover_at(context)
        if point is None:
            return "absorb" if new <= self.max_new else None
        return "absorb" if new < point else "materialize"

    @property
    def consistent(self) -> bool:
        """False when calibrate's own checks failed (extra["consistent"]): mode="auto" ignores it."""
        return self.extra.get("consistent", True) is not False

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "widths": dict(self.widths),
            "dtype": self.dtype,
            "device": self.device,
            "points": [[t, x] for t, x in self.points],
            "max_new": self.max_new,
            "machine": self.machine,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, d: dict) -> CrossoverProfile:
        missing = [k for k in ("model", "widths", "dtype", "device", "points", "max_new") if k not in d]
        if missing:
            raise ValueError(f"crossover profile lacks {missing}; was it written by `mlakit calibrate`?")
        return cls(
            model=str(d["model"]),
            widths={k: int(v) for k, v in d["widths"].items()},
            dtype=str(d["dtype"]),
            device=str(d["device"]),
            points=tuple((int(t), x) for t, x in d["points"]),
            max_new=int(d["max_new"]),
            machine=d.get("machine"),
            extra=dict(d.get("extra", {})),
        )

    def save(self, path: str) -> str:
        path = os.path.abspath(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
        return path

    @classmethod
    def load(cls, path: str) -> CrossoverProfile:
        with open(path, encoding="utf-8") as f:
            try:
                return cls.from_dict(json.load(f))
            except json.JSONDecodeError as err:
                raise ValueError(f"crossover profile {path!r} is not JSON: {err}") from err


def cache_dir() -> str:
    """$MLAKIT_CACHE_DIR, else $XDG_CACHE_HOME/mlakit, else ~/.cache/mlakit."""
    if os.environ.get("MLAKIT_CACHE_DIR"):
        return os.environ["MLAKIT_CACHE_DIR"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlakit")


def profile_path(cfg: MLAConfig, dtype: str, device: str, folder: str | None = None) -> str:
    w = widths_of(cfg)
    tag = "H{num_heads}-L{kv_lora_rank}-n{qk_nope_head_dim}-r{qk_rope_head_dim}-v{v_head_dim}".format(**w)
    return os.path.join(folder or cache_dir(), f"crossover-{tag}-{dtype}-{device}.json")


def find_profile(
    cfg: MLAConfig, dtype: str, device: str, folder: str | None = None
) -> CrossoverProfile | None:
    """The saved profile for these widths, dtype and device type, or None."""
    path = profile_path(cfg, dtype, device, folder)
    if not os.path.isfile(path):
        return None
    profile = CrossoverProfile.load(path)
    return profile if profile.matches(cfg, dtype, device) and profile.consistent else None


def attach(layer, folder: str | None = None) -> CrossoverProfile | None:
    """Give an MLAAttention the saved profile matching its widths, dtype and device (None if none)."""
    dtype = DTYPE_NAMES.get(layer.dtype)
    profile = None if dtype is None else find_profile(layer.cfg, dtype, layer.device.type, folder)
    layer.profile = profile
    return profile

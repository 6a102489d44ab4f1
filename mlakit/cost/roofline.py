"""The roofline time model: a machine profile and predicted time per term, max(compute, memory).

Datasheet presets use NVIDIA's dense (no 2:4 sparsity) tensor-core peaks and HBM bandwidths; see
docs/cost-model.md for the sources. A profile measured on this machine comes from `mlakit.profile`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from mlakit.config import MLAConfig
from mlakit.cost.terms import path_terms, shared_macs
from mlakit.cost.traffic import compute_dtype, path_bytes, shared_bytes

FLOPS_PER_MAC = 2


@dataclass(frozen=True)
class MachineProfile:
    name: str  # "h100", "local-cpu", ...
    peak_flops: dict[str, float]  # dense matmul FLOP/s (2 per multiply-add) by compute dtype
    memory_bandwidth: float  # bytes/s read from main memory (HBM or DRAM)
    source: str = ""  # where the figures come from (datasheet, or how they were measured)
    extra: dict = field(default_factory=dict, compare=False)  # free-form: device, threads, versions

    def __post_init__(self) -> None:
        if not isinstance(self.peak_flops, dict) or not {"fp32", "bf16"} <= set(self.peak_flops):
            raise ValueError(
                f"peak_flops must map at least 'fp32' and 'bf16' to FLOP/s, got {self.peak_flops!r}"
            )
        for key, value in self.peak_flops.items():
            _check_rate(f"peak_flops[{key!r}]", value)
        _check_rate("memory_bandwidth", self.memory_bandwidth)

    def matmul_flops(self, dtype: str) -> float:
        """Peak FLOP/s of the matmuls that serve a cache stored in `dtype`."""
        return self.peak_flops[compute_dtype(dtype)]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "source": self.source,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, d: dict) -> MachineProfile:
        missing = [k for k in ("name", "peak_flops", "memory_bandwidth") if k not in d]
        if missing:
            raise ValueError(
                f"machine profile lacks {missing}; expected keys name, peak_flops, memory_bandwidth"
            )
        return cls(
            name=str(d["name"]),
            peak_flops={k: float(v) for k, v in d["peak_flops"].items()},
            memory_bandwidth=float(d["memory_bandwidth"]),
            source=str(d.get("source", "")),
            extra=dict(d.get("extra", {})),
        )

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> MachineProfile:
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"machine profile {path!r} is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"machine profile {path!r} must be a JSON object, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except (TypeError, AttributeError) as err:
            raise ValueError(f"machine profile {path!r}: {err}") from None


def _check_rate(name: str, value) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite rate, got {value!r}")


_HOPPER_DENSE = {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp8": 1978.9e12}

MACHINES: dict[str, MachineProfile] = {
    "h100": MachineProfile(
        "h100",
        dict(_HOPPER_DENSE),
        3.35e12,
        "NVIDIA H100 SXM5 datasheet: dense tensor-core peaks, 3.35 TB/s HBM3",
    ),
    "h200": MachineProfile(
        "h200",
        dict(_HOPPER_DENSE),
        4.8e12,
        "NVIDIA H200 SXM datasheet: dense tensor-core peaks, 4.8 TB/s HBM3e",
    ),
    "h800": MachineProfile(
        "h800",
        dict(_HOPPER_DENSE),
        3.35e12,
        "NVIDIA H800 SXM5 datasheet: dense tensor-core peaks, 3.35 TB/s HBM3",
    ),
}


def resolve_machine(machine: str | MachineProfile) -> MachineProfile:
    """A preset name (h100, h200, h800) or a profile JSON path (what `--machine` takes)."""
    if isinstance(machine, MachineProfile):
        return machine
    if machine.lower() in MACHINES:
        return MACHINES[machine.lower()]
    if os.path.isfile(machine):
        return MachineProfile.load(machine)
    raise ValueError(
        f"machine {machine!r} is neither a preset ({', '.join(sorted(MACHINES))}) nor a profile JSON file"
    )


def term_times(macs: dict, nbytes: dict, machine: MachineProfile, dtype: str = "bf16") -> dict:
    """Per term: compute seconds, memory seconds, and the roofline time max(compute, memory)."""
    flops = machine.matmul_flops(dtype)
    out = {}
    for name, m in macs.items():
        compute_s = FLOPS_PER_MAC * m / flops
        memory_s = nbytes[name] / machine.memory_bandwidth
        out[name] = {
            "compute_s": compute_s,
            "memory_s": memory_s,
            "time_s": max(compute_s, memory_s),
            "bound": "compute" if compute_s >= memory_s else "memory",
        }
    return out


def path_term_times(
    cfg: MLAConfig,
    mode: str,
    new,
    cached,
    machine: MachineProfile,
    dtype: str = "bf16",
    model: str = "independent",
    fused: bool = False,
) -> dict:
    macs = path_terms(cfg, mode, new, cached, model)
    return term_times(macs, path_bytes(cfg, mode, new, cached, model, dtype, fused), machine, dtype)


def shared_term_times(cfg: MLAConfig, new, machine: MachineProfile, dtype: str = "bf16") -> dict:
    return term_times(shared_macs(cfg, new), shared_bytes(cfg, new, dtype), machine, dtype)


def path_time(
    cfg: MLAConfig,
    mode: str,
    new,
    cached,
    machine: MachineProfile,
    dtype: str = "bf16",
    model: str = "independent",
    fused: bool = False,
) -> float:
    """Predicted seconds of one path's attention core: the sum over terms of max(compute, memory)."""
    times = path_term_times(cfg, mode, new, cached, machine, dtype, model, fused)
    return sum(t["time_s"] for t in times.values())

"""A cheap, exact description of one rank's step inputs, compared across ranks by `agree`.

Every rank of a CP or TP group must be called with the same inputs. Each step's error agreement also
carries each rank's fingerprint: shapes, dtypes, slots, the cache's lengths, the layout (block size,
world size, mode) and a checksum of `hidden_states`. The checksum sums the tensor's *bits* as
integers (exact and independent of memory layout and reduction order, unlike a float sum), once
plainly and once weighted by token and by channel index, so a changed value, a swapped token or a
swapped channel all show. Two reductions over the input: small next to the layer's projections.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

# bytes of each rank's fingerprint (JSON) carried by the agreement all-gather
FINGERPRINT_BYTES = 1024
# a value rendered longer than this is carried as a preview and a digest
_SHORT = 48
_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def describe(value: Any) -> str:
    """A short text for one fingerprint field: equal inputs give equal texts."""
    if isinstance(value, torch.Tensor):
        value = value.tolist() if value.device.type != "meta" and value.numel() <= 4096 else _meta(value)
    text = repr(value)
    if len(text) <= _SHORT:
        return text
    digest = hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    return f"{text[: _SHORT - 16]}… #{digest}"


def _meta(t: torch.Tensor) -> str:
    return f"tensor{tuple(t.shape)} {t.dtype} on {t.device}"


def tensor_fields(name: str, t: Any) -> dict[str, str]:
    """`name` shape, dtype and bit checksum of a tensor (its type name when it is not one)."""
    if not isinstance(t, torch.Tensor):
        return {f"{name} type": type(t).__name__}
    fields = {f"{name} shape": repr(tuple(t.shape)), f"{name} dtype": str(t.dtype)}
    if t.device.type != "meta" and t.numel() and t.dim() >= 2:
        fields[f"{name} checksum"] = repr(bit_checksum(t))
    return fields


def bit_checksum(t: torch.Tensor) -> tuple[int, int, int]:
    """(Σ bits, Σ token·Σ_d bits, Σ channel·Σ_t bits) of t [..., D] read as integers, exact."""
    if t.dtype.is_complex or t.dtype == torch.bool:
        t = t.to(torch.float64) if t.dtype == torch.bool else torch.view_as_real(t).flatten(-2)
    bits = t.detach().contiguous().view(_INT_VIEWS[t.element_size()]).reshape(-1, t.shape[-1])
    rows = bits.sum(dim=1, dtype=torch.int64)  # [tokens]
    cols = bits.sum(dim=0, dtype=torch.int64)  # [D]
    token = torch.arange(1, rows.numel() + 1, device=t.device)
    channel = torch.arange(1, cols.numel() + 1, device=t.device)
    sums = torch.stack([rows.sum(), (rows * token).sum(), (cols * channel).sum()])
    return tuple(int(s) for s in sums.tolist())


def encode(fields: dict[str, str] | None) -> torch.Tensor:
    """uint8 [FINGERPRINT_BYTES]: the fields as JSON, zero-padded; all zeros when there are none."""
    buf = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8)
    if fields:
        data = json.dumps(fields, sort_keys=True).encode()
        if len(data) > FINGERPRINT_BYTES:
            data = json.dumps({"digest": hashlib.blake2b(data, digest_size=16).hexdigest()}).encode()
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def decode(buf: torch.Tensor) -> dict[str, str]:
    data = bytes(buf.tolist()).rstrip(b"\0")
    return json.loads(data) if data else {}


def differences(prints: list[dict[str, str]]) -> list[str]:
    """'field: rank 0 a, rank 1 b' for every field whose value is not the same on every rank."""
    keys = sorted(set().union(*prints))
    out = []
    for key in keys:
        values = [p.get(key, "(absent)") for p in prints]
        if len(set(values)) > 1:
            out.append(f"{key}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
    return out


def step_fields(hidden_states: Any, cache: Any, slots: Any, **layout: Any) -> dict[str, str]:
    """The fingerprint of one CP/TP step, taken before it changes anything; never raises."""
    try:
        fields = tensor_fields("hidden_states", hidden_states)
        fields["slots"] = describe(slots)
        fields["cache type"] = type(cache).__name__
        lengths = getattr(cache, "lengths", None)
        if isinstance(lengths, torch.Tensor):
            fields["cache lengths"] = describe(lengths)
        fields.update({k: describe(v) for k, v in layout.items()})
        return fields
    except Exception as err:  # a rank whose inputs cannot even be described differs from one whose can
        return {"inputs": f"not describable ({type(err).__name__}: {err})"[:_SHORT]}

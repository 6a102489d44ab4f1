"""Measured times (the bench results schema) and the crossover they show.

Results are a JSON object with a `rows` list; each row is one timed cell:
`{"backend", "batch", "new", "cached", "dtype", "ms_median"}` (more keys are allowed and ignored).
The crossover uses the backends "mlakit-absorb" and "mlakit-materialize"; others are carried along.
See docs/cost-model.md for the schema and the rule.
"""

from __future__ import annotations

import json
import math
import os

SCHEMA = "mlakit-bench-results/1"
ROW_KEYS = ("backend", "batch", "new", "cached", "dtype", "ms_median")
ABSORB, MATERIALIZE = "mlakit-absorb", "mlakit-materialize"


def load_results(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"bench results {path!r}: no such file")
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"bench results {path!r} are not JSON: {err}") from err
    return validate_results(data)


def validate_results(data) -> dict:
    """The results with each row reduced to the schema's keys; ValueError on the first bad row."""
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError("bench results must be a JSON object with a 'rows' list")
    rows, seen = [], set()
    for i, row in enumerate(data["rows"]):
        rows.append(_check_row(i, row))
        key = tuple(rows[-1][k] for k in ROW_KEYS[:-1])
        if key in seen:
            raise ValueError(
                f"bench results row {i} repeats the cell {dict(zip(ROW_KEYS, key, strict=False))}"
            )
        seen.add(key)
    out = {k: v for k, v in data.items() if k != "rows"}
    out["rows"] = rows
    return out


def _check_row(i: int, row) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"bench results row {i} must be an object, got {type(row).__name__}")
    missing = [k for k in ROW_KEYS if k not in row]
    if missing:
        raise ValueError(f"bench results row {i} lacks {missing}; each row needs {list(ROW_KEYS)}")
    for key, low in (("batch", 1), ("new", 1), ("cached", 0)):
        v = row[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"bench results row {i}: {key} must be an integer >= {low}, got {v!r}")
    ms = row["ms_median"]
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
        raise ValueError(f"bench results row {i}: ms_median must be a positive number, got {ms!r}")
    for key in ("backend", "dtype"):
        if not isinstance(row[key], str) or not row[key]:
            raise ValueError(f"bench results row {i}: {key} must be a non-empty string, got {row[key]!r}")
    return {k: row[k] for k in ROW_KEYS}


def series(rows: list[dict], backend: str, cached: int, batch: int, dtype: str) -> list[tuple[int, float]]:
    """(new, ms_median) of one backend in one (cached, batch, dtype) cell, sorted by new."""
    pts = [
        (r["new"], float(r["ms_median"]))
        for r in rows
        if r["backend"] == backend and r["cached"] == cached and r["batch"] == batch and r["dtype"] == dtype
    ]
    return sorted(pts)


def measured_crossover(rows: list[dict], cached: int, batch: int, dtype: str) -> float | None:
    """First new-token count where materialize's median time is <= absorb's, log-log interpolated.

    Only new-token counts timed for both paths count. The smallest such count if materialize is
    already no slower there; None if absorb is faster at every measured count.
    """
    absorb = dict(series(rows, ABSORB, cached, batch, dtype))
    mat = dict(series(rows, MATERIALIZE, cached, batch, dtype))
    common = sorted(set(absorb) & set(mat))
    prev = None
    for n in common:
        r = math.log(mat[n] / absorb[n])
        if r <= 0:
            if prev is None:
                return float(n)
            n0, r0 = prev
            return math.exp(math.log(n0) + (math.log(n) - math.log(n0)) * r0 / (r0 - r))
        prev = (n, r)
    return None

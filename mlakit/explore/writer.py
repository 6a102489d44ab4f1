"""Write the explorer page: the HTML template, the two scripts, and the formulas' inputs as JSON.

The page computes every figure it shows from these inputs; nothing here precomputes them.
"""

from __future__ import annotations

import json
import os
from importlib import resources

from mlakit.config import PRESETS, MLAConfig
from mlakit.cost import DEFAULT_COUNTING, DEFAULT_GQA_GROUPS, MACHINES, load_results, validate_results
from mlakit.cost.cache_size import INDEX_TILE, QUANT_TILE, ROPE_BYTES, SCALE_BYTES, VALUE_BYTES
from mlakit.cost.capacity import BLOCK_SIZE, PARAMETERS, WEIGHT_BYTES

WIDTHS = (
    "num_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_layers",
    "hidden_size",
    "q_lora_rank",
    "index_n_heads",  # the DSA indexer (None: dense MLA)
    "index_head_dim",
    "index_topk",
)
CONTEXT_RANGE = (1, 1 << 20)
NEW_RANGE = (1, 16384)
START = {"model": "deepseek-v3", "context": 4096, "counting": DEFAULT_COUNTING, "machine": "none"}
SCRIPTS = (
    "model.js",
    "sparse.js",
    "units.js",  # what the inputs read: 32K, 80GB (the CLI's forms)
    "capacity.js",  # mirrors mlakit.cost.capacity
    "dsa.js",
    "ui.js",
    "v4.js",
)  # model.js, sparse.js (and v4.js's arithmetic) mirror mlakit.cost; the rest draw
BENCH_KEYS = ("schema", "model", "dtype", "machine", "rows")  # what the page reads of a results file


def start_view(bench: dict | None) -> dict:
    """Where the page opens: the defaults, or the bench's model at its largest measured context
    (batch 1 where measured), on the machine profile measured with it."""
    start = dict(START)
    if not bench or not bench.get("rows"):
        return start
    rows = [r for r in bench["rows"] if r["backend"] in ("mlakit-absorb", "mlakit-materialize")] or bench[
        "rows"
    ]
    if bench.get("model") in PRESETS:
        start["model"] = bench["model"]
    start["context"] = max(1, max(r["cached"] for r in rows))
    if bench.get("machine"):
        start["machine"] = "measured"
    return start


def explorer_inputs(bench: dict | None = None) -> dict:
    """What the page receives: preset widths, cache-format constants, ranges, machines, bench rows."""
    presets = {}
    for name in PRESETS:
        cfg = MLAConfig.preset(name)
        presets[name] = {f: getattr(cfg, f) for f in WIDTHS}
    bench = None if bench is None else validate_results(bench)
    if bench is not None:
        bench = {k: bench[k] for k in BENCH_KEYS if k in bench}
    machines = {name: _machine(m.to_dict()) for name, m in MACHINES.items()}
    if bench and bench.get("machine"):
        machines["measured"] = _machine(bench["machine"])
    return {
        "presets": presets,
        "start": start_view(bench),
        "machines": machines,
        "counting_default": DEFAULT_COUNTING,
        "context_range": list(CONTEXT_RANGE),
        "new_range": list(NEW_RANGE),
        "gqa_groups": list(DEFAULT_GQA_GROUPS),
        "cache_format": {
            "value_bytes": dict(VALUE_BYTES),
            "quant_tile": dict(QUANT_TILE),
            "scale_bytes": SCALE_BYTES,
            "rope_bytes": ROPE_BYTES,
            "index_tile": INDEX_TILE,
        },
        "bench": bench,
        **capacity_inputs(),
        **_v4_inputs(),
    }


def capacity_inputs() -> dict:
    """The capacity panel's inputs: published parameter counts, bytes per weight, the CP block size."""
    return {
        "capacity": {
            "parameters": dict(PARAMETERS),
            "weight_bytes": dict(WEIGHT_BYTES),
            "block_size": BLOCK_SIZE,
        }
    }


def _v4_inputs() -> dict:
    """The V4 panel's inputs: the V4 presets' widths and its fp8 tile (mlakit.cost.v4)."""
    from mlakit.cost.v4 import FP8_TILE
    from mlakit.v4.config import V4_PRESETS, V4Config

    return {
        "v4_presets": {name: V4Config.preset(name).to_dict() for name in V4_PRESETS},
        "v4_fp8_tile": FP8_TILE,
    }


def _machine(d: dict) -> dict:
    return {"name": d["name"], "peak_flops": dict(d["peak_flops"]), "memory_bandwidth": d["memory_bandwidth"]}


def render_explorer(bench: dict | None = None) -> str:
    """The whole page as one string: no network, no external files."""
    page = _asset("explorer.html")
    script = "\n".join(_asset(name) for name in SCRIPTS)
    # "</" inside a script element would end it early
    data = json.dumps(explorer_inputs(bench), separators=(",", ":")).replace("</", "<\\/")
    return page.replace("/*MLAKIT_INPUTS*/", data).replace("/*MLAKIT_SCRIPT*/", script.replace("</", "<\\/"))


def write_explorer(out: str = "mlakit-explorer.html", bench_path: str | None = None) -> str:
    """Write the page (with the measured times of `bench_path`, if given); returns its absolute path."""
    if not out:
        raise ValueError("--out must name a file, got an empty string")
    path = os.path.abspath(out)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise ValueError(f"--out {out!r} is a folder; it must name a file")
    if not os.path.isdir(parent):
        raise ValueError(f"--out {out!r}: folder {parent!r} does not exist")
    bench = load_results(bench_path) if bench_path else None
    html = render_explorer(bench)
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    return path


def _asset(name: str) -> str:
    return resources.files("mlakit.explore").joinpath(name).read_text(encoding="utf-8")

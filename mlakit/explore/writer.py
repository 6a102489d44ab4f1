"""Write the explorer page: the HTML template, the two scripts, and the formulas' inputs as JSON.

The page computes every figure it shows from these inputs; nothing here precomputes them.
"""

from __future__ import annotations

import json
import os
from importlib import resources

from mlakit.config import PRESETS, MLAConfig
from mlakit.cost import DEFAULT_GQA_GROUPS, load_results, validate_results
from mlakit.cost.cache_size import QUANT_TILE, ROPE_BYTES, SCALE_BYTES, VALUE_BYTES

WIDTHS = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_layers")
CONTEXT_RANGE = (512, 1 << 20)
NEW_RANGE = (1, 16384)
START = {"model": "deepseek-v3", "context": 4096}
SCRIPTS = ("model.js", "ui.js")  # model.js mirrors mlakit.cost; ui.js draws


def explorer_inputs(bench: dict | None = None) -> dict:
    """What the page receives: preset widths, cache-format constants, ranges, and bench rows if any."""
    presets = {}
    for name in PRESETS:
        cfg = MLAConfig.preset(name)
        presets[name] = {f: getattr(cfg, f) for f in WIDTHS}
    return {
        "presets": presets,
        "start": dict(START),
        "context_range": list(CONTEXT_RANGE),
        "new_range": list(NEW_RANGE),
        "gqa_groups": list(DEFAULT_GQA_GROUPS),
        "cache_format": {
            "value_bytes": dict(VALUE_BYTES),
            "quant_tile": dict(QUANT_TILE),
            "scale_bytes": SCALE_BYTES,
            "rope_bytes": ROPE_BYTES,
        },
        "bench": None if bench is None else validate_results(bench),
    }


def render_explorer(bench: dict | None = None) -> str:
    """The whole page as one string: no network, no external files."""
    page = _asset("explorer.html")
    script = "\n".join(_asset(name) for name in SCRIPTS)
    # "</" inside a script element would end it early
    data = json.dumps(explorer_inputs(bench), separators=(",", ":")).replace("</", "<\\/")
    return page.replace("/*MLAKIT_INPUTS*/", data).replace("/*MLAKIT_SCRIPT*/", script.replace("</", "<\\/"))


def write_explorer(out: str = "mlakit-explorer.html", bench_path: str | None = None) -> str:
    """Write the page (with the measured times of `bench_path`, if given); returns its absolute path."""
    bench = load_results(bench_path) if bench_path else None
    html = render_explorer(bench)
    path = os.path.abspath(out)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"--out {out!r}: folder {parent!r} does not exist")
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    return path


def _asset(name: str) -> str:
    return resources.files("mlakit.explore").joinpath(name).read_text(encoding="utf-8")

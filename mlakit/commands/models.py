"""mlakit models: every preset with its widths and cache values per token per layer."""

from __future__ import annotations

from mlakit.commands import emit_json
from mlakit.config import PRESETS, MLAConfig

_COLUMNS = (
    ("model", "name", "{:<16}"),
    ("D", "hidden_size", "{:>6}"),
    ("H", "num_heads", "{:>4}"),
    ("q_rank", "q_lora_rank", "{:>6}"),
    ("L", "kv_lora_rank", "{:>4}"),
    ("nope", "qk_nope_head_dim", "{:>4}"),
    ("rope", "qk_rope_head_dim", "{:>4}"),
    ("v", "v_head_dim", "{:>4}"),
    ("layers", "num_layers", "{:>6}"),
)


def register(sub) -> None:
    p = sub.add_parser("models", help="list the presets with widths and cache values per token per layer")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def describe(cfg: MLAConfig) -> dict:
    d = cfg.to_dict()
    d["qk_head_dim"] = cfg.qk_head_dim
    d["softmax_scale"] = cfg.softmax_scale
    d["cache_values_per_token_per_layer"] = {
        "mla": cfg.latent_dim,
        "expanded": cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim),
    }
    return d


def run(args) -> int:
    rows = [describe(MLAConfig.preset(name)) for name in PRESETS]
    if args.json:
        emit_json(rows)
        return 0
    head = " ".join(fmt.format(title) for title, _, fmt in _COLUMNS)
    print(f"{head} {'cache/token/layer':>18} {'expanded':>9}")
    for r in rows:
        cells = " ".join(fmt.format(str(r[key])) for _, key, fmt in _COLUMNS)
        c = r["cache_values_per_token_per_layer"]
        print(f"{cells} {c['mla']:>18} {c['expanded']:>9}")
    return 0

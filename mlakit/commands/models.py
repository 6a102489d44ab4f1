"""mlakit models: every preset with its widths and cache values per token per layer, and every MLA
family of transformers with whether `mlakit.hf.patch` covers it (and why not)."""

from __future__ import annotations

from mlakit.commands import emit_json
from mlakit.commands.v4 import print_v4_models, v4_models
from mlakit.config import PRESETS, MLAConfig
from mlakit.hf.families import FAMILIES, V4_FAMILIES

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
    p = sub.add_parser(
        "models",
        help="list the presets (widths, cache values per token per layer) and the transformers families "
        "mlakit.hf.patch covers",
    )
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


def families() -> list[dict]:
    """One row per MLA attention class of transformers: its family, whether patch covers it, why not."""
    return [
        {
            "family": f.model_type,
            "attention": name,
            "models": list(f.models),
            "patched": f.refused is None,
            "reason": f.refused,
            "differences": f.differences,
        }
        for name, f in {**FAMILIES, **V4_FAMILIES}.items()
    ]


def run(args) -> int:
    rows = [describe(MLAConfig.preset(name)) for name in PRESETS]
    if args.json:
        emit_json({"presets": rows, "families": families(), "v4_presets": v4_models()})
        return 0
    head = " ".join(fmt.format(title) for title, _, fmt in _COLUMNS)
    print(f"{head} {'cache/token/layer':>18} {'expanded':>9}")
    for r in rows:
        cells = " ".join(fmt.format(str(r[key])) for _, key, fmt in _COLUMNS)
        c = r["cache_values_per_token_per_layer"]
        print(f"{cells} {c['mla']:>18} {c['expanded']:>9}")
    print_v4_models(v4_models())
    print(f"\ntransformers families (mlakit.hf.patch):\n{'family':<20} {'attention':<28} patched")
    for f in families():
        print(f"{f['family']:<20} {f['attention']:<28} {'yes' if f['patched'] else 'no: ' + f['reason']}")
    return 0

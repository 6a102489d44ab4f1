"""Assembled figures: one call's full cost report, and the preset tables of docs/cost-model.md."""

from __future__ import annotations

from mlakit.config import PRESETS, MLAConfig
from mlakit.cost.cache_size import cache_economics, format_bytes
from mlakit.cost.crossover import crossover, roofline_crossover
from mlakit.cost.roofline import MachineProfile, path_term_times, resolve_machine, shared_term_times
from mlakit.cost.sparse import sparse_cost
from mlakit.cost.terms import MODES, path_terms, shared_macs
from mlakit.cost.traffic import path_bytes, shared_bytes


def cost_report(
    cfg: MLAConfig,
    context: int,
    new: int,
    dtype: str = "bf16",
    machine: str | MachineProfile = "h100",
    model: str = "independent",
    fused: bool = False,
) -> dict:
    """Every term (multiply-adds, bytes, predicted seconds), both totals with and without the shared
    projections, which path is faster, and the crossovers at this context."""
    profile = resolve_machine(machine)
    terms = {
        "shared": _rows(
            shared_macs(cfg, new), shared_bytes(cfg, new, dtype), shared_term_times(cfg, new, profile, dtype)
        )
    }
    for mode in MODES:
        macs = path_terms(cfg, mode, new, context, model)
        nbytes = path_bytes(cfg, mode, new, context, model, dtype, fused)
        times = path_term_times(cfg, mode, new, context, profile, dtype, model, fused)
        terms[mode] = _rows(macs, nbytes, times)
    totals = {mode: _totals(terms[mode], terms["shared"]) for mode in MODES}
    point = crossover(cfg, context, model)
    answer = {
        "fewer_macs": min(MODES, key=lambda m: (totals[m]["macs"], m)),
        "faster": min(MODES, key=lambda m: (totals[m]["time_s"], m)),
        "crossover": {
            "exact": point.exact,
            "asymptotic": point.asymptotic,
            "roofline": roofline_crossover(cfg, context, profile, dtype, model, fused),
        },
    }
    out = {
        "model": cfg.name,
        "context": context,
        "new": new,
        "dtype": dtype,
        "counting": model,
        "fused": fused,
        "machine": profile.to_dict(),
        "terms": terms,
        "totals": totals,
        **answer,
    }
    if cfg.is_sparse:
        out.update(sparse_answer(sparse_cost(cfg, context, new, dtype, model), answer))
    return out


def sparse_answer(sparse: dict, dense: dict) -> dict:
    """A DSA model's one answer at the top level (the sparse paths'); the dense layer's under
    "dense_layer", beside "terms" and "totals", which are that dense layer's rows. The sparse crossover is
    a band of new tokens (exact <= new < below; None: never); no roofline or long-context limit is
    modelled for the sparse paths, so "faster" is None and the crossover has no such keys."""
    band = sparse["crossover"]
    return {
        "fewer_macs": sparse["fewer_macs"],
        "faster": None,
        "crossover": {
            "exact": None if band is None else band[0],
            "below": None if band is None else band[1],
            "materialize_cheaper": None if band is None else {"from": band[0], "below": band[1]},
        },
        "dense_layer": {**dense, "rows": "terms and totals are this dense layer's (no indexer)"},
        "sparse": sparse,
    }


def _rows(macs: dict, nbytes: dict, times: dict) -> dict:
    return {name: {"macs": macs[name], "bytes": nbytes[name], **times[name]} for name in macs}


def _totals(path: dict, shared: dict) -> dict:
    out = {}
    for key in ("macs", "bytes", "time_s"):
        own = sum(t[key] for t in path.values())
        out[key] = own
        out[f"{key}_with_shared"] = own + sum(t[key] for t in shared.values())
    return out


def markdown_tables(context: int = 4096, sequence: int = 131072, machine: str = "h100") -> str:
    """The preset tables of docs/cost-model.md (regenerate with `python -m mlakit.cost --markdown`)."""
    lines = [
        f"Crossover in new tokens (FLOP model at {context:,} cached tokens; roofline on {machine}, bf16, "
        "independent counting, K/V not fused):",
        "",
        "| preset | H | L | nope | rope | v | limit | exact | exact (causal) | roofline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in PRESETS:
        cfg = MLAConfig.preset(name)
        ind, cau = crossover(cfg, context), crossover(cfg, context, "causal")
        roof = roofline_crossover(cfg, context, machine)
        cells = [cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim]
        cells += [_tok(ind.asymptotic), _tok(ind.exact), _tok(cau.exact), _tok(roof)]
        lines.append(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        f"Cache per token (all layers) and per sequence of {sequence:,} tokens:",
        "",
        "| preset | layers | values/token/layer mla / expanded / mha | mla bf16 | mla fp8 | mla int8 "
        "| expanded bf16 | mha bf16 | mla = gqa(g) | sequence mla bf16 | sequence mha bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in PRESETS:
        cfg = MLAConfig.preset(name)
        e = {d: cache_economics(cfg, sequence, d) for d in ("bf16", "fp8", "int8")}
        v = e["bf16"]["values_per_token_per_layer"]
        per_tok = {d: e[d]["bytes_per_token"] for d in e}
        seq = e["bf16"]["bytes_per_sequence"]
        cells = [
            cfg.num_layers,
            f"{v['mla']:,} / {v['expanded']:,} / {v['mha']:,}",
            f"{per_tok['bf16']['mla']:,} B",
            f"{per_tok['fp8']['mla']:,} B",
            f"{per_tok['int8']['mla']:,} B",
            format_bytes(per_tok["bf16"]["expanded"]),
            format_bytes(per_tok["bf16"]["mha"]),
            f"{e['bf16'].get('dense_layer', e['bf16'])['mla_equivalent_gqa_groups']:.3g}",  # the latent's
            format_bytes(seq["mla"]),
            format_bytes(seq["mha"]),
        ]
        lines.append(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def format_seconds(seconds: float) -> str:
    """'12.3 ns', '4.56 µs', '7.89 ms', '1.23 s' (3 significant digits; 'inf s' past float range)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(seconds) >= scale or unit == "ns":
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds} s"


def _tok(x: float | None) -> str:
    return "none" if x is None else f"{x:.1f}"

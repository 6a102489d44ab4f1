"""The printed table and summary of a results document."""

from __future__ import annotations

from mlakit.bench.backends import BACKENDS
from mlakit.bench.summary import ABSORB, AUTO, MATERIALIZE, index


def _ms(row: dict | None) -> str:
    return "—" if row is None else f"{row['ms_median']:.1f}"


def _tok(x: float | None, limit: int | None = None) -> str:
    if x is None:
        return f"> {limit}" if limit is not None else "none"
    return f"{x:.0f}"


def header(doc: dict) -> list[str]:
    env, t = doc["env"], doc["timing"]
    v = env["versions"]
    lines = [
        f"mlakit bench: {doc['model']} one layer, {doc['dtype']}, on {env['device_name']} ({env['device']}), "
        f"{env['threads']} threads, torch {v['torch']}, transformers {v.get('transformers') or 'absent'}",
        f"times: median of up to {t['repeats']} calls after {t['warmup']} warm-up (min–max in results); "
        "shared machine: expect noise",
    ]
    m = doc.get("machine")
    if m:
        peak = m["peak_flops"].get("fp32" if doc["dtype"] == "fp32" else "bf16")
        lines.append(
            f"machine profile: {peak / 1e9:.1f} GFLOP/s matmul ({doc['dtype']}), "
            f"{m['memory_bandwidth'] / 1e9:.1f} GB/s read ({m['name']})"
        )
    for v in doc["gate"]:
        if not v["ok"]:
            lines.append(f"REJECTED {v['backend']}: {v['error']} (not timed)")
    for s in doc["skipped"]:
        lines.append(f"skipped {s['backend']}: {s['reason']}")
    return lines


def path_table(doc: dict) -> list[str]:
    at = index(doc["rows"])
    lines = []
    for batch, cached in sorted({(r["batch"], r["cached"]) for r in doc["rows"] if r["backend"] == ABSORB}):
        lines.append(f"batch {batch}, cached {cached}: one layer step, ms")
        lines.append(f"  {'new':>6} {'absorb':>10} {'materialize':>12} {'auto picks':>11} {'faster':>22}")
        news = sorted({r["new"] for r in doc["rows"] if (r["batch"], r["cached"]) == (batch, cached)})
        for n in news:
            a, m, auto = (at.get((b, batch, cached, n)) for b in (ABSORB, MATERIALIZE, AUTO))
            faster = ""
            if a and m:
                lo, hi = sorted((a, m), key=lambda r: r["ms_median"])
                faster = f"{lo['backend'][7:]} x{hi['ms_median'] / lo['ms_median']:.2f}"
            picks = auto.get("path", "") if auto else ""
            lines.append(f"  {n:>6} {_ms(a):>10} {_ms(m):>12} {picks:>11} {faster:>22}")
    return lines


def decode_table(doc: dict) -> list[str]:
    summary = doc["summary"]["decode"]
    if not summary:
        return []
    seen = {k for d in summary for k in d["slower_than_absorb"]}
    names = [b for b in BACKENDS if b in seen]
    width = max(len(n) for n in names) if names else 0
    lines = [f"decode (new={summary[0]['new']}): each backend's step time over mlakit-absorb's"]
    lines.append(
        f"  {'batch':>5} {'cached':>7} {'absorb ms':>10} {'core ms':>8} "
        + " ".join(f"{n:>{width}}" for n in names)
    )
    for d in summary:
        core = "—" if d["absorb_core_ms"] is None else f"{d['absorb_core_ms']:.1f}"
        cells = " ".join(f"{_x(d['slower_than_absorb'].get(n)):>{width}}" for n in names)
        lines.append(f"  {d['batch']:>5} {d['context']:>7} {d['absorb_ms']:>10.1f} {core:>8} {cells}")
    return lines


def _x(v: float | None) -> str:
    return "—" if v is None else f"x{v:.2f}"


def summary_lines(doc: dict) -> list[str]:
    s = doc["summary"]
    lines = ["crossover (new tokens from which materialize is faster), measured vs predicted:"]
    lines.append(f"  {'batch':>5} {'cached':>7} {'measured':>9} {'FLOP model':>11} {'roofline':>9}")
    for c in s["crossover"]:
        lines.append(
            f"  {c['batch']:>5} {c['context']:>7} {_tok(c['measured'], c['measured_max_new']):>9} "
            f"{_tok(c['flop_model']):>11} {_tok(c['roofline']):>9}"
        )
    for d in s["decode"]:
        parts = [f"absorb at decode, batch {d['batch']}, cached {d['context']}: {d['absorb_ms']:.1f} ms"]
        for name in (MATERIALIZE, "transformers", "einsum-absorb"):
            ratio = d["slower_than_absorb"].get(name)
            if ratio is not None:
                parts.append(_versus(ratio, name))
        if d["absorb_core_pct_peak_flops"] is not None:
            parts.append(f"core {d['absorb_core_pct_peak_flops']:.0f}% of peak matmul")
        if d["absorb_pct_peak_bandwidth"] is not None:
            parts.append(f"step {d['absorb_pct_peak_bandwidth']:.0f}% of peak bandwidth")
        if d["absorb_roofline_fraction"] is not None:
            parts.append(f"step at {100 * d['absorb_roofline_fraction']:.0f}% of its roofline speed")
        lines.append("; ".join(parts))
    lines.append(_auto_line(s["auto"]))
    if any(r.get("pct_peak_bandwidth", 0) > 100 or r.get("pct_peak_flops", 0) > 100 for r in doc["rows"]):
        lines.append("note: some rates exceed the peaks measured in this run (measured at a busier moment)")
    return lines


def _versus(ratio: float, name: str) -> str:
    """Absorb against NAME: "x2.00 faster than NAME", or below 1 "x1.25 slower than NAME"."""
    if ratio >= 1:
        return f"x{ratio:.2f} faster than {name}"
    return f"x{1 / ratio:.2f} slower than {name}"


def _auto_line(a: dict) -> str:
    if not a["cells"]:
        return "auto: no cell timed both paths (regret not computed)"
    verdict = "meets" if a["meets_target"] else "misses"
    hint = (
        ""
        if a["decided_by"] != "analytic model"
        else "; `mlakit calibrate` measures this machine's crossover"
    )
    return (
        f"auto (by {a['decided_by']}): within 5% of the faster path in {a['within_5pct']}/{a['cells']} cells "
        f"({100 * a['fraction']:.0f}%), {verdict} the >= {100 * a['target']:.0f}% target{hint}"
    )


def render(doc: dict) -> str:
    parts = [header(doc), path_table(doc), decode_table(doc), summary_lines(doc)]
    return "\n".join("\n".join(p) for p in parts if p)

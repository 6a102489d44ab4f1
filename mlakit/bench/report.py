"""The printed table and summary of a results document."""

from __future__ import annotations

from mlakit.bench.backends import BACKENDS
from mlakit.bench.summary import ABSORB, AUTO, MATERIALIZE, index, unreliable


def _ms(row: dict | None) -> str:
    """Median ms, with '~' after it where the calls spread beyond the noise threshold."""
    if row is None:
        return "—"
    return f"{row['ms_median']:.1f}" + ("~" if row.get("noisy") else "")


def _tok(x: float | None, limit: int | None = None) -> str:
    if x is None:
        return f"> {limit}" if limit is not None else "none"
    return f"{x:.0f}"


def header(doc: dict) -> list[str]:
    env, t = doc["env"], doc["timing"]
    v = env["versions"]
    lines = [
        f"mlakit bench: {doc['model']} one layer, {doc['dtype']}, on {env['device_name']} ({env['device']}), "
        f"{env['threads']} thread{'s' if env['threads'] != 1 else ''}, torch {v['torch']}, "
        f"transformers {v.get('transformers') or 'absent'}",
        f"times: median of {_calls(t)} calls after {t['warmup']} warm-up, up to "
        f"{t.get('noisy_repeats', t['repeats'])} where they spread over "
        f"{100 * t.get('noisy_spread', 0.2):.0f}% (min–max in results); '~' marks a cell still that noisy",
    ]
    if env.get("core"):
        note = f" ({env['core_note']})" if env.get("core_note") else ""
        lines.append(f"decode core: {env['core']}{note}")
    state = env.get("machine_state")
    if state:
        lines.insert(1, f"threads: {state['reason']}")
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


def _calls(t: dict) -> str:
    lo, hi = t["min_repeats"], t["repeats"]
    return str(hi) if lo == hi else f"{lo}–{hi}"


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
    counting = s["crossover"][0].get("counting", "causal") if s["crossover"] else "causal"
    lines = [
        "crossover (new tokens from which materialize is faster), measured vs predicted "
        f"({counting} counting):"
    ]
    lines.append(f"  {'batch':>5} {'cached':>7} {'measured':>9} {'FLOP model':>11} {'roofline':>9}")
    for c in s["crossover"]:
        noisy = "  (noisy cells: not a firm figure)" if c.get("noisy") else ""
        lines.append(
            f"  {c['batch']:>5} {c['context']:>7} {_tok(c['measured'], c['measured_max_new']):>9} "
            f"{_tok(c['flop_model']):>11} {_tok(c['roofline']):>9}{noisy}"
        )
    for d in s["decode"]:
        parts = [f"absorb at decode, batch {d['batch']}, cached {d['context']}: {d['absorb_ms']:.1f} ms"]
        for name in (MATERIALIZE, "transformers", "einsum-absorb"):
            ratio = d["slower_than_absorb"].get(name)
            if ratio is not None:
                parts.append(_versus(ratio, name))
        if d.get("absorb_spread") is not None and d["absorb_spread"] > 0.2:
            parts[0] += f" (calls spread {100 * d['absorb_spread']:.0f}%: noisy)"
        parts += _rates(d)
        lines.append("; ".join(parts))
    lines += _same_path_lines(s.get("same_path", []))
    lines.append(_auto_line(s["auto"]))
    return lines


def _rates(d: dict) -> list[str]:
    """% of peak figures; a figure above the peak measured in this run is named unreliable instead."""
    out = []
    for key, text in (
        ("absorb_core_pct_peak_flops", "core {:.0f}% of peak matmul"),
        ("absorb_pct_peak_bandwidth", "step {:.0f}% of peak bandwidth"),
    ):
        if d.get(key) is not None:
            out.append(text.format(d[key]) if not unreliable(d[key]) else text.split(" {")[0] + _UNRELIABLE)
    frac = d.get("absorb_roofline_fraction")
    if frac is not None:
        out.append(
            f"step at {100 * frac:.0f}% of its roofline speed"
            if not unreliable(100 * frac)
            else "roofline" + _UNRELIABLE
        )
    return out


_UNRELIABLE = " rate above the peak measured in this run: unreliable (the load changed)"


def _same_path_lines(checks: list[dict]) -> list[str]:
    lines = []
    for c in checks:
        where = f"batch {c['batch']}, cached {c['context']}, new {c['new']}"
        how = " (re-timed in turn)" if c["interleaved"] else ""
        if c["within_noise"]:
            lines.append(
                f"auto ran {c['path']} at {where}: x{c['ratio']:.2f} of {c['path']}'s time, within the "
                f"±{100 * c['noise']:.0f}% noise{how}"
            )
        else:
            lines.append(
                f"auto ran {c['path']} at {where}: x{c['ratio']:.2f} of {c['path']}'s time, beyond the "
                f"±{100 * c['noise']:.0f}% noise{how}: this run was too noisy to rank backends closer "
                f"than {100 * abs(c['ratio'] - 1):.0f}%"
            )
    return lines


def sparse_lines(doc: dict) -> list[str]:
    """The DSA layer's decode rows (mlakit-sparse), when the run has them."""
    rows = doc["summary"].get("sparse") or []
    if not rows:
        return []
    topk = rows[0].get("index_topk")
    lines = [f"sparse decode (DSA, index_topk {topk}): mlakit-sparse step vs dense mlakit-absorb"]
    lines.append(
        f"  {'batch':>5} {'cached':>7} {'sparse ms':>10} {'path':>18} {'absorb ms':>10} {'vs absorb':>10}"
        f" {'predicted ms':>13}"
    )
    for r in rows:
        sp = f"{r['sparse_ms']:.1f}" + ("~" if r["noisy"] else "")
        path = r["path"] or "—"
        ab = "—" if r["absorb_ms"] is None else f"{r['absorb_ms']:.1f}"
        vs = "—" if r["speedup_vs_absorb"] is None else f"x{r['speedup_vs_absorb']:.2f}"
        pred = "—" if r.get("roofline_ms") is None else f"{r['roofline_ms']:.2f}"
        lines.append(f"  {r['batch']:>5} {r['context']:>7} {sp:>10} {path:>18} {ab:>10} {vs:>10} {pred:>13}")
    lines.append("  (vs absorb > 1: the sparse step is faster; sparsity bites past index_topk cached tokens)")
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
    parts = [header(doc), path_table(doc), decode_table(doc), sparse_lines(doc), summary_lines(doc)]
    return "\n".join("\n".join(p) for p in parts if p)

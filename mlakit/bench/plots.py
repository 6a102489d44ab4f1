"""PNG figures from a results document (matplotlib, the `bench` extra); they only read the data."""

from __future__ import annotations

import os

from mlakit.bench.summary import ABSORB, MATERIALIZE

COLORS = {ABSORB: "tab:blue", MATERIALIZE: "tab:orange"}


def matplotlib_missing() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'mlakit[bench]'): plots skipped"
    return None


def write_plots(doc: dict, out_dir: str) -> list[str]:
    """time_vs_new_b<B>.png per batch and speedup_vs_context.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for batch in sorted({c["batch"] for c in doc["summary"]["crossover"]}):
        fig = _time_vs_new(plt, doc, batch)
        paths.append(_save(plt, fig, os.path.join(out_dir, f"time_vs_new_b{batch}.png")))
    if doc["summary"]["decode"]:
        paths.append(_save(plt, _speedup(plt, doc), os.path.join(out_dir, "speedup_vs_context.png")))
    return paths


def token_label(v: float) -> str:
    """1, 16, 256, 1K, 4K, 1M: how a token count reads on an axis."""
    v = int(round(v))
    if v >= 1 << 20 and v % (1 << 20) == 0:
        return f"{v >> 20}M"
    if v >= 1024 and v % 1024 == 0:
        return f"{v >> 10}K"
    return str(v)


def value_label(v: float) -> str:
    """A plain number for a log axis of ms or ratios: 0.5, 2, 30, 400, 5000."""
    return f"{v:g}"


def _token_axis(ax, values) -> None:
    """A log2 axis whose ticks are the measured counts, labelled 1, 16, 1K, ..."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: token_label(v)))
    if len(ticks) == 1:
        ax.set_xlim(ticks[0] / 2, ticks[0] * 2)


def _value_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: value_label(v)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _legend_outside(ax) -> None:
    """Beside the plot, never over a line."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return os.path.abspath(path)


def _series(rows, backend, batch, cached):
    pts = sorted(
        (r["new"], r["ms_median"])
        for r in rows
        if (r["backend"], r["batch"], r["cached"]) == (backend, batch, cached)
    )
    return [p[0] for p in pts], [p[1] for p in pts]


def _time_vs_new(plt, doc: dict, batch: int):
    points = [c for c in doc["summary"]["crossover"] if c["batch"] == batch]
    fig, axes = plt.subplots(1, len(points), figsize=(5.6 * len(points), 3.6), squeeze=False)
    for ax, c in zip(axes[0], points, strict=True):
        news = []
        for backend in (ABSORB, MATERIALIZE):
            x, y = _series(doc["rows"], backend, batch, c["context"])
            news += x
            ax.plot(x, y, "o-", color=COLORS[backend], label=backend[7:] + " (measured)")
        counting = c.get("counting", "causal")
        names = {"measured": "measured", "flop_model": f"FLOP model ({counting})", "roofline": "roofline"}
        for key, style in (("measured", "-"), ("flop_model", "--"), ("roofline", ":")):
            if c[key] is not None and c[key] >= 1:
                ax.axvline(
                    c[key], color="gray", linestyle=style, label=f"crossover, {names[key]}: {c[key]:.0f}"
                )
                news.append(c[key])
        _token_axis(ax, [n for n in news if float(n).is_integer()] or news)
        ax.set_xlim(min(news) / 1.5, max(news) * 1.5)
        _value_axis(ax)
        ax.set_xlabel("new tokens per step")
        measured = f"> {c['measured_max_new']}" if c["measured"] is None else f"{c['measured']:.0f}"
        ax.set_title(f"cached {token_label(c['context'])}: measured crossover {measured}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        _legend_outside(ax)
    axes[0][0].set_ylabel(f"one layer step, median ms ({doc['dtype']}, batch {batch})")
    fig.suptitle(f"{doc['model']}: absorb vs materialize on {doc['env']['device_name']}", fontsize=9)
    return fig


def _speedup(plt, doc: dict):
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    decode = doc["summary"]["decode"]
    names = sorted({k for d in decode for k in d["slower_than_absorb"]} - {"mlakit-auto"})
    for batch in sorted({d["batch"] for d in decode}):
        mine = [d for d in decode if d["batch"] == batch]
        for name in names:
            pts = [
                (d["context"], d["slower_than_absorb"][name]) for d in mine if name in d["slower_than_absorb"]
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=f"vs {name} (batch {batch})")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    _token_axis(ax, [d["context"] for d in decode])
    _value_axis(ax)
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("backend's decode step time / absorb's\n(> 1: absorb faster)")
    ax.set_title(f"{doc['model']}, {doc['dtype']}: decode step against mlakit-absorb", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    _legend_outside(ax)
    return fig

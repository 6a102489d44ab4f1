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


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
    fig, axes = plt.subplots(1, len(points), figsize=(4.2 * len(points), 3.6), squeeze=False)
    for ax, c in zip(axes[0], points, strict=True):
        for backend in (ABSORB, MATERIALIZE):
            x, y = _series(doc["rows"], backend, batch, c["context"])
            ax.plot(x, y, "o-", color=COLORS[backend], label=backend[7:])
        for key, style in (("measured", "-"), ("flop_model", "--"), ("roofline", ":")):
            if c[key] is not None and c[key] >= 1:
                ax.axvline(
                    c[key], color="gray", linestyle=style, label=f"{key.replace('_', ' ')} {c[key]:.0f}"
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("new tokens per step")
        measured = f"> {c['measured_max_new']}" if c["measured"] is None else f"{c['measured']:.0f}"
        ax.set_title(f"cached {c['context']}: measured crossover {measured}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"one layer step, ms ({doc['dtype']}, batch {batch})")
    fig.suptitle(f"{doc['model']}: absorb vs materialize on {doc['env']['device_name']}", fontsize=9)
    return fig


def _speedup(plt, doc: dict):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
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
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("absorb's speedup at decode (x)")
    ax.set_title(f"{doc['model']}, {doc['dtype']}: decode step, others' time / absorb's", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    return fig

"""mlakit explore: write the offline explorer page and print its path (opens nothing)."""

from __future__ import annotations

from mlakit.explore import write_explorer


def register(sub) -> None:
    p = sub.add_parser("explore", help="write the interactive offline HTML page and print its path")
    p.add_argument("--out", default="mlakit-explorer.html", help="page to write (./mlakit-explorer.html)")
    p.add_argument("--bench", metavar="RESULTS.json", help="overlay the measured times of bench results")
    p.set_defaults(func=run)


def run(args) -> int:
    print(write_explorer(args.out, args.bench))
    return 0

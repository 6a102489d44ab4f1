"""mlakit explore: write the offline explorer page and print its path (opens nothing)."""

from __future__ import annotations

from mlakit.commands.args import check_out_file


def register(sub) -> None:
    p = sub.add_parser("explore", help="write the interactive offline HTML page and print its path")
    p.add_argument("--out", default="mlakit-explorer.html", help="page to write (./mlakit-explorer.html)")
    p.add_argument("--bench", metavar="RESULTS.json", help="overlay the measured times of bench results")
    p.set_defaults(func=run)


def run(args) -> int:
    from mlakit.explore import write_explorer

    check_out_file(args.out)
    print(write_explorer(args.out, args.bench))
    return 0

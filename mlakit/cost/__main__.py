"""`python -m mlakit.cost --markdown`: print the preset tables of docs/cost-model.md."""

from __future__ import annotations

import argparse
import sys

from mlakit.cost.report import markdown_tables


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlakit.cost", description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true", help="print the preset tables as markdown")
    p.add_argument("--context", type=int, default=4096, help="cached tokens for the crossover table")
    p.add_argument("--sequence", type=int, default=131072, help="tokens for the per-sequence cache column")
    p.add_argument("--machine", default="h100", help="machine preset for the roofline column")
    args = p.parse_args(argv)
    if not args.markdown:
        p.print_help()
        return 0
    sys.stdout.write(markdown_tables(args.context, args.sequence, args.machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())

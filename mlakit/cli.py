"""`mlakit` console command: argparse subcommands, each defined in `mlakit.commands.<name>`."""

from __future__ import annotations

import argparse
import importlib
import sys

# each module defines register(subparsers) and sets a `func(args) -> int` default on its parser
COMMAND_MODULES = (
    "models",
    "check",
    "crossover",
    "cache",
    "cost",
    "explore",
    "cp_check",
    "bench",
    "calibrate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlakit",
        description="Multi-head Latent Attention: both algorithms, the cost model, the crossover.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"mlakit.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:
        print(f"mlakit {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

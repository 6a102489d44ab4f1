"""`mlakit` console command: argparse subcommands, each defined in `mlakit.commands.<name>`.

Every failure a user can cause ends in one line `mlakit CMD: error: ...` on stderr and exit
status 2, checked before any work (set MLAKIT_DEBUG=1 to see the traceback instead).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mlakit import __version__

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
    "serve",
    "bench_serve",
    "generate",
)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, `mlakit CMD: error: ...` (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="mlakit",
        description="Multi-head Latent Attention: both algorithms, the cost model, the crossover.",
    )
    parser.add_argument("--version", action="version", version=f"mlakit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"mlakit.commands.{name}").register(sub)
    parser.set_defaults(_commands=sub.choices)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, with a flag the command does not know reported by that command's parser."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        args._commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _user_error(err: BaseException) -> str | None:
    """The one-line message of an error the user caused, or None for a bug (shown as a traceback)."""
    if isinstance(err, OSError) and not isinstance(err, BrokenPipeError):
        where = f": {err.filename}" if getattr(err, "filename", None) else ""
        return f"{err.strerror or err}{where}"
    if isinstance(err, ValueError | OverflowError):
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, MemoryError):
        return "out of memory; lower the sizes"
    if isinstance(err, RuntimeError) and ("out of memory" in str(err) or type(err).__name__ == "RankFailure"):
        return str(err).splitlines()[0]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse(parser, argv)
    except SystemExit as done:  # --help, --version, a usage error: argparse has printed its line
        return done.code if isinstance(done.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # `mlakit models | head -2`: the reader left; say nothing more (and nothing at exit)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"mlakit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        message = _user_error(err)
        if message is None or os.environ.get("MLAKIT_DEBUG"):
            raise
        print(f"mlakit {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

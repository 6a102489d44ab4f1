"""Subcommands of the `mlakit` CLI; each module has `register(subparsers)`."""

import json
import sys


def emit_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")

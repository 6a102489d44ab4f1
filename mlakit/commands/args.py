"""Argument types and checks every command shares; torch-free, and all run before any work."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

# a context beyond this is not a sequence any model serves; it also keeps float arithmetic finite
MAX_TOKENS = 1 << 40
_SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_count(text: str, name: str, low: int = 0, high: int = MAX_TOKENS) -> int:
    """'4096', '4K' (= 4096) or '1M' → int in [low, high]; ValueError naming the flag otherwise."""
    part = str(text).strip().lower().replace("_", "")
    scale = _SUFFIX.get(part[-1:], 1) if part else 1
    digits = part[:-1] if scale > 1 else part
    if not digits.isdigit() or len(digits) > 15:
        raise ValueError(f"--{name} takes a whole number (4K = 4096, 1M = 1048576), got {text!r}")
    value = int(digits) * scale
    if not low <= value <= high:
        raise ValueError(f"--{name} must be from {low:,} to {high:,}, got {text!r}")
    return value


def parse_count_list(text: str, name: str, low: int = 0, high: int = MAX_TOKENS) -> tuple[int, ...]:
    """'1,8,1K' → (1, 8, 1024); at least one value; ValueError naming the flag otherwise."""
    parts = [p for p in str(text).split(",")]
    if not str(text).strip() or any(not p.strip() for p in parts):
        raise ValueError(f"--{name} takes comma-separated whole numbers (1K = 1024), got {text!r}")
    return tuple(parse_count(p, name, low, high) for p in parts)


def count_type(name: str, low: int = 0, high: int = MAX_TOKENS):
    """An argparse `type=` for one count; its error is argparse's one-line usage error."""

    def convert(text: str) -> int:
        try:
            return parse_count(text, name, low, high)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"--{name} ")) from None

    convert.__name__ = name
    return convert


# why a command that runs MLA's two paths has nothing to run on a DeepSeek-V4 model
_V4_HAS_NO = {
    "crossover": "no absorb/materialize crossover",
    "check": "no absorb and materialize paths to compare",
    "bench": "no absorb/materialize backends to time (benchmarks/v4_decode.py times V4's layer)",
    "calibrate": "no absorb/materialize crossover to calibrate",
    "cp-check": "no latent cache for context parallelism to split",
}


def resolve_model(value: str, command: str | None = None):
    """MLAConfig for --model (a preset, a config.json or a folder), with the file named on a bad file;
    a DeepSeek-V4 model is refused naming what `command` would need and where V4 is covered."""
    from mlakit.commands.v4 import is_v4
    from mlakit.config import MLAConfig

    if command in _V4_HAS_NO and is_v4(value):
        raise ValueError(
            f"--model {value!r} is a DeepSeek-V4 model (one shared K = V head over a window and compressed "
            f"entries, no MLA latent): {_V4_HAS_NO[command]}; `mlakit cost --model {value}` gives its "
            f"terms and `mlakit cache --model {value}` its cache and capacity (docs/v4.md)"
        )
    try:
        return MLAConfig.resolve(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"--model {value!r}: {_json_file(value)} is not JSON ({err})") from None
    except (TypeError, AttributeError, KeyError) as err:
        raise ValueError(
            f"--model {value!r}: not an MLA config.json object ({type(err).__name__}: {err})"
        ) from None
    except OSError as err:
        raise ValueError(f"--model {value!r}: {err.strerror or err}") from None


def _json_file(value: str) -> str:
    return os.path.join(value, "config.json") if os.path.isdir(value) else value


def check_out_dir(value: str, flag: str = "--out") -> None:
    """A folder we can create or write into; checked before any measuring by writing a probe file (and
    any missing folders), all removed again: permission bits alone pass /proc/nope for root."""
    if not value:
        raise ValueError(f"{flag} must name a folder, got an empty string")
    path = os.path.abspath(value)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {value!r} is an existing file; it must be a folder (or not exist)")
    parent = _existing_parent(path)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {value!r}: {parent!r} is a file, not a folder")
    _probe_writable(path, parent, value, flag)


def check_out_file(value: str, flag: str = "--out") -> None:
    """A file path whose folder exists and is writable, and that is not itself a folder."""
    if not value:
        raise ValueError(f"{flag} must name a file, got an empty string")
    path = os.path.abspath(value)
    if os.path.isdir(path):
        raise ValueError(f"{flag} {value!r} is a folder; it must name a file")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {value!r}: folder {parent!r} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {value!r}: not writable")
    _probe_writable(parent, parent, value, flag)


def _probe_writable(path: str, existing: str, value: str, flag: str) -> None:
    """Make the missing folders from `existing` down to `path`, write and delete a file there, then
    remove the folders made: a ValueError naming the flag if any step fails."""
    made = []
    try:
        for folder in _missing_folders(existing, path):
            os.mkdir(folder)
            made.append(folder)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        what = "cannot write into it" if os.path.isdir(path) else "cannot create it"
        raise ValueError(f"{flag} {value!r}: {what} ({err.strerror or err})") from None
    finally:
        for folder in reversed(made):
            os.rmdir(folder)


def _missing_folders(existing: str, path: str) -> list[str]:
    """The folders between `existing` (excluded) and `path` (included), top first."""
    out = []
    while path != existing and path != os.path.dirname(path):
        out.append(path)
        path = os.path.dirname(path)
    return out[::-1]


def _existing_parent(path: str) -> str:
    while not os.path.exists(path):
        up = os.path.dirname(path)
        if up == path:
            break
        path = up
    return path


def available_memory() -> int | None:
    """Bytes the OS says can be allocated now (MemAvailable of /proc/meminfo; psutil if present)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def check_memory(need: int, what: str, flags: str) -> None:
    """Refuse before allocating when `need` bytes exceed what the machine has available now."""
    from mlakit.cost import format_bytes

    have = available_memory()
    if have is not None and need > have:
        raise ValueError(
            f"{what} needs about {format_bytes(need)} of memory, this machine has {format_bytes(have)} "
            f"available; lower {flags}"
        )


def positive(args, *names: str, low: int = 1) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def add_step_mode(p) -> None:
    """--enforce-eager / --compile (mutually exclusive): the engine's `enforce_eager` True / False; neither:
    None (compiled only where a measurement on this machine found it faster, docs/engine.md)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--enforce-eager",
        dest="enforce_eager",
        action="store_const",
        const=True,
        default=None,
        help="eager steps only (nothing compiled)",
    )
    g.add_argument(
        "--compile",
        dest="enforce_eager",
        action="store_const",
        const=False,
        help="compile the step for every token-count bucket at start (cached on disk) and measure it",
    )

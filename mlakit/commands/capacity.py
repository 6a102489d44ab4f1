"""`mlakit cache --memory 80GB`: sequences per rank after the weights (mlakit.cost.capacity), printed
with the arithmetic; and the byte sizes the flags take (GB = 10^9 bytes, GiB = 2^30)."""

from __future__ import annotations

import math
import re

from mlakit.commands import plural
from mlakit.cost import format_bytes
from mlakit.cost.capacity import WEIGHT_BYTES, capacity

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50})
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
MAX_BYTES = 2**53  # 9 PB: exact in the page's JavaScript numbers too


def parse_bytes(text: str, name: str, low: int = 1) -> int:
    """'80GB' (80·10^9), '80GiB' (80·2^30), '1.5TB', '85899345920' → whole bytes >= low (1; the weights
    may be 0, as mlakit.cost.capacity takes them)."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS:
        raise ValueError(
            f"--{name} takes a size in bytes, or with a unit (80GB = 80·10^9 bytes, 80GiB = 80·2^30; "
            f"B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), got {text!r}"
        )
    value = math.floor(float(m.group(1)) * UNITS[unit] + 0.5)  # half up, as the page rounds
    if not low <= value <= MAX_BYTES:
        least = "1 byte" if low == 1 else f"{low:,} bytes"
        raise ValueError(f"--{name} must be from {least} to {MAX_BYTES:,} bytes (2^53), got {text!r}")
    return value


def add_capacity_args(p) -> None:
    p.add_argument(
        "--memory",
        help="memory per rank (80GB = 80·10^9 bytes, 80GiB = 80·2^30): print how many sequences of "
        "--context tokens fit after the weights",
    )
    p.add_argument(
        "--weights-memory",
        help="the whole model's weights, in bytes or with a unit (default: the preset's parameter count "
        "× --weights-dtype); split over --tp ranks",
    )
    p.add_argument(
        "--weights-dtype",
        choices=tuple(WEIGHT_BYTES),
        default="bf16",
        help="bytes per parameter of the weights (bf16)",
    )


def capacity_from_args(cfg, args, groups=None, table=None) -> dict | None:
    """The capacity section for --memory, or None without it; every flag checked before any arithmetic.
    `table`: the capacity function (MLA's `capacity` by default, `v4_capacity` for a V4 model)."""
    if args.memory is None:
        if args.weights_memory is not None:
            raise ValueError("--weights-memory needs --memory (the memory per rank to plan for)")
        return None
    memory = parse_bytes(args.memory, "memory")
    weights, on_disk = weights_from_args(args)
    sizes = (cfg, args.context, memory, args.dtype, args.tp, args.cp, weights, args.weights_dtype)
    c = capacity(*sizes, groups) if table is None else table(*sizes)
    return with_disk_source(c, on_disk)


def weights_from_args(args) -> tuple[int | None, dict | None]:
    """(--weights-memory in bytes, or the folder's safetensors bytes, or None; the folder's figures):
    --weights-memory wins, then a --model folder's safetensors headers, then the parameter count."""
    from mlakit.commands.weights_on_disk import folder_weights

    if args.weights_memory is not None:
        return parse_bytes(args.weights_memory, "weights-memory", 0), None
    on_disk = folder_weights(args.model)
    return (None, None) if on_disk is None else (on_disk["bytes"], on_disk)


def with_disk_source(c: dict, on_disk: dict | None) -> dict:
    """Mark the weights as summed from the folder's safetensors (not given by --weights-memory)."""
    if on_disk is not None:
        c["weights"].update(source="safetensors", files=on_disk["files"], folder=on_disk["folder"])
    return c


def print_weights_line(c: dict) -> None:
    """Weights, their share per rank, and the free memory: the first line of every capacity table."""
    w = c["weights"]
    if w["source"] == "given":
        how = f"{format_bytes(w['bytes'])} (--weights-memory)"
    elif w["source"] == "safetensors":
        files = plural(w["files"], "safetensors file")
        how = f"{format_bytes(w['bytes'])} (summed from the headers of the {files} in {w['folder']})"
    else:
        per = f"{WEIGHT_BYTES[w['dtype']]} B ({w['dtype']})"
        how = f"{w['parameters']:.4g} parameters × {per} = {format_bytes(w['bytes'])}"
    ranks = f"tp={c['tp']} cp={c['cp']}"
    print(
        f"capacity per rank ({ranks}) of {format_bytes(c['memory_bytes'])}: weights {how}, "
        f"/ tp {c['tp']} = {format_bytes(w['bytes_per_rank'])} per rank; "
        f"free {format_bytes(c['memory_bytes'])} - {format_bytes(w['bytes_per_rank'])} = "
        f"{format_bytes(c['free_bytes_per_rank'])}"
    )


def print_capacity(c: dict) -> None:
    print_weights_line(c)
    print(
        f"a sequence of {plural(c['context'], 'token')} keeps {c['tokens_per_rank']:,} on the fullest cp "
        f"rank; sequences = floor(free / (B/token/layer × {plural(c['num_layers'], 'layer')} × "
        f"{plural(c['tokens_per_rank'], 'token')}))"
    )
    head = f"{'cache':<17} {'dtype':>5} {'B/token/layer':>13} {'per sequence':>13} {'sequences':>10}"
    print(f"{head}  arithmetic")
    free = format_bytes(c["free_bytes_per_rank"])
    for name, r in c["caches"].items():
        per_seq = format_bytes(r["bytes_per_sequence_per_rank"])
        print(
            f"{name:<17} {r['dtype']:>5} {r['bytes_per_token_per_layer_per_rank']:>13,} {per_seq:>13} "
            f"{r['sequences_per_rank']:>10,}  floor({free} / {per_seq}); {r['note']}"
        )
    if c["free_bytes_per_rank"] == 0:
        print("the weights alone fill the memory: no sequence fits; raise --tp or --memory")

"""A longer seeded fuzz run than CI's: configs, checkpoints, CLI argument garbage, fp8 error model, the
step protocol (random protocol drivers, garbage protocol calls during an open step).

Prints, per class, how many cases ran and how many failed, and the failure classes (exception type and
the start of its message) with a count and one example each. A case passes when it ends in a
ValueError (or, for the CLI, a clean exit with a message) or in a working result: a config that
builds a layer and runs one tiny forward, a checkpoint that loads finite weights, an fp8 decode error
within the band of docs/cache.md. The CLI class only reports.

    PYTHONPATH=. python benchmarks/fuzz.py --cases 2000 --seed 0 [--only configs,cli] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

GARBAGE = [
    None, True, False, 0, 1, -1, 3, 2**31, 2**70, 0.5, 1.0, -2.5, 1e308, float("nan"), float("inf"),
    "", "4", "abc", "true", "false", "yarn", "default", [], [1], [128, 128], ["float32"], {},
    {"type": "yarn"},
]  # fmt: skip


def garbage(rng: random.Random):
    extra = [rng.randint(-5, 300), rng.uniform(-10, 1e5), rng.choice("xyz") * rng.randint(1, 3)]
    return copy.deepcopy(rng.choice(GARBAGE + extra))


def classify(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:60]}"


class Tally:
    def __init__(self, name: str):
        self.name, self.cases, self.accepted, self.failures, self.examples = name, 0, 0, Counter(), {}

    def run(self, case: Callable[[], None], describe: Callable[[], str]) -> None:
        self.cases += 1
        try:
            self.accepted += bool(case())
        except Exception as err:  # every non-ValueError is a failure class
            key = classify(err)
            self.failures[key] += 1
            self.examples.setdefault(key, describe())

    def report(self) -> dict:
        failed = sum(self.failures.values())
        print(
            f"{self.name}: {self.cases} cases, {failed} failed, {len(self.failures)} failure classes "
            f"({self.accepted} worked, {self.cases - failed - self.accepted} refused cleanly)"
        )
        for key, n in self.failures.most_common(12):
            print(f"  {n:>5} × {key}\n        e.g. {self.examples[key][:150]}")
        return {
            "cases": self.cases,
            "accepted": self.accepted,
            "failed": failed,
            "classes": dict(self.failures),
        }


# ---------------------------------------------------------------- configs


def fuzz_configs(rng: random.Random, n: int) -> Tally:
    from test_config_fuzz import HF, TOP_KEYS, YARN_SUBKEYS, runs_one_forward, small_enough

    from mlakit import MLAConfig
    from mlakit.attention import MLAAttention

    tally = Tally("configs")
    fields = [f.name for f in dataclasses.fields(MLAConfig)]
    for _ in range(n):
        from_hf = rng.random() < 0.6
        d = json.loads(json.dumps(HF)) if from_hf else MLAConfig.from_hf(HF).to_dict()
        keys = TOP_KEYS if from_hf else fields
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.6 or not isinstance(d.get("rope_scaling"), dict):
                d[rng.choice(keys)] = garbage(rng)
            else:
                d["rope_scaling"][rng.choice(YARN_SUBKEYS)] = garbage(rng)

        def case(d=d, from_hf=from_hf):
            try:
                cfg = MLAConfig.from_hf(d) if from_hf else MLAConfig(**d)
            except ValueError:
                return False
            if small_enough(cfg):
                runs_one_forward(cfg)
            else:
                MLAAttention(cfg, device="meta")
            return True

        tally.run(case, lambda d=d: repr(d))
    return tally


# ---------------------------------------------------------------- checkpoints

DTYPE_CHOICES = [torch.int32, torch.bool, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]


def fuzz_checkpoints(rng: random.Random, n: int) -> Tally:
    from test_load_fuzz import CONFIG, layer_tensors, to_fp8, write_checkpoint

    from mlakit.hf import load_attention

    tally = Tally("checkpoints")
    base = {**layer_tensors(0), **layer_tensors(1)}
    with tempfile.TemporaryDirectory() as root:
        for i in range(n):
            folder = os.path.join(root, f"c{i}")
            fp8 = rng.random() < 0.4
            tensors = {k: v.clone() for k, v in (to_fp8(base) if fp8 else base).items()}
            config = dict(CONFIG)
            if fp8:
                config["quantization_config"] = {"weight_block_size": [128, 128]}
            what = mutate_checkpoint(rng, config, tensors)
            write_checkpoint(folder, config=config, tensors=tensors)
            what += corrupt_files(rng, folder)
            kwargs = load_arguments(rng)

            def case(folder=folder, kwargs=kwargs):
                try:
                    layer = load_attention(folder, **kwargs)
                except ValueError:
                    return False
                bad = [k for k, v in layer.state_dict().items() if not bool(torch.isfinite(v).all())]
                if bad:
                    raise AssertionError(f"loaded non-finite tensors {bad}")
                return True

            tally.run(case, lambda what=what, kwargs=kwargs: f"{what}; load_attention(**{kwargs})")
    return tally


def mutate_checkpoint(rng: random.Random, config: dict, tensors: dict) -> str:
    done = []
    for _ in range(rng.randint(0, 2)):
        r = rng.random()
        if r < 0.4:
            key = rng.choice([*CONFIG_KEYS, "quantization_config", "torch_dtype", "dtype"])
            config[key] = garbage(rng)
            done.append(f"config[{key}]={config[key]!r}")
        elif r < 0.55 and config.get("quantization_config") is not None:
            config["quantization_config"] = {"weight_block_size": garbage(rng)}
            done.append(f"weight_block_size={config['quantization_config']['weight_block_size']!r}")
        else:
            name = rng.choice(sorted(tensors))
            t, how = tensor_mutation(rng, tensors[name])
            done.append(f"{name}: {how}")
            if t is None:
                tensors.pop(name)
            else:
                tensors[name] = t
    return ", ".join(done) or "intact"


CONFIG_KEYS = ["hidden_size", "num_attention_heads", "kv_lora_rank", "num_hidden_layers", "rope_theta"]


def tensor_mutation(rng: random.Random, t: torch.Tensor):
    r = rng.random()
    if r < 0.2:
        return None, "dropped"
    if r < 0.45:
        dtype = rng.choice(DTYPE_CHOICES)
        return t.float().to(dtype), f"as {dtype}"
    if r < 0.7:
        t = t.float().clone()
        value = rng.choice([float("nan"), float("inf"), -float("inf"), 1e6, 0.0])
        t.view(-1)[rng.randrange(t.numel())] = value
        return t, f"one value {value}"
    if r < 0.85 and t.dim() == 2 and t.shape[1] > 1:
        return t[:, :-1].contiguous(), "one column short"
    return t.reshape(-1).contiguous(), "flattened"


def corrupt_files(rng: random.Random, folder: str) -> str:
    if rng.random() > 0.15:
        return ""
    name = rng.choice(["config.json", "model.safetensors", "model.safetensors.index.json"])
    path = os.path.join(folder, name)
    how = rng.choice(["truncate", "flip", "binary", "bom", "empty"])
    data = b"{}"
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
    if how == "truncate":
        data = data[: rng.randrange(max(1, len(data)))]
    elif how == "flip":
        data = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data)
    elif how == "binary":
        data = bytes(rng.randrange(256) for _ in range(64))
    elif how == "bom":
        data = b"\xef\xbb\xbf" + data
    else:
        data = b""
    with open(path, "wb") as f:
        f.write(data)
    return f", {name} {how}"


def load_arguments(rng: random.Random) -> dict:
    kwargs = {"layer": rng.choice([1, 1, 1, 0, 2, -1, "1", 1.0, None, True])}
    if rng.random() < 0.3:
        kwargs["dtype"] = rng.choice([*DTYPE_CHOICES, torch.float32, torch.float64, "float32", None, 3])
    if rng.random() < 0.15:
        kwargs["device"] = rng.choice(["cpu", "nonsense", "cuda:99", 0, -1, "meta"])
    return kwargs


# ---------------------------------------------------------------- CLI (report only)

CHEAP = {
    "models": ["--json"],
    "crossover": ["--model", "--context", "--json", "--counting", "--machine", "--dtype"],
    "cache": ["--model", "--context", "--json", "--dtype", "--gqa-groups", "--cp", "--tp"],
    "cost": ["--model", "--context", "--json", "--new", "--dtype", "--machine", "--counting", "--fused"],
}
CLI_VALUES = ["deepseek-v3", "kimi-k2", "minicpm3-4b", "nope", ".", "/", "", "0", "-1", "1", "7",
              "2**31", "1e9", "99999999999999999999", "nan", "inf", "1.5", "abc", "fp8", "bf16", "causal",
              "x" * 300]  # fmt: skip


def fuzz_cli(rng: random.Random, n: int) -> Tally:
    from mlakit.cli import main

    tally = Tally("cli")
    for _ in range(n):
        command = rng.choice(sorted(CHEAP))
        argv = [command]
        for _ in range(rng.randint(0, 4)):
            flag = rng.choice(CHEAP[command] + ["--bogus"])
            argv.append(flag)
            if flag not in ("--json", "--fused") and rng.random() < 0.9:
                argv.append(rng.choice(CLI_VALUES))

        def case(argv=argv):
            out, err = io.StringIO(), io.StringIO()
            with (
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(err),
                contextlib.suppress(SystemExit),
            ):
                main(argv)

        tally.run(case, lambda argv=argv: "mlakit " + " ".join(argv))
    return tally


# ---------------------------------------------------------------- fp8 error model


def fuzz_fp8(rng: random.Random, n: int) -> Tally:
    from test_quant_bound import HIGH, HIGH_MAX, LOW, decode_pair, make_case, predicted_error

    tally = Tally("fp8")
    ratios = []
    for _ in range(n):
        shape = dict(
            latent=rng.choice([128, 256, 512]), heads=rng.randint(1, 8), nope=rng.randint(1, 12),
            v=rng.randint(1, 12), rope=rng.choice([2, 4, 8]), hidden=rng.randint(8, 48),
            context=rng.randint(1, 60), batch=rng.randint(1, 2), sharp=rng.choice([0.3, 1.0, 3.0, 10.0]),
            seed=rng.randint(0, 2**16),
        )  # fmt: skip
        if shape["heads"] * shape["v"] < 8:
            continue
        mode = rng.choice(["absorb", "materialize"])

        def case(shape=shape, mode=mode):
            layer, prompt, step = make_case(**shape)
            exact, lossy = decode_pair(layer, prompt, step, mode)
            err = (lossy - exact).double()
            want = predicted_error(layer, prompt, step)
            norm = float(err.norm() / exact.double().norm()) / want
            top = float(err.abs().max() / exact.abs().max()) / want
            ratios.append((norm, top))
            if not (LOW <= norm <= HIGH and top <= HIGH_MAX):
                raise AssertionError(f"realized/model: norm {norm:.2f}, max {top:.2f}")
            return True

        tally.run(case, lambda shape=shape, mode=mode: f"{shape} {mode}")
    if ratios:
        norms, tops = [r[0] for r in ratios], [r[1] for r in ratios]
        print(f"fp8 realized/model: norm {min(norms):.2f} .. {max(norms):.2f}, max up to {max(tops):.2f}")
    return tally


# ---------------------------------------------------------------- the step protocol

PROTOCOL_CALLS = ["plan", "commit", "discard", "write", "release", "copy_from", "append", "layer", "lengths"]


def fuzz_protocol(rng: random.Random, n: int) -> Tally:
    """Half the cases: a short run of tests/test_protocol_driver.py's driver (random seed, 30 operations,
    checked against the fp64 stack). Half: one protocol call with garbage arguments while a step is
    open; a refusal must change nothing (buffers, bookkeeping, the open plan), and whatever happened,
    the next good step must run (no wedged cache)."""
    from test_protocol_driver import Driver

    tally = Tally("protocol")
    for _ in range(n):
        kind, seed = rng.choice(["contiguous", "paged"]), rng.randrange(2**31)
        if rng.random() < 0.5:

            def case(kind=kind, seed=seed):
                with torch.no_grad():
                    Driver(kind, seed).run(30)
                return True

            tally.run(case, lambda kind=kind, seed=seed: f"Driver({kind!r}, {seed}).run(30)")
            continue
        call = rng.choice(PROTOCOL_CALLS)
        args = [garbage(rng) for _ in range(rng.randint(0, 4))]
        tally.run(
            lambda kind=kind, call=call, args=args: protocol_case(kind, call, args),
            lambda kind=kind, call=call, args=args: f"{kind}: {call}(*{args!r}) during an open step",
        )
    return tally


def protocol_case(kind: str, call: str, args: list) -> bool:
    from support.cache import assert_same, make_cache, make_layers, run, state

    cache, layers = make_cache(kind), make_layers()
    with torch.no_grad():
        run(layers, torch.randn(3, 2, 32), first := cache.plan(2))
        cache.commit(first)
        plan = cache.plan(1, [0, 1])
        layers[0](torch.randn(2, 1, 32), plan)
        other = cache.plan(1, [0, 1]) if call == "copy_from" else None
        plan = other or plan
        calls = {
            "plan": lambda *a: cache.plan(*a[:2], **dict(zip(("seq_len", "batch"), a[2:], strict=False))),
            "commit": lambda *a: cache.commit(plan, layers=a[0] if a else None),
            "discard": lambda *a: cache.discard(a[0] if a else plan),
            "write": lambda *a: cache.write(plan, *a),
            "release": lambda *a: cache.release(*a),
            "copy_from": lambda *a: first.copy_from(a[0] if a else plan),
            "append": lambda *a: cache.append(*a),
            "layer": lambda *a: layers[1](torch.randn(2, 1, 32), plan, *a),
            "lengths": lambda *a: cache.lengths.__setitem__(0, a[0] if a and isinstance(a[0], int) else 1),
        }
        before, was = state(cache), plan.state
        try:
            calls[call](*args)
            accepted = True
        except (ValueError, TypeError) as err:
            if isinstance(err, TypeError) and "argument" not in str(err):
                raise  # a TypeError from inside, not a wrong call signature
            assert_same(cache, before, f"a refused {call}")
            assert plan.state == was, f"a refused {call} changed the open plan ({was} -> {plan.state})"
            accepted = False
        try:  # whatever happened, the cache takes the next good step
            if plan.state in ("open", "stale"):
                cache.discard(plan)
            cache.lengths.clamp_(0, 2)
            run(layers, torch.randn(1, 1, 32), good := cache.plan(1, [2]))
            cache.commit(good)
        except ValueError as err:
            raise AssertionError(f"wedged after {call}: {err}") from err
    return accepted


CLASSES = {
    "configs": fuzz_configs,
    "checkpoints": fuzz_checkpoints,
    "cli": fuzz_cli,
    "fp8": fuzz_fp8,
    "protocol": fuzz_protocol,
}
# relative cost: the checkpoint and fp8 cases build files and layers, a protocol case runs a driver
SHARE = {"configs": 1.0, "checkpoints": 0.25, "cli": 0.5, "fp8": 0.1, "protocol": 0.1}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=2000, help="config cases; the other classes scale from it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=",".join(CLASSES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for name in args.only.split(","):
        start = time.perf_counter()
        tally = CLASSES[name](random.Random(f"{args.seed}-{name}"), max(1, int(args.cases * SHARE[name])))
        results[name] = tally.report() | {"seconds": round(time.perf_counter() - start, 1)}
        print(f"  ({results[name]['seconds']} s)")
    total = sum(r["cases"] for r in results.values())
    failed = sum(r["failed"] for r in results.values())
    print(f"total: {total} cases, {failed} failed (seed {args.seed})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every mistake a user can make on the command line: one line `mlakit CMD: error: ...`, exit 2, no
traceback, nothing written, and refused before any work (a run that started measuring would time out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlakit.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = {  # written into the test's folder before the command runs
    "a-file": "not a folder\n",
    "list.json": "[1, 2, 3]\n",
    "garbage.json": "garbage\n",
    "empty/config.json": "",
    "tiny-rate.json": json.dumps(
        {"name": "slow", "peak_flops": {"fp32": 1e-300, "bf16": 1e-300}, "memory_bandwidth": 1e-300}
    ),
}

CASES = {
    "bench-out-existing-file": ["bench", "--out", "a-file"],
    "bench-out-under-a-file": ["bench", "--out", "a-file/sub"],
    "bench-out-empty": ["bench", "--out", ""],
    "bench-out-proc": ["bench", "--out", "/proc/nope"],
    "bench-out-proc-deep": ["bench", "--out", "/proc/nope/a/b"],
    "bench-huge-context": ["bench", "--context", "100000000", "--new", "1000000"],
    "bench-huge-batch": ["bench", "--batch", "100000"],
    "bench-empty-batch": ["bench", "--batch", ""],
    "bench-batch-commas": ["bench", "--batch", "1,,2"],
    "bench-device-nonsense": ["bench", "--device", "nonsense"],
    "bench-device-tpu": ["bench", "--device", "tpu"],
    "bench-model-json-list": ["bench", "--model", "list.json"],
    "bench-threads-zero": ["bench", "--threads", "0"],
    "explore-out-folder": ["explore", "--out", "empty"],
    "explore-out-empty": ["explore", "--out", ""],
    "explore-out-proc": ["explore", "--out", "/proc/nope.html"],
    "explore-bench-garbage": ["explore", "--bench", "garbage.json"],
    "check-huge-prefill": ["check", "--prefill", "1000000"],
    "check-huge-batch": ["check", "--batch", "1000000"],
    "check-decode-steps": ["check", "--decode-steps", "1000000000"],
    "check-model-empty-folder": ["check", "--model", "empty/"],
    "cost-context-power": ["cost", "--context", "10^300", "--new", "1"],
    "cost-context-digits": ["cost", "--context", "1" + "0" * 300, "--new", "1"],
    "cost-machine-garbage": ["cost", "--context", "4K", "--new", "1", "--machine", "garbage.json"],
    "cost-machine-missing": ["cost", "--context", "4K", "--new", "1", "--machine", "nope.json"],
    "cost-infinity-json": ["cost", "--context", "4K", "--new", "1", "--machine", "tiny-rate.json", "--json"],
    "cost-model-json-list": ["cost", "--context", "4K", "--new", "1", "--model", "list.json"],
    "crossover-model-empty": ["crossover", "--model", "empty/"],
    "crossover-context-negative": ["crossover", "--context", "-5"],
    "cache-cp-huge": ["cache", "--cp", "1000000000"],
    "cache-tp-over-heads": ["cache", "--tp", "1024"],
    "cache-gqa-commas": ["cache", "--gqa-groups", ",,,"],
    "cache-gqa-letters": ["cache", "--gqa-groups", "4,x"],
    "cache-context-junk": ["cache", "--context", "4Q"],
    "cp-check-context-huge": ["cp-check", "--context", "1000000000000"],
    "cp-check-world-size-64": ["cp-check", "--world-size", "64"],
    "cp-check-world-size-0": ["cp-check", "--world-size", "0"],
    "calibrate-max-new-0": ["calibrate", "--max-new", "0"],
    "calibrate-device-nonsense": ["calibrate", "--device", "nonsense"],
    "calibrate-out-folder-is-file": ["calibrate", "--out", "a-file/x.json"],
    "calibrate-out-proc": ["calibrate", "--out", "/proc/nope.json"],
    "calibrate-out-proc-folder": ["calibrate", "--out", "/proc/nope"],
    "bench-v4": ["bench", "--model", "deepseek-v4-pro", "--out", "v4-out"],
    "check-v4": ["check", "--model", "deepseek-v4-flash"],
    "crossover-v4": ["crossover", "--model", "deepseek-v4-pro"],
    "calibrate-v4": ["calibrate", "--model", "deepseek-v4-pro", "--out", "v4.json"],
    "cp-check-v4": ["cp-check", "--model", "deepseek-v4-pro"],
    "calibrate-max-minutes-negative": ["calibrate", "--max-minutes", "-1"],
    "unknown-command": ["frobnicate"],
    "models-bad-flag": ["models", "--bogus"],
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name, text in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLAKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # a machine with 8 GiB free, whatever runs the tests
    monkeypatch.setattr("mlakit.commands.args.available_memory", lambda: 8 << 30)
    return tmp_path


def listing(root) -> dict:
    return {
        os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
    }


@pytest.mark.parametrize("argv", list(CASES.values()), ids=list(CASES))
def test_one_line_exit_2_nothing_written(argv, workdir, capsys):
    before = listing(workdir)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    command = argv[0] if argv[0] != "frobnicate" else ""
    prefix = f"mlakit {command}: error: " if command else "mlakit: error: "
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err and out == ""
    assert listing(workdir) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["cache", "--context", "4K", "--json"],
        ["crossover", "--context", "4K", "--json"],
        ["cost", "--context", "4K", "--new", "1K", "--json"],
    ],
    ids=["cache", "crossover", "cost"],
)
def test_4k_means_4096_everywhere(argv, capsys):
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 4096


def test_version(capsys):
    from mlakit import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mlakit {__version__}"


def test_broken_pipe_is_quiet():
    script = "import sys; from mlakit.cli import main; sys.exit(main(['models']))"
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
    )
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line, as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err and "Error" not in err


TORCH_FREE = {
    "help": ["--help"],
    "version": ["--version"],
    "models": ["models"],
    "cache": ["cache"],
    "crossover": ["crossover"],
    "cost": ["cost", "--context", "4K", "--new", "16"],
}


@pytest.mark.parametrize("argv", list(TORCH_FREE.values()), ids=list(TORCH_FREE))
def test_torch_free_commands_never_import_torch(argv):
    script = (
        "import sys, contextlib, io\n"
        "from mlakit.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rc = main({argv!r})\n"
        "assert rc == 0, rc\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_bench_out_proc_refused_before_any_timing(workdir, capsys, monkeypatch):
    """Permission bits pass /proc for root; the probe write does not, and nothing is timed."""

    def never(*_):
        raise AssertionError("run_bench started before --out was checked")

    monkeypatch.setattr("mlakit.bench.run.run_bench", never)
    assert main(["bench", "--quick", "--out", "/proc/nope"]) == 2
    err = capsys.readouterr().err
    want = "mlakit bench: error: --out '/proc/nope': cannot create it (No such file or directory)"
    assert err.strip() == want


def test_out_dir_probe_leaves_nothing_behind(tmp_path):
    from mlakit.commands.args import check_out_dir, check_out_file

    check_out_dir(str(tmp_path / "new" / "deeper" / "out"))
    check_out_dir(str(tmp_path))
    check_out_file(str(tmp_path / "x.json"))
    assert list(tmp_path.iterdir()) == []


# ---- long runs: said before they start, refused past --max-minutes

TINY_DSA = {
    "model_type": "deepseek_v32",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_hidden_layers": 1,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 64,
}


def _machine_state(probe_ms: float):
    from mlakit.bench.machine_state import MachineState

    return MachineState(1, 0.0, 1, probe_ms, probe_ms, None, 1, "1 thread: test")


@pytest.fixture
def dsa_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_DSA))
    return str(tmp_path)


def test_check_dsa_1m_prefill_refused_before_the_layer_is_built(dsa_folder, capsys, monkeypatch):
    from mlakit.commands.check_time import run_macs
    from mlakit.config import MLAConfig

    monkeypatch.setattr("mlakit.bench.machine_state.measure_state", lambda threads: _machine_state(6.0))
    monkeypatch.setattr("mlakit.attention.MLAAttention", lambda *a, **k: pytest.fail("layer built"))
    assert main(["check", "--model", dsa_folder, "--prefill", "1M"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        "mlakit check: error: deepseek_v32 at batch 1, prefill 1,048,576"
    )
    assert (
        "over --max-minutes 5; lower --prefill (about " in err and "raise --max-minutes (0: no limit)" in err
    )
    fits = int(err.split("(about ")[1].split(" fits")[0].replace(",", ""))
    rate = 384**3 / 6e-3
    cfg = MLAConfig.from_hf(dsa_folder)
    assert run_macs(cfg, 1, fits, 8) / rate <= 300 < run_macs(cfg, 1, fits + 1, 8) / rate


def test_check_says_its_estimate_and_each_phase_when_long(dsa_folder, capsys, monkeypatch):
    import mlakit.commands.check as check

    monkeypatch.setattr("mlakit.bench.machine_state.measure_state", lambda threads: _machine_state(3e4))
    monkeypatch.setattr(check, "_probe_seconds", lambda layer, cfg, n, dtype: 20.0)
    assert main(["check", "--model", dsa_folder, "--prefill", "1100", "--decode-steps", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("mlakit check: deepseek_v32 at batch 1, prefill 1,100 + 1 decode step: about ")
    assert "at a 512-token prefill's" in err[0]
    assert [line.split(" done in")[0] for line in err[1:]] == [
        "mlakit check: absorb: prefill of 1,100 tokens",
        "mlakit check: absorb: 1 decode step",
        "mlakit check: materialize: prefill of 1,100 tokens",
        "mlakit check: materialize: 1 decode step",
    ]


def test_check_short_prefill_is_not_probed(dsa_folder, capsys, monkeypatch):
    import mlakit.commands.check as check

    monkeypatch.setattr("mlakit.bench.machine_state.measure_state", lambda threads: _machine_state(3e4))
    monkeypatch.setattr(check, "_probe_seconds", lambda *a: pytest.fail("a prefill this short is not probed"))
    assert main(["check", "--model", dsa_folder, "--prefill", "600", "--decode-steps", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "at the probe GEMM's" in err[0] and len(err) == 5


def test_check_short_run_is_quiet_and_bad_limit_refused(dsa_folder, capsys):
    assert main(["check", "--model", dsa_folder, "--prefill", "8", "--decode-steps", "1", "--json"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["check", "--model", dsa_folder, "--max-minutes", "nan"]) == 2
    assert "--max-minutes must be a finite number >= 0" in capsys.readouterr().err


def test_calibrate_past_the_limit_refused_before_the_gate(dsa_folder, capsys, monkeypatch):
    import mlakit.bench.calibrator as cal
    from mlakit.cost import MachineProfile

    slow = MachineProfile("slow", {"fp32": 2e10, "bf16": 2e10}, 2e10, "test")
    monkeypatch.setattr(cal, "_machine", lambda device: slow)
    monkeypatch.setattr(cal, "gate", lambda *a: pytest.fail("gate ran"))
    args = ["calibrate", "--model", "deepseek-v3", "--device", "cpu", "--dtype", "fp32"]
    assert main([*args, "--max-new", "65536", "--out", "/tmp/never.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "mlakit calibrate: error: calibrate of deepseek-v3, up to 27 cells, would take about"
    )
    assert "over --max-minutes 60; lower --max-new (" in err and "\n" not in err
    assert not os.path.exists("/tmp/never.json")


@pytest.mark.parametrize(
    "seconds,text",
    [
        (12.4, "12 s"),
        (439, "7 min 19 s"),
        (3 * 3600 + 125, "3 h 2 min"),
        (8.3 * 86400, "8.3 days"),
        (5512.4 * 86400, "5,512 days"),
    ],
    ids=["s", "min", "h", "days", "many-days"],
)
def test_format_duration(seconds, text):
    from mlakit.commands.time_limit import format_duration

    assert format_duration(seconds) == text


def test_check_time_limit_zero_is_no_limit():
    from mlakit.commands.time_limit import check_time_limit

    check_time_limit(1e12, 0, "x", "y", "--z")
    with pytest.raises(ValueError, match="over --max-minutes 1; lower --z"):
        check_time_limit(61, 1, "x", "y", "--z")


def test_check_of_a_dsa_model_at_1m_tokens_refuses_in_one_line(capsys):
    from mlakit.commands.check import WORKSPACE_TOKENS
    from mlakit.ops.materialize import DEFAULT_WORKSPACE_TOKENS

    assert WORKSPACE_TOKENS == DEFAULT_WORKSPACE_TOKENS
    assert main(["check", "--model", "deepseek-v3.2", "--prefill", "1M"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlakit check: error:") and "--prefill" in err and "\n" not in err

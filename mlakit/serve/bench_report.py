"""bench-serve's figures: vLLM's definitions, its printed table and its JSON keys."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Result:
    """One request as the client saw it (seconds)."""

    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: list[Result], duration: float, settings: dict) -> dict:
    done = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    out = dict(settings)
    out.update({
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    })  # fmt: skip
    for name, values in series.items():
        ms = [v * 1000 for v in values]
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        out[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
        out[f"p99_{name}_ms"] = percentile(ms, 99)
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_len for r in results]
    out["errors"] = [r.error for r in results]
    return out


_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def table(s: dict) -> str:
    """The summary as `vllm bench serve` prints it (plus the input token throughput)."""
    rows = ["{:=^50}".format(" Serving Benchmark Result ")]
    rows.append("{:<40} {:<10}".format("Successful requests:", s["completed"]))
    rows.append("{:<40} {:<10}".format("Failed requests:", s["failed"]))
    if s.get("max_concurrency") is not None:
        rows.append("{:<40} {:<10}".format("Maximum request concurrency:", s["max_concurrency"]))
    rows.append("{:<40} {:<10.2f}".format("Benchmark duration (s):", s["duration"]))
    rows.append("{:<40} {:<10}".format("Total input tokens:", s["total_input_tokens"]))
    rows.append("{:<40} {:<10}".format("Total generated tokens:", s["total_output_tokens"]))
    rows.append("{:<40} {:<10.2f}".format("Request throughput (req/s):", s["request_throughput"]))
    rows.append("{:<40} {:<10.2f}".format("Input token throughput (tok/s):", s["input_throughput"]))
    rows.append("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", s["output_throughput"]))
    rows.append("{:<40} {:<10.2f}".format("Total token throughput (tok/s):", s["total_token_throughput"]))
    for key, short, title in _SECTIONS:
        rows.append(f"{title:-^50}")
        rows.append("{:<40} {:<10.2f}".format(f"Mean {short} (ms):", s[f"mean_{key}_ms"]))
        rows.append("{:<40} {:<10.2f}".format(f"Median {short} (ms):", s[f"median_{key}_ms"]))
        rows.append("{:<40} {:<10.2f}".format(f"P99 {short} (ms):", s[f"p99_{key}_ms"]))
    rows.append("=" * 50)
    return "\n".join(rows)

"""Prometheus metrics with vLLM's names under the prefix `mlakit:`; one registry per server.

Written only by the engine loop thread (after each step); read by `GET /metrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_LATENCY_LONG = _LATENCY + (20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)

# key: (kind, name after "mlakit:", help, buckets)
_METRICS = {
    "running": (Gauge, "num_requests_running", "Requests in the running batch.", None),
    "waiting": (Gauge, "num_requests_waiting", "Requests waiting to be scheduled.", None),
    "kv_cache_usage": (Gauge, "kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", None),
    "prefix_queries": (Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", None),
    "prefix_hits": (Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", None),
    "prompt": (Counter, "prompt_tokens", "Prompt tokens processed.", None),
    "generation": (Counter, "generation_tokens", "Tokens generated.", None),
    "ttft": (Histogram, "time_to_first_token_seconds", "Time to first token.", _LATENCY_LONG),
    "itl": (Histogram, "inter_token_latency_seconds", "Time between two tokens of a request.", _LATENCY),
    "e2e": (Histogram, "e2e_request_latency_seconds", "Request latency, end to end.", _LATENCY_LONG),
}


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._series = {}
        for key, (kind, name, doc, buckets) in _METRICS.items():
            extra = {"buckets": buckets} if buckets else {}
            metric = kind(f"mlakit:{name}", doc, ["model_name"], registry=self.registry, **extra)
            self._series[key] = metric.labels(model_name)

    def set(self, key: str, value: float) -> None:
        self._series[key].set(value)

    def add(self, key: str, amount: float) -> None:
        if amount:
            self._series[key].inc(amount)

    def observe(self, key: str, seconds: float) -> None:
        self._series[key].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

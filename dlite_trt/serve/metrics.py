"""The OpenAI server's Prometheus metrics (``dlite_`` namespace), on a registry of its own.

The scheduler counts what happens per step and per request; the prefix cache's counters and the
KV bytes are read when /metrics is scraped, so they are never out of step with the cache.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, max_positions: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("dlite_requests", "Requests finished, by how they ended", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("dlite_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("dlite_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("dlite_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("dlite_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1)", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.queue_depth = Gauge("dlite_queue_depth", "Requests waiting to join the running batch", registry=r)
        self.running = Gauge("dlite_running_batch_size", "Sequences in the running engine batch", registry=r)
        self.joined_running = Counter("dlite_requests_joined_running_batch",
                                      "Requests that joined while other rows were mid-generation (in-flight)",
                                      registry=r)
        self.retries = Counter("dlite_engine_call_retries", "Batched engine calls that raised and were retried one "
                               "row at a time (only a row that fails alone gets the error)", registry=r)
        self.engine_calls = Counter("dlite_engine_calls", "Engine calls, by graph", ["graph"], registry=r)
        self.steps = Counter("dlite_speculative_steps", "Speculative steps (one per sequence per step call)",
                             registry=r)
        self.draft_skipped = Counter("dlite_draft_skipped", "Steps (per sequence) that ran no draft: "
                                     "--speculative dlite-ngram verifying n-gram proposals, or a batch size at which "
                                     "the engine's calibrated width is 0 (plain decoding pays more)", registry=r)
        self.proposed = Counter("dlite_draft_tokens_proposed", "Draft tokens verified", registry=r)
        self.accepted = Counter("dlite_draft_tokens_accepted", "Draft tokens the target accepted", registry=r)
        self.accepted_at = Counter("dlite_accepted_tokens_per_position",
                                   "Steps whose draft at this block position (1..K) was accepted", ["position"],
                                   registry=r)
        self.positions = [str(k) for k in range(1, max_positions + 1)]
        for position in self.positions:  # every position is exported from the start, at 0
            self.accepted_at.labels(position=position)

    def watch_kv(self, read: Callable[[], dict[str, float]]) -> None:
        """Export the prefix cache's counters and the KV bytes, read at each scrape."""
        self.registry.register(_KVCollector(read))

    def step(self, proposed: int, accepted: int) -> None:
        self.steps.inc()
        self.proposed.inc(proposed)
        self.accepted.inc(accepted)
        for position in self.positions[:accepted]:
            self.accepted_at.labels(position=position).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _KVCollector:
    COUNTERS = {"queries": "Prefix-cache lookups", "hits": "Lookups that reused entries",
                "reused_tokens": "Prompt tokens not prefilled: their KV entries were reused",
                "evictions": "Kept sequences evicted to stay within --kv-cache-gb"}
    GAUGES = {"kv_cache_bytes": "KV bytes held: kept sequences plus the running batch's cache",
              "kv_cache_budget_bytes": "The --kv-cache-gb budget",
              "kv_cache_peak_bytes": "The most KV bytes held at any time since the server started",
              "prefix_cache_sequences": "Finished sequences whose KV entries are kept"}

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read = read

    def describe(self) -> list:
        return []  # no samples at registration: read() needs a running scheduler

    def collect(self):
        values = self.read()
        for name, doc in self.COUNTERS.items():
            yield CounterMetricFamily(f"dlite_prefix_cache_{name}", doc, value=values[name])
        for name, doc in self.GAUGES.items():
            yield GaugeMetricFamily(f"dlite_{name}", doc, value=values[name])

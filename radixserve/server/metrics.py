"""Prometheus metrics, all named `radixserve:*`, in a registry owned by the API process.

Two sources:
- request-level series (TTFT, inter-token latency, end-to-end latency, queue time, generated
  tokens, finished requests by reason) are observed here as outputs arrive;
- engine-side series (KV pool, radix tree, prefix hit rate, evictions, retractions, the host
  tier's hit rate and copies) are read from
  the latest stats snapshot the engine process sends with its outputs (at least every 0.5 s while
  it works, and whenever a request finishes). Engine counters are cumulative in the engine, so
  they are exported as they are rather than re-counted here.

Health probes go through the engine (so its cache counters include their one-token prompts) but
are not counted as requests here.
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixserve.server.messages import EngineStats

PREFIX = "radixserve:"

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# (stats key, metric name, help); counters get `_total` appended by the exposition format.
ENGINE_COUNTERS = (
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests (health probes included)."),
    ("cached_prompt_tokens", "cached_prompt_tokens", "Of those, tokens found in the radix cache."),
    ("inserted_tokens", "radix_inserted_tokens", "Tokens inserted into the radix tree."),
    ("evicted_tokens", "evicted_tokens", "Tokens evicted from the radix tree."),
    ("retractions", "retractions", "Running requests moved back to the queue for lack of KV memory."),
    ("alloc_failures", "alloc_failures",
     "Steps the device could not allocate working memory for (taken back; later steps made smaller)."),
    ("continued_turns", "continued_turns",
     "Admitted requests whose prompt continues a finished request's prompt (later turns of a conversation)."),
    ("prefix_holds", "prefix_holds", "Finished requests' prefixes kept from eviction for --prefix-hold-s."),
    ("host_cached_prompt_tokens", "host_cached_prompt_tokens",
     "Of the cached prompt tokens, those copied back from the host tier (--hicache-size)."),
    ("loaded_tokens", "hicache_loaded_tokens", "Tokens copied from the host tier to the device."),
    ("loaded_bytes", "hicache_loaded_bytes", "Bytes copied from the host tier to the device."),
    ("written_back_bytes", "hicache_written_back_bytes", "Bytes copied from the device to the host tier."),
)
ENGINE_GAUGES = (
    ("running_requests", "num_running_reqs", "Requests decoding or prefilling in the engine."),
    ("queued_requests", "num_queue_reqs", "Requests waiting in the engine's queue."),
    ("token_usage", "token_usage", "Fraction of the KV pool neither free nor evictable."),
    ("pool_tokens", "kv_pool_tokens", "KV pool size in tokens."),
    ("free_tokens", "kv_free_tokens", "Free KV slots."),
    ("evictable_tokens", "kv_evictable_tokens", "KV tokens in the radix tree that no request holds."),
    ("protected_tokens", "kv_protected_tokens", "KV tokens in the radix tree locked by running requests."),
    ("held_by_running_tokens", "kv_held_tokens", "KV slots owned by running requests outside the tree."),
    ("fragmentation", "kv_fragmentation", "Slots reserved by running requests but unused, as a ratio."),
    ("tree_nodes", "radix_tree_nodes", "Nodes in the radix tree."),
    ("hit_rate", "prefix_hit_rate", "Cumulative prefix hit rate: cached prompt tokens / prompt tokens."),
    ("hit_rate_window", "prefix_hit_rate_window", "Prefix hit rate over the last 60 seconds."),
    ("device_hit_rate", "device_hit_rate", "Cumulative share of prompt tokens found on the device."),
    ("host_hit_rate", "host_hit_rate", "Cumulative share of prompt tokens copied back from the host tier."),
    ("load_bandwidth_gbps", "hicache_load_bandwidth_gbps", "Host-to-device load bandwidth so far, GB/s."),
    ("host_pool_tokens", "hicache_pool_tokens", "Host tier size in tokens (0: no host tier)."),
    ("host_free_tokens", "hicache_free_tokens", "Free host tier slots."),
    ("host_cached_tokens", "hicache_cached_tokens", "Tokens with a copy in the host tier."),
    ("loading_tokens", "hicache_loading_tokens", "Tokens being copied back from the host tier now."),
    ("new_token_ratio", "new_token_ratio", "Scheduler's estimate of future decode tokens per request."),
)


class _EngineCollector:
    def __init__(self, latest: Callable[[], Optional[EngineStats]], alive: Callable[[], bool]):
        self.latest = latest
        self.alive = alive

    def collect(self):
        alive = GaugeMetricFamily(PREFIX + "engine_alive", "1 while the engine process runs.")
        alive.add_metric([], 1.0 if self.alive() else 0.0)
        yield alive
        snap = self.latest()
        if snap is None:
            return
        values = snap.values
        for key, name, help_text in ENGINE_COUNTERS:
            if key in values:
                yield CounterMetricFamily(PREFIX + name, help_text, value=float(values[key]))
        for key, name, help_text in ENGINE_GAUGES:
            if key in values:
                yield GaugeMetricFamily(PREFIX + name, help_text, value=float(values[key]))


class ServerMetrics:
    def __init__(self, latest_stats: Callable[[], Optional[EngineStats]], engine_alive: Callable[[], bool]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from request arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "queue_time_seconds", "Time waiting in the engine's queue.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens sent to clients.", registry=r)
        self.request_prompt_tokens = Counter(PREFIX + "request_prompt_tokens",
                                             "Prompt tokens of finished requests (usage.prompt_tokens).", registry=r)
        self.request_cached_tokens = Counter(PREFIX + "request_cached_tokens",
                                             "Cached prompt tokens of finished requests "
                                             "(usage.prompt_tokens_details.cached_tokens).", registry=r)
        self.requests = Counter(PREFIX + "requests", "Finished requests by finish reason.", ["finish_reason"],
                                registry=r)
        self.rejected = Counter(PREFIX + "rejected_requests", "Requests answered with an error, by HTTP status "
                                "and reason (the error body's code).", ["status", "reason"], registry=r)
        self.running_http = Gauge(PREFIX + "http_requests_in_flight", "Generation requests the API is serving.",
                                  registry=r)
        r.register(_EngineCollector(latest_stats, engine_alive))

    def render(self) -> bytes:
        return generate_latest(self.registry)

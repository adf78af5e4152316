"""Prometheus metrics, named `radixserve:*`, in a registry owned by the API process; beside them
the gauges cluster gateways read from vLLM and SGLang workers, under those engines' names, labels
and meanings (`COMPAT_*` below), so a gateway written for them scores our workers unchanged.

Two sources:
- request-level series (TTFT, inter-token latency, end-to-end latency, queue time, generated
  tokens, finished requests by reason) are observed here as outputs arrive;
- engine-side series (KV pool, radix tree, prefix hit rate, evictions, retractions, the host
  tier's hit rate and copies, a hybrid model's recurrent-state snapshots) are read from
  the latest stats snapshot the engine process sends with its outputs (at least every 0.5 s while
  it works, and whenever a request finishes). Engine counters are cumulative in the engine, so
  they are exported as they are rather than re-counted here.

Health probes go through the engine (so its cache counters include their one-token prompts) but
are not counted as requests here.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixserve.engine.messages import EngineStats

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
    ("storage_pages_written", "storage_pages_written", "Pages the storage tier (--storage-dir) wrote to disk."),
    ("storage_bytes_written", "storage_bytes_written", "Bytes the storage tier wrote to disk."),
    ("storage_pages_read", "storage_pages_read", "Pages the storage tier read back (checked) from disk."),
    ("storage_bytes_read", "storage_bytes_read", "Bytes the storage tier read back from disk."),
    ("storage_loads", "storage_loads",
     "Requests whose next pages were on disk and read back: reading was expected to beat computing them."),
    ("storage_skipped_loads", "storage_skipped_loads",
     "Requests whose next pages were on disk but computed: reading them was expected to take longer."),
    ("storage_loaded_tokens", "storage_loaded_tokens", "Tokens read from the storage tier into the host tier."),
    ("storage_write_drops", "storage_write_drops",
     "Pages the storage tier did not keep: its write queue was full, the disk had no room, or a write failed."),
    ("storage_unpaying_pages", "storage_unpaying_pages",
     "Pages the host tier dropped that the storage tier did not write: they start where no load pays "
     "(reading them takes longer than computing them, however long the prompt after them)."),
    ("storage_snapshots_written", "storage_snapshots_written",
     "A hybrid model's recurrent-state snapshots the storage tier wrote to disk beside their pages."),
    ("storage_snapshots_loaded", "storage_snapshots_loaded",
     "Snapshots read back from disk and hung on the host tier's tree (a hybrid resumes from them)."),
    ("storage_evicted_pages", "storage_evicted_pages", "Pages dropped from disk for room (--storage-size)."),
    ("storage_missing_pages", "storage_missing_pages", "Page reads that found the page's file gone (computed instead)."),
    ("storage_corrupt_pages", "storage_corrupt_pages",
     "Page reads that failed their checks (checksum, tokens, chain): the page is dropped and computed."),
    ("storage_read_errors", "storage_read_errors", "Page reads that failed with an I/O error (computed instead)."),
    ("snapshot_hits", "state_snapshot_hits",
     "Hybrid models: admissions resumed from a recurrent-state snapshot of the prefix cache."),
    ("snapshots_taken", "state_snapshots_taken", "Hybrid models: recurrent states copied into the snapshot pool."),
    ("snapshot_evictions", "state_snapshot_evictions",
     "Hybrid models: snapshots freed for room or with their evicted prefix."),
    ("checkpoints_taken", "state_checkpoints_taken",
     "Hybrid models: of the snapshots taken, checkpoints kept on a request's way where a later one may branch."),
    ("checkpoint_hits", "state_checkpoint_hits", "Hybrid models: admissions resumed from a checkpoint."),
    ("host_snapshot_hits", "state_snapshot_host_hits",
     "Hybrid models: admissions resumed from a snapshot copied back from the host tier."),
    ("snapshots_written_back", "state_snapshots_written_back",
     "Hybrid models: snapshots copied to the host tier with their evicted prefix."),
    ("snapshots_loaded", "state_snapshots_loaded", "Hybrid models: snapshots copied back from the host tier."),
    ("host_snapshot_evictions", "state_snapshot_host_evictions",
     "Hybrid models: host-tier snapshots freed for room or with their prefix."),
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
    ("host_hit_rate", "host_hit_rate", "Cumulative share of prompt tokens served by the host tier (their KV copied back, or for a hybrid model the state they resume from)."),
    ("load_bandwidth_gbps", "hicache_load_bandwidth_gbps", "Host-to-device load bandwidth so far, GB/s."),
    ("storage_pages", "storage_pages", "Pages the storage tier holds (on disk or queued for it)."),
    ("storage_used_bytes", "storage_used_bytes", "Bytes the storage tier's pages take on disk."),
    ("storage_capacity_bytes", "storage_capacity_bytes", "The storage tier's size (--storage-size)."),
    ("storage_restored_pages", "storage_restored_pages", "Pages found on disk at start-up (a warm restart)."),
    ("storage_pending_write_bytes", "storage_pending_write_bytes", "Bytes queued for the storage tier's writes."),
    ("storage_read_bandwidth_gbps", "storage_read_bandwidth_gbps",
     "The read bandwidth storage-tier load decisions use (--storage-read-gbps, else measured at start-up), GB/s."),
    ("storage_prefill_tflops", "storage_prefill_tflops",
     "The prefill rate storage-tier load decisions compare against (--storage-prefill-tflops, else measured), TFLOP/s."),
    ("host_pool_tokens", "hicache_pool_tokens", "Host tier size in tokens (0: no host tier)."),
    ("host_free_tokens", "hicache_free_tokens", "Free host tier slots."),
    ("host_cached_tokens", "hicache_cached_tokens", "Tokens with a copy in the host tier."),
    ("loading_tokens", "hicache_loading_tokens", "Tokens being copied back from the host tier now."),
    ("snapshot_slots", "state_snapshot_slots",
     "Hybrid models: recurrent-state snapshot slots of the prefix cache (--mamba-cache-size; 0: none)."),
    ("snapshots_held", "state_snapshots", "Hybrid models: snapshots the prefix cache holds."),
    ("snapshot_bytes", "state_snapshot_bytes", "Hybrid models: device bytes of the snapshots the prefix cache holds."),
    ("host_snapshot_slots", "state_snapshot_host_slots",
     "Hybrid models: recurrent-state snapshot slots of the host tier (--mamba-host-cache-size; 0: none)."),
    ("host_snapshots_held", "state_snapshots_host", "Hybrid models: snapshots the host tier holds."),
    ("host_snapshot_bytes", "state_snapshot_host_bytes", "Hybrid models: host bytes of the snapshots the host tier holds."),
    ("new_token_ratio", "new_token_ratio", "Scheduler's estimate of future decode tokens per request."),
)


# vLLM's names (its labels: model_name, and engine, the engine core's index: one here). vLLM's
# KV usage counts the blocks requests hold (cached blocks no request holds are free to it), as
# our token_usage does; its prefix-cache counters count prompt tokens queried and found.
VLLM_GAUGES = (
    ("running_requests", "vllm:num_requests_running", "Number of requests in model execution batches."),
    ("queued_requests", "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("token_usage", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
)
VLLM_COUNTERS = (
    ("prompt_tokens", "vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("cached_prompt_tokens", "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
)
# SGLang's names (label: model_name).
SGLANG_GAUGES = (
    ("running_requests", "sglang:num_running_reqs", "The number of running requests."),
    ("queued_requests", "sglang:num_queue_reqs", "The number of requests in the waiting queue."),
    ("token_usage", "sglang:token_usage", "The token usage."),
)


class _EngineCollector:
    def __init__(self, latest: Callable[[], Optional[EngineStats]], alive: Callable[[], bool],
                 model_name: str = "", page_size: int = 1,
                 prefix_caching: Union[bool, Callable[[], bool]] = True):
        self.latest = latest
        self.alive = alive
        self.model_name = model_name
        self.page_size = page_size
        self.prefix_caching = prefix_caching

    def _prefix_caching(self) -> bool:
        # A callable: the engine says once it is ready (a hybrid model serves without prefix caching).
        return self.prefix_caching() if callable(self.prefix_caching) else self.prefix_caching

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
        yield from self._compat(values)

    def _compat(self, values: dict):
        vllm_labels = ("model_name", "engine")
        vllm_values = (self.model_name, "0")
        for key, name, help_text in VLLM_GAUGES:
            if key in values:
                family = GaugeMetricFamily(name, help_text, labels=vllm_labels)
                family.add_metric(vllm_values, float(values[key]))
                yield family
        for key, name, help_text in VLLM_COUNTERS:
            if key in values:
                family = CounterMetricFamily(name, help_text, labels=vllm_labels)
                family.add_metric(vllm_values, float(values[key]))
                yield family
        if "pool_tokens" in values:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=("block_size", "num_gpu_blocks", "enable_prefix_caching", *vllm_labels))
            info.add_metric((str(self.page_size), str(int(values["pool_tokens"]) // self.page_size),
                             str(self._prefix_caching()), *vllm_values), 1.0)
            yield info
        for key, name, help_text in SGLANG_GAUGES:
            if key in values:
                family = GaugeMetricFamily(name, help_text, labels=("model_name",))
                family.add_metric((self.model_name,), float(values[key]))
                yield family


class ServerMetrics:
    def __init__(self, latest_stats: Callable[[], Optional[EngineStats]], engine_alive: Callable[[], bool],
                 model_name: str = "", page_size: int = 1,
                 prefix_caching: Union[bool, Callable[[], bool]] = True):
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
        r.register(_EngineCollector(latest_stats, engine_alive, model_name, page_size, prefix_caching))

    def render(self) -> bytes:
        return generate_latest(self.registry)

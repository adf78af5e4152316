"""The router's Prometheus metrics, all named `radixserve:router_*`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from radixserve.router.workers import Worker, WorkerRegistry

PREFIX = "radixserve:router_"


class _WorkerCollector:
    def __init__(self, registry: WorkerRegistry):
        self.registry = registry

    def collect(self):
        load = GaugeMetricFamily(PREFIX + "worker_load", "Requests in flight per worker.", labels=["worker", "url"])
        healthy = GaugeMetricFamily(PREFIX + "worker_healthy", "1 while the worker is in rotation.",
                                    labels=["worker", "url"])
        tree = GaugeMetricFamily(PREFIX + "approx_tree_size", "Symbols in the worker's approximate prefix tree "
                                 "(cache_aware).", labels=["worker"])
        kv_tree = GaugeMetricFamily(PREFIX + "kv_tree_tokens", "Tokens the worker's radix cache holds, as mirrored "
                                    "from its KV events (kv_aware).", labels=["worker"])
        kv_synced = GaugeMetricFamily(PREFIX + "kv_synced", "1 while the worker's KV event stream is in sync.",
                                      labels=["worker"])
        for w in self.registry:
            load.add_metric([w.id, w.url], float(w.load))
            healthy.add_metric([w.id, w.url], 1.0 if w.healthy else 0.0)
            tree.add_metric([w.id], float(len(w.tree)))
            kv_tree.add_metric([w.id], float(len(w.mirror)))
            kv_synced.add_metric([w.id], 1.0 if w.kv_synced else 0.0)
        yield from (load, healthy, tree, kv_tree, kv_synced)


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests sent to each worker (retries included).",
                                ["worker"], registry=r)
        self.decisions = Counter(PREFIX + "routing_decisions", "Routing decisions: matched (prefix found), "
                                 "balanced (load imbalance), fallback (least loaded), direct (no prefix policy).",
                                 ["policy", "decision"], registry=r)
        self.health_transitions = Counter(PREFIX + "health_transitions", "Workers entering or leaving rotation.",
                                          ["worker", "to"], registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests retried on another worker before any byte was sent.",
                               registry=r)
        self.errors = Counter(PREFIX + "errors", "Requests the router could not complete: no_worker (503), queue_full (503, every worker tried was full), "
                              "stream_broken (a worker failed mid-stream).", ["kind"], registry=r)
        self.kv_events = Counter(PREFIX + "kv_events", "KV cache events received from workers.", ["worker"],
                                 registry=r)
        self.kv_resyncs = Counter(PREFIX + "kv_resyncs", "KV event stream (re)connections with a snapshot.",
                                  ["worker"], registry=r)
        r.register(_WorkerCollector(workers))

    def forget(self, worker: Worker) -> None:
        for counter in (self.requests, self.kv_events, self.kv_resyncs):
            try:
                counter.remove(worker.id)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)

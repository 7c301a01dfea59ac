"""Prometheus metrics, vLLM's names under a `nanojax:` prefix."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, async_engine, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        eng = async_engine.engine

        def gauge(name, doc, fn):
            g = Gauge(name, doc, list(labels), registry=r)
            g.labels(**labels).set_function(fn)

        gauge("nanojax:num_requests_running", "Requests in the running batch.",
              lambda: eng.num_running)
        gauge("nanojax:num_requests_waiting", "Requests waiting to be scheduled.",
              lambda: max(0, async_engine.num_pending - eng.num_running))
        gauge("nanojax:kv_cache_usage_perc", "Fraction of KV-cache pages in use (0-1).",
              lambda: eng.kv_usage)
        self.prompt_tokens = Counter("nanojax:prompt_tokens", "Prompt tokens of accepted "
                                     "requests.", list(labels), registry=r).labels(**labels)
        self.generation_tokens = Counter("nanojax:generation_tokens", "Generated tokens "
                                         "delivered.", list(labels), registry=r).labels(**labels)
        self.request_success = Counter("nanojax:request_success", "Finished requests by "
                                       "reason.", list(labels) + ["finished_reason"], registry=r)
        self.ttft = Histogram("nanojax:time_to_first_token_seconds", "Time to first token.",
                              list(labels), buckets=_LATENCY_BUCKETS,
                              registry=r).labels(**labels)
        self.itl = Histogram("nanojax:inter_token_latency_seconds", "Inter-token latency.",
                             list(labels), buckets=_LATENCY_BUCKETS,
                             registry=r).labels(**labels)
        self.e2e = Histogram("nanojax:e2e_request_latency_seconds", "End-to-end latency.",
                             list(labels), buckets=_LATENCY_BUCKETS,
                             registry=r).labels(**labels)
        self.errors = Counter("nanojax:request_errors", "Requests refused, by HTTP status.",
                              list(labels) + ["status"], registry=r)
        self.labels = labels
        r.register(_KVReuseCollector(eng, labels))

    def finished(self, reason: str) -> None:
        self.request_success.labels(finished_reason=reason, **self.labels).inc()

    def refused(self, status: int) -> None:
        self.errors.labels(status=str(status), **self.labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _KVReuseCollector:
    """The engine's prefix-cache and offload counters, read at scrape time (vLLM's
    prefix_cache_queries / prefix_cache_hits, in tokens)."""

    def __init__(self, engine, labels: dict):
        self.engine, self.labels = engine, labels

    def collect(self):
        from prometheus_client.core import CounterMetricFamily
        pc, off = self.engine.prefix_cache, self.engine.offloader
        rows = []
        if pc is not None:
            rows += [("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      pc.stats.queries),
                     ("prefix_cache_hits", "Of those, tokens whose KV was on the GPU.",
                      pc.stats.hits),
                     ("kv_offload_hits", "Prompt tokens whose KV was loaded back from host "
                      "memory or disk.", pc.stats.tier_hits)]
        if off is not None:
            st = off.stats
            rows += [("kv_offload_saved_pages", "KV pages copied out to the offload tiers.",
                      st.saved_pages),
                     ("kv_offload_dropped_pages", "KV pages not offloaded because the copies "
                      "out or the disk were behind (they cost a recompute if asked for).",
                      st.saves_dropped + st.disk_writes_dropped)]
        for name, doc, value in rows:
            c = CounterMetricFamily(f"nanojax:{name}", doc, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), value)
            yield c

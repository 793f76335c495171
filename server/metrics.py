"""Prometheus metrics named like vLLM's (`vllm:` -> `jaxpaged:`), in a per-app CollectorRegistry.

Engine state (running / waiting requests, KV usage, prefix cache, preemptions)
is read from the AsyncLLM's stats snapshot at scrape time; per-request counters
and latency histograms are recorded by the handlers through `RequestTracker`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0)


class EngineStatsCollector:
    """Gauges and engine-side counters from `AsyncLLM.stats()`, read at every scrape."""

    def __init__(self, engine: AsyncLLM, labels: dict[str, str]):
        self.engine, self.labels = engine, labels

    def collect(self):
        stats = self.engine.stats()
        gauges = (("num_requests_running", "Requests in the running batch.", stats["num_requests_running"]),
                  ("num_requests_waiting", "Requests waiting to be scheduled.", stats["num_requests_waiting"]),
                  ("kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full).", stats["kv_cache_usage"]))
        for name, doc, value in gauges:
            yield self._family(GaugeMetricFamily, name, doc, value)
        counters = (("prefix_cache_queries", "Prefix cache lookups (pages).", stats["prefix_cache_queries"]),
                    ("prefix_cache_hits", "Prefix cache hits (pages).", stats["prefix_cache_hits"]),
                    ("num_preemptions", "Requests preempted for lack of KV pages.", stats["num_preemptions"]))
        for name, doc, value in counters:
            yield self._family(CounterMetricFamily, name, doc, value)
        if "spec_decode_num_drafts" in stats:  # speculative decoding is on
            yield from self._spec_decode_families(stats)

    def _spec_decode_families(self, stats):
        """vLLM's spec-decode counters (acceptance rate = accepted / draft tokens)."""
        for name, doc in (("spec_decode_num_drafts", "Draft verifications (one per request per step with drafts)."),
                          ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
                          ("spec_decode_num_accepted_tokens", "Draft tokens accepted.")):
            yield self._family(CounterMetricFamily, name, doc, stats[name])
        family = CounterMetricFamily("jaxpaged:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft (0 first).",
                                     labels=[*self.labels, "position"])
        for position, value in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            family.add_metric([*self.labels.values(), str(position)], float(value))
        yield family

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(f"jaxpaged:{name}", doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), float(value))
        return family


class ServerMetrics:
    """All collectors of one app; `render()` is the /metrics body.

    `replica`: set on a data-parallel replica (its rank): every jaxpaged: sample then carries replica=<rank>,
    so a fleet's series stay apart wherever they are scraped from."""

    def __init__(self, engine: AsyncLLM, model_name: str, replica: str | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.label_values = (model_name,) if replica is None else (model_name, replica)
        labels = ["model_name"] if replica is None else ["model_name", "replica"]
        self.registry.register(EngineStatsCollector(engine, dict(zip(labels, self.label_values))))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. (Linux /proc)

        def counter(name, doc, extra=()):
            return Counter(f"jaxpaged:{name}", doc, labels + list(extra), registry=self.registry)

        def histogram(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(f"jaxpaged:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests finished, by finish reason.",
                                       ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (s).")
        self.itl = histogram("inter_token_latency_seconds", "Time between output steps (s).", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish (s).")
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled (s).")

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Records one engine request's metrics from the outputs it sees (call `close()` at the end)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.last: RequestOutput | None = None
        self.num_itl_seen = 0  # of the engine's RequestMetrics.inter_token_latencies
        self.closed = False

    def on_output(self, output: RequestOutput) -> None:
        """Observe the inter-token latencies the engine recorded since the last output (any output kind)."""
        self.last = output
        itl = output.metrics.inter_token_latencies
        end = len(itl)
        for seconds in itl[self.num_itl_seen:end]:
            self.metrics.itl.labels(*self.metrics.label_values).observe(seconds)
        self.num_itl_seen = end
        if output.finished:
            self.close()

    def close(self) -> None:
        """Count tokens (also of aborted requests) and, if it finished, its latencies and finish reason."""
        if self.closed or self.last is None:
            return
        self.closed = True
        m, out, labels = self.metrics, self.last, self.metrics.label_values
        m.prompt_tokens.labels(*labels).inc(len(out.prompt_token_ids))
        m.generation_tokens.labels(*labels).inc(out.metrics.num_generation_tokens)
        if not out.finished:
            return
        reason = out.outputs[0].finish_reason or "unknown"
        m.request_success.labels(*labels, reason).inc()
        rm = out.metrics
        for hist, start, end in ((m.ttft, rm.arrival_time, rm.first_token_time),
                                 (m.e2e, rm.arrival_time, rm.finished_time),
                                 (m.queue_time, rm.arrival_time, rm.first_scheduled_time)):
            if start and end:
                hist.labels(*labels).observe(max(0.0, end - start))

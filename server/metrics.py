"""Prometheus metrics under vLLM's names and labels (`vllm:...{model_name, engine}`), so vLLM's dashboards and
alerts work unchanged, in a per-app CollectorRegistry.

Engine state (running / waiting requests, KV usage, prefix cache, preemptions, speculative decoding) is read
from the AsyncLLM's stats snapshot at scrape time; per-request counters and histograms are recorded by the
handlers through `RequestTracker`. Every series here has a vLLM equivalent, so none is named `jaxpaged:`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams

LABELS = ("model_name", "engine")  # vLLM's; one engine per server here, so engine is always "0"
ENGINE_INDEX = "0"
# vLLM's time-to-first-token buckets, used for every request-phase time here (a CPU step can take seconds)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# Finer at the low end than vLLM's (which start at 10 ms): a small model's decode step takes a few ms
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's buckets for per-request token counts)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class EngineStatsCollector:
    """Gauges and engine-side counters from `AsyncLLM.stats()`, read at every scrape."""

    def __init__(self, engine: AsyncLLM, label_names: tuple[str, ...], label_values: tuple[str, ...]):
        self.engine, self.label_names, self.label_values = engine, label_names, list(label_values)

    def collect(self):
        stats = self.engine.stats()
        gauges = (("num_requests_running", "Number of requests in the running batch.", stats["num_requests_running"]),
                  ("num_requests_waiting", "Number of requests waiting to be scheduled.",
                   stats["num_requests_waiting"]),
                  ("kv_cache_usage_perc", "KV-cache usage: fraction of pages in use (1 = full).",
                   stats["kv_cache_usage"]))
        for name, doc, value in gauges:
            yield self._family(GaugeMetricFamily, name, doc, value)
        counters = (("prefix_cache_queries", "Prefix cache queries, in tokens looked up.",
                     stats["prefix_cache_queries"]),
                    ("prefix_cache_hits", "Prefix cache hits, in tokens found cached.", stats["prefix_cache_hits"]),
                    ("num_preemptions", "Requests preempted for lack of KV pages.", stats["num_preemptions"]))
        for name, doc, value in counters:
            yield self._family(CounterMetricFamily, name, doc, value)
        if "spec_decode_num_drafts" in stats:  # speculative decoding is on
            yield from self._spec_decode_families(stats)

    def _spec_decode_families(self, stats):
        """The spec-decode counters (acceptance rate = accepted / draft tokens)."""
        for name, doc in (("spec_decode_num_drafts", "Draft verifications (one per request per step with drafts)."),
                          ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
                          ("spec_decode_num_accepted_tokens", "Draft tokens accepted.")):
            yield self._family(CounterMetricFamily, name, doc, stats[name])
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft (0 first).",
                                     labels=[*self.label_names, "position"])
        for position, value in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            family.add_metric([*self.label_values, str(position)], float(value))
        yield family

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(f"vllm:{name}", doc, labels=list(self.label_names))
        family.add_metric(self.label_values, float(value))
        return family


class _WithoutCreated:
    """A registry's samples less the `<counter|histogram>_created` series (a start timestamp per label set
    that no dashboard reads). prometheus_client's own switch, `disable_created_metrics()`, is process-wide:
    it would change the output of every registry in the process, an embedding application's too."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            if family.type in ("counter", "histogram", "summary", "gaugehistogram"):
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class ServerMetrics:
    """All collectors of one app; `render()` is the /metrics body.

    `replica`: set on a data-parallel replica (its rank): every sample then carries replica=<rank> too, so a
    fleet's series stay apart wherever they are scraped from."""

    def __init__(self, engine: AsyncLLM, model_name: str, max_model_len: int, replica: str | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        names = LABELS if replica is None else (*LABELS, "replica")
        self.label_values = (model_name, ENGINE_INDEX) if replica is None else (model_name, ENGINE_INDEX, replica)
        self.registry.register(EngineStatsCollector(engine, names, self.label_values))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. (Linux /proc)
        self.exposed = _WithoutCreated(self.registry)

        def counter(name, doc, extra=()):
            return Counter(f"vllm:{name}", doc, [*names, *extra], registry=self.registry)

        def histogram(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(f"vllm:{name}", doc, names, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("request_success", "Requests finished, by finish reason.",
                                       ["finished_reason"])
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a finished request.", tokens)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of a finished request.", tokens)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (s).")
        self.itl = histogram("inter_token_latency_seconds", "Time between output steps (s).", _ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "A finished request's mean time per output token after the first (s).", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish (s).")
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled (s).")
        self.inference_time = histogram("request_inference_time_seconds", "Time from first scheduled to finish (s).")
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduled to first token (s).")
        self.decode_time = histogram("request_decode_time_seconds", "Time from first token to finish (s).")
        self.params_n = histogram("request_params_n", "The n request parameter of a finished request.",
                                  (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter of a "
                                           "finished request that gave one.", tokens)

    def render(self) -> bytes:
        return generate_latest(self.exposed)

    def tracker(self, params: SamplingParams) -> RequestTracker:
        return RequestTracker(self, params)


class RequestTracker:
    """Records one engine request's metrics from the outputs it sees (call `close()` at the end)."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams):
        self.metrics, self.params = metrics, params
        self.last: RequestOutput | None = None
        self.num_itl_seen = 0  # of the engine's RequestMetrics.inter_token_latencies
        self.closed = False

    def on_output(self, output: RequestOutput) -> None:
        """Observe the inter-token latencies the engine recorded since the last output (any output kind)."""
        self.last = output
        itl = output.metrics.inter_token_latencies
        end = len(itl)
        observe = self.metrics.itl.labels(*self.metrics.label_values).observe
        for seconds in itl[self.num_itl_seen:end]:
            observe(seconds)
        self.num_itl_seen = end
        if output.finished:
            self.close()

    def close(self) -> None:
        """Count tokens (also of aborted requests) and, if it finished, its sizes, times and finish reason."""
        if self.closed or self.last is None:
            return
        self.closed = True
        m, out, labels = self.metrics, self.last, self.metrics.label_values
        num_prompt, num_generated = len(out.prompt_token_ids), out.metrics.num_generation_tokens
        m.prompt_tokens.labels(*labels).inc(num_prompt)
        m.generation_tokens.labels(*labels).inc(num_generated)
        if not out.finished:
            return
        m.request_success.labels(*labels, out.outputs[0].finish_reason or "unknown").inc()
        m.request_prompt_tokens.labels(*labels).observe(num_prompt)
        m.request_generation_tokens.labels(*labels).observe(num_generated)
        m.params_n.labels(*labels).observe(self.params.n)
        if self.params.max_tokens is not None:
            m.params_max_tokens.labels(*labels).observe(self.params.max_tokens)
        rm = out.metrics
        for hist, start, end in ((m.ttft, rm.arrival_time, rm.first_token_time),
                                 (m.e2e, rm.arrival_time, rm.finished_time),
                                 (m.queue_time, rm.arrival_time, rm.first_scheduled_time),
                                 (m.inference_time, rm.first_scheduled_time, rm.finished_time),
                                 (m.prefill_time, rm.first_scheduled_time, rm.first_token_time),
                                 (m.decode_time, rm.first_token_time, rm.finished_time)):
            if start and end:
                hist.labels(*labels).observe(max(0.0, end - start))
        if num_generated > 1 and rm.first_token_time and rm.last_token_time:
            m.tpot.labels(*labels).observe(max(0.0, rm.last_token_time - rm.first_token_time) / (num_generated - 1))

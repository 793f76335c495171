"""/metrics under vLLM's names and labels after real requests: the values move as the requests say, and no
`_created` series is served (without touching prometheus_client's process-wide switch)."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import token_buckets
from tests.server.conftest import MODEL_NAME

NO_EOS = {"temperature": 0, "ignore_eos": True}
HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "request_params_n", "request_params_max_tokens")
COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "request_success_total", "prefix_cache_queries_total",
            "prefix_cache_hits_total", "num_preemptions_total")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def samples(live) -> list:
    text = httpx.get(live.url + "/metrics", timeout=10).text
    assert "jaxpaged:" not in text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(found: list, name: str, **labels) -> float:
    return sum(s.value for s in found if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_carry_vllms_names_and_move_with_a_request(live):
    live.wait_idle()
    before = samples(live)
    prompt = [5, 6, 7, 8, 9]
    r = httpx.post(live.v1 + "/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, **NO_EOS},
                   timeout=60)
    assert r.status_code == 200, r.text
    live.wait_idle()
    after = samples(live)
    names = {s.name for s in after}
    expected = {f"vllm:{n}" for n in COUNTERS + GAUGES} | {f"vllm:{h}_{part}" for h in HISTOGRAMS
                                                           for part in ("bucket", "sum", "count")}
    assert expected <= names, sorted(expected - names)
    assert not [n for n in names if n.endswith("_created")]
    for s in after:
        if s.name.startswith("vllm:"):
            assert s.labels["model_name"] == MODEL_NAME and s.labels["engine"] == "0", s

    def delta(name, **labels):
        return total(after, f"vllm:{name}", **labels) - total(before, f"vllm:{name}", **labels)

    assert delta("request_success_total", finished_reason="length") == 1
    assert delta("prompt_tokens_total") == len(prompt) and delta("request_prompt_tokens_sum") == len(prompt)
    assert delta("generation_tokens_total") == 6 and delta("request_generation_tokens_sum") == 6
    assert delta("inter_token_latency_seconds_count") == 5  # between the 6 tokens
    assert delta("request_params_n_sum") == 1 and delta("request_params_max_tokens_sum") == 6
    for name in HISTOGRAMS:
        if name != "inter_token_latency_seconds":
            assert delta(f"{name}_count") == 1, name
    ttft, e2e = delta("time_to_first_token_seconds_sum"), delta("e2e_request_latency_seconds_sum")
    queue, prefill = delta("request_queue_time_seconds_sum"), delta("request_prefill_time_seconds_sum")
    decode, inference = delta("request_decode_time_seconds_sum"), delta("request_inference_time_seconds_sum")
    assert 0 < ttft <= e2e < 60 and abs(queue + prefill - ttft) < 1e-6 and abs(prefill + decode - inference) < 1e-6
    assert 0 < delta("request_time_per_output_token_seconds_sum") <= decode
    assert delta("prefix_cache_queries_total") >= len(prompt)
    assert 0 <= total(after, "vllm:kv_cache_usage_perc") <= 1 and total(after, "vllm:num_requests_running") == 0


def test_created_series_are_left_out_of_this_app_only():
    """The app drops `_created` itself: another registry in the process still has its own (the library's
    switch for it, disable_created_metrics(), would have changed every registry)."""
    registry = CollectorRegistry()
    Counter("other_app_requests", "An embedding application's counter.", registry=registry).inc()
    assert b"other_app_requests_created" in generate_latest(registry)


def test_token_buckets_are_one_two_five_up_to_the_context():
    assert token_buckets(128) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)

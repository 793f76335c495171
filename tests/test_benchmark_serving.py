"""benchmarks/serve.py bench (the serving client) against a real jaxpaged server (uvicorn in a thread, tiny checkpoint)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from pathlib import Path

import pytest

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from server.app import build_app
from server.config import ServerConfig
from tests.conftest import load_script
from tests.server.conftest import ENGINE_ARGS, MODEL_NAME, serve

NUM_PROMPTS = 16
# The tiny tokenizer is bytes without merges: allowing only printable ASCII output makes the
# streamed text re-tokenise to exactly the generated ids (no partial UTF-8, no special tokens).
ASCII_ONLY = {str(i): -100 for i in [*range(32), *range(127, 260)]}
SUMMARY_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "peak_output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "total_output_tokens_server",
                "output_token_mismatches")


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/serving_client.py")


serve_cli = load_script("benchmarks/serve.py")


@pytest.fixture(scope="module")
def server_url(tiny_checkpoints):
    engine = LLMEngine(EngineArgs(model=str(tiny_checkpoints["gqa4"]), **ENGINE_ARGS))
    llm = AsyncLLM(engine)
    try:
        with serve(build_app(llm, ServerConfig(served_model_names=(MODEL_NAME,)))) as url:
            yield url
    finally:
        llm.shutdown()


def _argv(url: str, checkpoint: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["--base-url", url, "--model", MODEL_NAME, "--tokenizer", str(checkpoint),
            "--dataset", "random", "--random-source", "words", "--input-len", "6", "--output-len", "8",
            "--range-ratio", "0.5", "--num-prompts", str(NUM_PROMPTS), "--ignore-eos",
            "--extra-body", json.dumps({"logit_bias": ASCII_ONLY}), "--disable-tqdm",
            "--save-json", str(tmp_path / "out.json"), *extra]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_benchmark_against_live_server(bench, server_url, tiny_checkpoints, tmp_path, capsys, endpoint):
    out = serve_cli.bench_main(_argv(server_url, tiny_checkpoints["gqa4"], tmp_path, "--endpoint", endpoint,
                           "--max-concurrency", "4"))
    printed = capsys.readouterr().out
    for label in ("Successful requests:", "Failed requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Peak output token throughput (tok/s):", "Total Token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):",
                  "Median TPOT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):"):
        assert label in printed, label

    (run,) = out["runs"]
    saved = json.loads((tmp_path / "out.json").read_text())
    for key in SUMMARY_KEYS:
        assert key in run and key in saved and key in saved["runs"][0], key
    assert saved["args"]["num_prompts"] == NUM_PROMPTS
    assert run["completed"] == NUM_PROMPTS and run["failed"] == 0, run["errors"]
    assert run["max_concurrency"] == 4

    requests = saved["requests"] if "requests" in saved else saved["runs"][0]["requests"]
    assert len(requests) == NUM_PROMPTS
    # ignore_eos: every request ran to its max_tokens; the tokenizer count agrees with the server's usage
    assert run["server_usage_requests"] == NUM_PROMPTS
    assert run["total_output_tokens"] == run["total_output_tokens_server"] == run["total_output_tokens_text"]
    assert run["output_token_mismatches"] == 0
    assert all(r["output_tokens"] == r["usage_completion_tokens"] == r["text_tokens"] == r["output_len_requested"]
               for r in requests)
    assert all(0 < r["ttft"] < r["latency"] for r in requests)
    assert math.isclose(run["output_throughput"], run["total_output_tokens"] / run["duration"], rel_tol=1e-9)
    assert run["peak_output_throughput"] > 0
    assert run["mean_ttft_ms"] <= run["mean_e2el_ms"]


def test_output_tokens_are_the_servers_usage_else_the_tokenizer_count(bench, tiny_checkpoints):
    tokenizer = bench.get_tokenizer(str(tiny_checkpoints["gqa4"]))
    text = "hello world"
    text_tokens = bench.count_tokens(tokenizer, text)
    # a server that skipped special tokens in the text: its usage counts what it generated
    with_usage = bench.RequestResult(1, 20, success=True, generated_text=text, usage_completion_tokens=text_tokens + 3)
    without_usage = bench.RequestResult(1, 20, success=True, generated_text=text)
    failed = bench.RequestResult(1, 20, success=False, generated_text=text, usage_completion_tokens=5)
    for res in (with_usage, without_usage, failed):
        bench.count_output(res, tokenizer)
    assert (with_usage.output_tokens, with_usage.text_tokens) == (text_tokens + 3, text_tokens)
    assert (without_usage.output_tokens, without_usage.text_tokens) == (text_tokens, text_tokens)
    assert (failed.output_tokens, failed.text_tokens) == (0, 0)
    metrics = bench.compute_metrics([with_usage, without_usage, failed], duration=2.0)
    assert metrics["total_output_tokens"] == 2 * text_tokens + 3
    assert metrics["total_output_tokens_text"] == 2 * text_tokens
    assert metrics["output_token_mismatches"] == 1
    assert metrics["output_throughput"] == (2 * text_tokens + 3) / 2.0


def test_sweep_and_prefix_workload(bench, server_url, tiny_checkpoints, tmp_path):
    out = serve_cli.bench_main(_argv(server_url, tiny_checkpoints["gqa4"], tmp_path, "--dataset", "prefix",
                           "--num-prefixes", "2", "--prefix-len", "5", "--max-concurrency", "1,8",
                           "--request-rate", "200"))
    assert [r["max_concurrency"] for r in out["runs"]] == [1, 8]
    assert all(r["completed"] == NUM_PROMPTS for r in out["runs"])
    saved = json.loads((tmp_path / "out.json").read_text())
    assert len(saved["runs"]) == 2 and "completed" not in saved  # sweep: metrics per run only


def test_unreachable_server_counts_failures(bench, tiny_checkpoints, tmp_path):
    from tests.server.conftest import free_port
    url = f"http://127.0.0.1:{free_port()}"
    out = serve_cli.bench_main(_argv(url, tiny_checkpoints["gqa4"], tmp_path, "--num-warmups", "0", "--num-prompts", "3"))
    (run,) = out["runs"]
    assert run["completed"] == 0 and run["failed"] == 3 and run["errors"]


def test_workloads_offline(bench, tiny_checkpoints, tmp_path):
    tok = bench.get_tokenizer(str(tiny_checkpoints["gqa4"]))
    reqs = bench.sample_random(tok, 8, 20, 10, 0.5, seed=1)
    assert len(reqs) == 8 and all(10 <= r.prompt_len <= 30 and 5 <= r.output_len <= 15 for r in reqs)
    assert [r.prompt for r in reqs] == [r.prompt for r in bench.sample_random(tok, 8, 20, 10, 0.5, seed=1)]
    prefixed = bench.sample_prefix(tok, 6, 2, 30, 5, 4, 0.0, seed=0, source="words")
    assert prefixed[0].prompt[:30] == prefixed[2].prompt[:30] != prefixed[1].prompt[:30]
    data = [{"conversations": [{"from": "human", "value": "hello there, how are you " * (i + 1)},
                               {"from": "gpt", "value": "fine thanks " * (i + 1)}]} for i in range(5)]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    share = bench.sample_sharegpt(tok, str(tmp_path / "sg.json"), 3, seed=0)
    assert len(share) == 3 and all(r.output_len > 4 and r.prompt_len > 4 for r in share)
    with pytest.raises(SystemExit, match="usable"):
        bench.sample_sharegpt(tok, str(tmp_path / "sg.json"), 50, seed=0)


def test_prompts_workload_from_a_file_or_a_latency_workload(bench, tiny_checkpoints, tmp_path):
    """--dataset prompts: a JSON list of prompts or benchmarks/latency.py's workload by name, the first
    --num-prompts in order, each asking for --output-len tokens; anything else a clear SystemExit."""
    tok = bench.get_tokenizer(str(tiny_checkpoints["gqa4"]))
    (tmp_path / "mine.json").write_text(json.dumps(["copy this: abc", "and this: def", "third"]))
    reqs = bench.sample_prompts(tok, str(tmp_path / "mine.json"), 2, 64)
    assert [(r.prompt, r.output_len) for r in reqs] == [("copy this: abc", 64), ("and this: def", 64)]
    assert reqs[0].prompt_len == bench.count_tokens(tok, "copy this: abc")
    latency = load_script("benchmarks/latency.py")
    grounded = bench.sample_prompts(tok, "grounded-more", 20, 128)
    assert [r.prompt for r in grounded] == latency.GROUNDED_MORE
    (tmp_path / "bad.json").write_text(json.dumps(["ok", ""]))
    (tmp_path / "notjson.json").write_text("[")
    for path, num, message in ((str(tmp_path / "mine.json"), 4, "3 prompts, --num-prompts 4"),
                               ("no-such-workload", 1, "nor a benchmarks/latency.py workload"),
                               (str(tmp_path / "bad.json"), 1, "non-empty prompt strings"),
                               (str(tmp_path / "notjson.json"), 1, "cannot read")):
        with pytest.raises(SystemExit, match=message):
            bench.sample_prompts(tok, path, num, 8)
    args = serve_cli.bench_parse_args(["--dataset", "prompts", "--num-prompts", "1"])
    with pytest.raises(SystemExit, match="needs --dataset-path"):
        bench.build_requests(args, tok)


def test_warm_up_retries_a_dropped_connection(bench, server_url, tiny_checkpoints, tmp_path):
    """A server that drops the first connection unanswered (llama-server did, right after a busy run):
    the warm-up retries on a new connection and the run goes on; an HTTP error is not retried."""
    import socket
    import threading
    import urllib.parse

    target = urllib.parse.urlparse(server_url)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def pipe(src, dst):
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            if len(accepted) == 1:  # the first connection: closed without a response
                conn.close()
                continue
            upstream = socket.create_connection((target.hostname, target.port))
            threading.Thread(target=pipe, args=(conn, upstream), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        out = serve_cli.bench_main(_argv(url, tiny_checkpoints["gqa4"], tmp_path, "--num-warmups", "1", "--num-prompts", "2",
                               "--max-concurrency", "1"))
    finally:
        listener.close()
    (run,) = out["runs"]
    assert run["completed"] == 2 and run["failed"] == 0
    assert len(accepted) >= 4  # the dropped one, the warm-up's retry, the two requests
    with pytest.raises(SystemExit, match="warm-up request failed.*HTTP 404"):
        serve_cli.bench_main(_argv(server_url + "/nowhere", tiny_checkpoints["gqa4"], tmp_path, "--num-warmups", "1"))


def test_soak_through_the_same_client_against_live_server(server_url, tmp_path):
    """serve.py soak: its streamed requests go through serving_client.send_request (the one client), its
    non-streamed ones through a plain POST; every request of a short soak succeeds and the report counts them."""
    out = tmp_path / "soak.json"
    assert serve_cli.main(["soak", "--base-url", server_url, "--duration", "3", "--concurrency", "3",
                           "--model", MODEL_NAME, "--max-tokens", "6", "--max-prompt-words", "5",
                           "--sample-every", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["requests_ok"] >= 3
    assert report["output_tokens_per_s"] > 0 and report["ttft_s"]["p50"] <= report["latency_s"]["p50"]
    assert report["rss_mib_over_time"]  # read from /metrics: no --server-pid


def test_soak_reports_a_failing_server_by_error_kind(server_url):
    """Requests the server refuses (an unknown model: 404) are counted by kind, streamed or not, and the
    soak exits 1."""
    soak = load_script("benchmarks/soak.py")
    cfg = soak.SoakConfig(base_url=server_url, duration=1.5, concurrency=2, model="no-such-model", max_tokens=4)
    report = asyncio.run(soak.soak(cfg))
    assert report["requests_ok"] == 0 and set(report["errors"]) == {"HTTP 404"}

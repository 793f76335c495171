"""The one streaming client of the serving benchmarks: workloads, requests, per-chunk timings, vLLM's metrics.

`benchmarks/serve.py bench` (vLLM's `benchmark_serving.py`, against any OpenAI-compatible endpoint) and
`benchmarks/soak.py` (a mixed load for a given time) both send their streamed requests through
`send_request`: an httpx stream that times every text chunk and keeps the server's usage.

`run_benchmark` sends a workload's requests, at most `--max-concurrency` in flight, arriving as a
Poisson process at `--request-rate` per second (`inf`: all at once); `compute_metrics` gives vLLM's
summary: throughput, TTFT (time to first token), TPOT (time per output token after the first), ITL (gap
between streamed chunks), end-to-end latency.

Output tokens are counted the way vLLM's benchmark counts them: the server's own `usage.completion_tokens`
(asked for with `stream_options.include_usage`) where it sends one, else the tokenizer (`--tokenizer`, default
the `--model` name) over the request's streamed text. The tokenizer count is recorded too, and the summary says
how many requests disagree: text without the special tokens a server skips (e.g. a chat model's end-of-turn
marker, generated again under `ignore_eos`) retokenizes shorter, so a text count would undercount such a server.

Workloads (`--dataset`): `random` (random token ids decoded to text, or random words; lengths uniform in
[L * (1 - r), L * (1 + r)] for `--input-len` / `--output-len` L and `--range-ratio` r), `sharegpt` (a ShareGPT
JSON file: the first human turn, the first reply's length), `prefix` (`--num-prefixes` shared prefixes of
`--prefix-len` tokens, each request one of them and a random suffix: prefix caching), `prompts` (a JSON list of
prompts, or a benchmarks/latency.py workload by name: e.g. speculative decoding over HTTP).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np

SUMMARY_WIDTH = 50
NO_TEXT = "no text streamed"  # a stream that ended without error but carried no text
_WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
          "case point government company number group problem fact water room mother area money "
          "story month lot right study book word business issue side kind head house service friend "
          "father power hour game line end member law car city community name president team minute "
          "idea kid body information back parent face others level office door health art war history "
          "party result change morning reason research girl guy moment air teacher force education").split()


# ---- data ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SampleRequest:
    """One prompt to send, its token count (by our tokenizer) and the output tokens to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


@dataclasses.dataclass
class RequestResult:
    """What one request produced, with its timings (seconds, from time.perf_counter())."""

    prompt_len: int
    output_len_requested: int
    success: bool = False
    error: str = ""
    generated_text: str = ""
    start: float = 0.0          # since the benchmark start
    ttft: float = 0.0           # first non-empty text chunk, after `start`
    latency: float = 0.0        # last byte of the response, after `start`
    itl: list[float] = dataclasses.field(default_factory=list)           # gaps between text chunks
    chunk_times: list[float] = dataclasses.field(default_factory=list)   # text chunk arrivals (benchmark clock)
    output_tokens: int = 0                  # the server's usage.completion_tokens, else text_tokens
    text_tokens: int = 0                    # tokenizer count over generated_text
    usage_prompt_tokens: int | None = None  # the server's usage, when it sent one
    usage_completion_tokens: int | None = None


# ---- tokenizer -----------------------------------------------------------------------------------------------------

def get_tokenizer(name: str):
    """A tokenizer from a jaxpaged model name, a .gguf file, a HF folder or a HF repo id.

    jaxpaged names (e.g. smollm2-135m-instruct) resolve through
    `jaxpaged.models.loader.resolve_model_path`; a GGUF file gives the tokenizer it embeds.
    """
    from jaxpaged.models.loader import ModelNotFoundError, resolve_model_path
    try:
        path = resolve_model_path(name)
    except ModelNotFoundError:
        path = None
    if path is not None and path.is_file() and path.suffix == ".gguf":
        from jaxpaged.models.gguf_loader import open_gguf
        from jaxpaged.tokenizer import load_gguf_tokenizer
        return load_gguf_tokenizer(open_gguf(path))
    if path is not None and path.is_dir() and not (path / "tokenizer.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return get_tokenizer(str(ggufs[0]))
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path or name))
    except Exception as err:
        raise SystemExit(f"cannot load a tokenizer for {name!r} ({type(err).__name__}: {err}); "
                         "pass --tokenizer (a HF folder, .gguf file or jaxpaged model name)") from None


def count_tokens(tokenizer, text: str) -> int:
    """Tokens in `text` without special tokens (vLLM's benchmark count)."""
    if not text:
        return 0
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _normal_ids(tokenizer) -> np.ndarray:
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def _text_of_len(tokenizer, ids: np.ndarray, target: int, rng: np.random.Generator,
                 vocab: np.ndarray) -> tuple[str, int]:
    """Decode ids to text that re-encodes to about `target` tokens (bounded fix-up, as vLLM)."""
    text = tokenizer.decode(ids.tolist())
    for _ in range(10):
        ids_now = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids_now) == target:
            break
        if len(ids_now) > target:
            ids_now = ids_now[:target]
        else:
            ids_now = ids_now + rng.choice(vocab, size=target - len(ids_now)).tolist()
        text = tokenizer.decode(ids_now)
    return text, count_tokens(tokenizer, text)


def _lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    if not 0 <= ratio < 1:
        raise SystemExit(f"--range-ratio must be in [0, 1), got {ratio}")
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def sample_random(tokenizer, num: int, input_len: int, output_len: int, ratio: float, seed: int,
                  source: str = "tokens") -> list[SampleRequest]:
    """vLLM's random dataset: random tokens (or words) of uniformly distributed lengths."""
    rng = np.random.default_rng(seed)
    vocab = _normal_ids(tokenizer)
    in_lens, out_lens = _lengths(input_len, ratio, num, rng), _lengths(output_len, ratio, num, rng)
    requests = []
    for n_in, n_out in zip(in_lens, out_lens):
        if source == "words":
            text = " ".join(rng.choice(_WORDS, size=n_in).tolist())
            requests.append(SampleRequest(text, count_tokens(tokenizer, text), n_out))
        else:
            requests.append(SampleRequest(*_text_of_len(tokenizer, rng.choice(vocab, size=n_in), n_in, rng, vocab),
                                          n_out))
    return requests


def sample_prefix(tokenizer, num: int, num_prefixes: int, prefix_len: int, input_len: int,
                  output_len: int, ratio: float, seed: int, source: str = "tokens") -> list[SampleRequest]:
    """`num_prefixes` long shared prefixes; each request = one of them + its own random suffix."""
    if num_prefixes < 1:
        raise SystemExit("--num-prefixes must be >= 1")
    prefixes = [r.prompt for r in sample_random(tokenizer, num_prefixes, prefix_len, 1, 0.0, seed + 1, source)]
    suffixes = sample_random(tokenizer, num, input_len, output_len, ratio, seed, source)
    prompts = [prefixes[i % num_prefixes] + " " + r.prompt for i, r in enumerate(suffixes)]
    return [SampleRequest(p, count_tokens(tokenizer, p), r.output_len) for p, r in zip(prompts, suffixes)]


def sample_sharegpt(tokenizer, path: str, num: int, seed: int, output_len: int | None = None,
                    max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[SampleRequest]:
    """ShareGPT JSON (a list of {"conversations": [{"from", "value"}, ...]}), filtered as vLLM does."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"--dataset-path {path}: cannot read ShareGPT JSON ({err})") from None
    convs = [d.get("conversations") or d.get("conversation") or [] for d in data if isinstance(d, dict)]
    convs = [c for c in convs if len(c) >= 2]
    random.Random(seed).shuffle(convs)
    requests = []
    for conv in convs:
        if len(requests) == num:
            break
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        n_in = count_tokens(tokenizer, prompt)
        n_out = output_len if output_len is not None else count_tokens(tokenizer, reply)
        if n_in < 4 or n_out < 4 or n_in > max_prompt_len or n_in + n_out > max_total_len:
            continue
        requests.append(SampleRequest(prompt, n_in, n_out))
    if len(requests) < num:
        raise SystemExit(f"{path}: only {len(requests)} usable conversations, --num-prompts {num} asked")
    return requests


def sample_prompts(tokenizer, path: str, num: int, output_len: int) -> list[SampleRequest]:
    """`--dataset prompts`: the first `num` prompts of a JSON list or of a benchmarks/latency.py workload (by
    name), in order, each asking for `output_len` tokens."""
    import latency  # benchmarks/latency.py, a sibling: it holds the workloads (stdlib imports only at its top)
    try:
        prompts = latency.named_or_file_prompts(path)
    except ValueError as err:
        raise SystemExit(f"--dataset-path {path}: {err}") from None
    if num > len(prompts):
        raise SystemExit(f"--dataset-path {path}: {len(prompts)} prompts, --num-prompts {num} asked")
    return [SampleRequest(p, count_tokens(tokenizer, p), output_len) for p in prompts[:num]]


def build_requests(args, tokenizer) -> list[SampleRequest]:
    """The workload `args.dataset` names."""
    if args.dataset in ("sharegpt", "prompts") and not args.dataset_path:
        raise SystemExit(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset == "random":
        return sample_random(tokenizer, args.num_prompts, args.input_len, args.output_len,
                             args.range_ratio, args.seed, args.random_source)
    if args.dataset == "prefix":
        return sample_prefix(tokenizer, args.num_prompts, args.num_prefixes, args.prefix_len, args.input_len,
                             args.output_len, args.range_ratio, args.seed, args.random_source)
    if args.dataset == "sharegpt":
        return sample_sharegpt(tokenizer, args.dataset_path, args.num_prompts, args.seed, args.sharegpt_output_len)
    if args.dataset == "prompts":
        return sample_prompts(tokenizer, args.dataset_path, args.num_prompts, args.output_len)
    raise SystemExit(f"unknown --dataset {args.dataset!r}")


# ---- http ----------------------------------------------------------------------------------------------------------

def build_payload(args, req: SampleRequest) -> dict[str, Any]:
    """The JSON body for one request (streaming, usage included, vLLM's ignore_eos when asked)."""
    body: dict[str, Any] = {"model": args.served_model_name or args.model, "max_tokens": req.output_len,
                            "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.top_k is not None:
        body["top_k"] = args.top_k
    body.update(args.extra_body or {})
    return body


def endpoint_url(args) -> str:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    return args.base_url.rstrip("/") + path


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    return ((choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")) or ""


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, endpoint: str,
                       req: SampleRequest, t0: float, headers: dict) -> RequestResult:
    """Stream one request; time each text chunk; collect the server's usage."""
    result = RequestResult(prompt_len=req.prompt_len, output_len_requested=req.output_len)
    start = time.perf_counter()
    result.start = start - t0
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                now = time.perf_counter()
                text = _chunk_text(chunk, endpoint)
                if text:
                    if not result.chunk_times:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunk_times.append(now - t0)
                    result.generated_text += text
                usage = chunk.get("usage")
                if usage:
                    result.usage_prompt_tokens = usage.get("prompt_tokens")
                    result.usage_completion_tokens = usage.get("completion_tokens")
        result.latency = time.perf_counter() - start
        result.success = bool(result.chunk_times)
        if not result.success:
            result.error = NO_TEXT
    except Exception as err:  # noqa: BLE001 - every failure is a failed request in the report
        result.error = f"{type(err).__name__}: {err}"
    return result


async def _arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield request indices, sleeping Poisson (gamma, for burstiness != 1) gaps at `rate`/s."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if math.isinf(rate) or i == n - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(float(rng.gamma(burstiness, theta)))


async def run_benchmark(args, requests: list[SampleRequest], concurrency: int | None,
                        tokenizer) -> tuple[list[RequestResult], float]:
    """Send every request (bounded concurrency, paced arrivals); results and the wall duration."""
    url, headers = endpoint_url(args), _headers(args)
    limit = concurrency or len(requests)
    # a fresh connection per request: llama-server closes kept-alive connections after a few requests, and a
    # request sent on one it is closing failed with "Server disconnected without sending a response"
    # (3 of 12 at concurrency 1); a local TCP connect costs microseconds, the same for every server
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    semaphore = asyncio.Semaphore(limit)
    bar = _progress(len(requests), args.disable_tqdm, f"concurrency {concurrency or 'inf'}")

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def one(req: SampleRequest) -> RequestResult:
            async with semaphore:
                res = await send_request(client, url, build_payload(args, req), args.endpoint, req, t0, headers)
            if bar is not None:
                bar.update(1)
            return res

        tasks = []
        async for i in _arrivals(len(requests), args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(one(requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    for res in results:
        count_output(res, tokenizer)
    return list(results), duration


def count_output(res: RequestResult, tokenizer) -> None:
    """Set a request's output token counts: the server's usage where it sent one (as vLLM's benchmark
    does), else the tokenizer over its text; the tokenizer count is kept either way."""
    res.text_tokens = count_tokens(tokenizer, res.generated_text) if res.success else 0
    usage = res.usage_completion_tokens
    res.output_tokens = 0 if not res.success else res.text_tokens if usage is None else usage


WARMUP_ATTEMPTS = 3
_DROPPED = ("RemoteProtocolError", "ConnectError", "ReadError")  # connection-level failures worth a retry


async def warm_up(args, requests: list[SampleRequest]) -> None:
    """`--num-warmups` requests one at a time (not measured); fail clearly if the first one fails."""
    if args.num_warmups <= 0 or not requests:
        return
    # fresh connections, and a dropped one retried: llama-server sometimes closes the first connection made
    # right after a busy run ("Server disconnected without sending a response"); an unmeasured warm-up
    # need not fail the run for that, an HTTP error still does
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30.0), limits=limits) as client:
        for i in range(args.num_warmups):
            req = requests[i % len(requests)]
            for attempt in range(WARMUP_ATTEMPTS):
                res = await send_request(client, endpoint_url(args), build_payload(args, req), args.endpoint,
                                         req, time.perf_counter(), _headers(args))
                if res.success or not res.error.startswith(_DROPPED):
                    break
                await asyncio.sleep(0.5 * (attempt + 1))
            if not res.success:
                raise SystemExit(f"warm-up request failed ({endpoint_url(args)}): {res.error}")


def _headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _progress(total: int, disabled: bool, desc: str):
    if disabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr)


# ---- metrics -------------------------------------------------------------------------------------------------------

def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/p<N> of `values_s` (seconds) in milliseconds, keyed like vLLM's JSON."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0 if len(values_s) else np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{_pct_label(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def peak_output_throughput(results: list[RequestResult]) -> float:
    """Most output tokens in any 1-second bucket of the benchmark clock.

    A chunk may carry several tokens and is not tokenised on its own, so each of a
    request's text chunks is weighted output_tokens / chunks (per-request totals stay exact).
    """
    buckets: dict[int, float] = {}
    for res in results:
        if not res.success or not res.chunk_times:
            continue
        weight = res.output_tokens / len(res.chunk_times)
        for t in res.chunk_times:
            buckets[int(t)] = buckets.get(int(t), 0.0) + weight
    return max(buckets.values(), default=0.0)


def compute_metrics(results: list[RequestResult], duration: float,
                    percentiles: Sequence[float] = (99,)) -> dict[str, Any]:
    """vLLM's summary metrics over one run (failed requests count only as failures)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [gap for r in ok for gap in r.itl]
    with_usage = [r for r in ok if r.usage_completion_tokens is not None]
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "peak_output_throughput": peak_output_throughput(ok),
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "server_usage_requests": len(with_usage),
        "total_input_tokens_server": sum(r.usage_prompt_tokens or 0 for r in with_usage),
        "total_output_tokens_server": sum(r.usage_completion_tokens for r in with_usage),
        "total_output_tokens_text": sum(r.text_tokens for r in ok),
        "output_token_mismatches": sum(r.usage_completion_tokens != r.text_tokens for r in with_usage),
        "mean_output_tokens_per_request": total_out / len(ok) if ok else 0.0,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    metrics.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    metrics.update(_stats("tpot", tpots, percentiles))
    metrics.update(_stats("itl", itls, percentiles))
    metrics.update(_stats("e2el", [r.latency for r in ok], percentiles))
    return metrics


def format_summary(metrics: dict[str, Any], title: str, percentiles: Sequence[float] = (99,)) -> str:
    """vLLM's summary block as text."""
    lines = ["{s:{c}^{n}}".format(s=f" {title} ", n=SUMMARY_WIDTH, c="=")]

    def row(label, value, fmt="{:<40} {:<10}"):
        lines.append(fmt.format(label, value))

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if metrics.get("max_concurrency") is not None:
        row("Maximum request concurrency:", metrics["max_concurrency"])
    row("Benchmark duration (s):", f"{metrics['duration']:.2f}")
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Total generated tokens (server usage):",
        f"{metrics['total_output_tokens_server']} ({metrics['server_usage_requests']} reqs)")
    row("Total generated tokens (text, tokenizer):", metrics["total_output_tokens_text"])
    row("Usage vs tokenizer mismatches:", metrics["output_token_mismatches"])
    row("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}")
    row("Peak output token throughput (tok/s):", f"{metrics['peak_output_throughput']:.2f}")
    row("Total Token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}")
    for key, head in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                      ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^{n}}".format(s=head, n=SUMMARY_WIDTH, c="-"))
        row(f"Mean {key.upper()} (ms):", f"{metrics[f'mean_{key}_ms']:.2f}")
        row(f"Median {key.upper()} (ms):", f"{metrics[f'median_{key}_ms']:.2f}")
        for p in percentiles:
            row(f"P{_pct_label(p)} {key.upper()} (ms):", f"{metrics[f'p{_pct_label(p)}_{key}_ms']:.2f}")
    lines.append("=" * SUMMARY_WIDTH)
    return "\n".join(lines)


def request_records(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Per-request records for --save-json (chunk times omitted; ITL kept)."""
    keys = ("prompt_len", "output_len_requested", "success", "error", "start", "ttft", "latency",
            "output_tokens", "text_tokens", "usage_prompt_tokens", "usage_completion_tokens", "itl", "generated_text")
    return [{k: getattr(r, k) for k in keys} for r in results]


"""The engine in-process (no HTTP), each a subcommand printing ours beside its baseline from one run.

    python benchmarks/offline.py throughput [--num-prompts 64]      # LLM.generate vs transformers' generate
    python benchmarks/offline.py structured [--concurrency 32]   # half JSON-constrained vs none
    python benchmarks/offline.py update-weights [--random llama3-8b --target-seconds 2]   # vs a new engine
    python benchmarks/offline.py batch-invariant [--smoke]      # the mode's bits and cost (a GPU: gpu_check.sh)

throughput      offline output tok/s: jaxpaged's LLM against transformers' `generate` in static batches
structured      what structured outputs cost a serving batch (`python -m server`, from servers.py's launcher)
update-weights  seconds of `update_weights` against a new engine and the bare copy of the same bytes
batch-invariant on a GPU: the fixed-tile GEMM against XLA's dots, a request's bits alone and in a batch, the cost

`offline.py <command> -h` prints the command's full description. transformers and the HTTP client are
imported by the command that needs them (update-weights runs on the GPU image, which has no HTTP server).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxpaged
from jaxpaged import LLM, SamplingParams  # noqa: E402
from jaxpaged.config import EngineArgs  # noqa: E402
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402

THROUGHPUT_DOC = """Offline throughput: jaxpaged's LLM vs transformers' `generate` in static batches, same prompts.

    python benchmarks/offline.py throughput                      # the documented workload
    python benchmarks/offline.py throughput --num-prompts 32     # a quicker look

Synthetic workload (vLLM's "random" dataset): prompts of random token ids with
input lengths uniform in [--input-min, --input-max] and output lengths uniform
in [--output-min, --output-max], EOS ignored so both engines produce exactly the
requested tokens. Both run the same weights in float32 on the default device.
Output tokens/s counts the requested output tokens only (static batches also
compute padding and run to the longest request of each batch: that waste is
exactly what continuous batching removes)."""
STRUCTURED_DOC = """What structured outputs cost a serving batch: output tok/s with half the requests JSON-schema
constrained vs the same load unconstrained, side by side in one run (one server, one warm-up).

    python benchmarks/offline.py structured --model smollm2-135m-instruct --concurrency 32

Loads, each `--concurrency` chat requests sent at once through the OpenAI API (`python -m server` on
127.0.0.1, started by benchmarks/servers.py):
  unconstrained      every request free text (ignore_eos, `--max-tokens` tokens)
  half constrained   every other request constrained by a JSON schema (response_format json_schema),
                     the rest as above
  unconstrained (2)  the first load again: how much the figures move between identical runs (noise)

Output tok/s = completion tokens (the server's usage) / the load's wall time. The constrained load
must keep >= 80% of the unconstrained figure (issue 16); the grammar's per-step cost (llguidance's
bitmask, the sampler's mask) is the difference. The rounds alternate (`--rounds`) so drift from other
work on the machine hits both sides alike."""
UPDATE_WEIGHTS_DOC = """Seconds of `update_weights` (jaxpaged/worker/live_weights.py) on a real or a random model, side by side with
what it replaces (a new engine on the new weights) and with the bare copy of the same bytes, from one run.

    python benchmarks/offline.py update-weights                       # SmolLM2-135M (the default model), float32
    python benchmarks/offline.py update-weights --model /a/hf/folder --dtype bfloat16 --repeats 5
    python benchmarks/offline.py update-weights --random llama3-8b --target-seconds 2   # GPU: random bf16 8B shape
    python benchmarks/offline.py update-weights --random smoke        # any machine: the tiny random shape

Rows (first run, median, every run; the first run of a process also pays its fresh memory's page faults):
  update, host numpy, all tensors   every weight as a host numpy array (get_weights' copies, scaled): a host-side
                                    trainer; includes the finite/shape checks
  update, jax.Array, all tensors    the same already on the engine's device (on a GPU: converted there, the
                                    trainer-in-the-same-process case)
  update, one layer                 layer 0's tensors (a fused projection's other parts read back)
  sleep(1) + wake_up()              the KV pool freed and allocated again
  floor: device_put, all tensors    the host arrays copied to the device as they are (no conversion, no checks)
  baseline: a new engine            (a real model) LLM(...) on the same model, no warm-up: what a restart costs
--target-seconds T prints a PASS / MISS line for the median of "update, jax.Array, all tensors" (issue #65: SmolLM2
on the CPU < 1 s; the Llama-3-8B shape on the H200 < 2 s)."""


# ---- throughput --------------------------------------------------------------------------------------------

def make_workload(tokenizer, num_prompts: int, lengths: tuple[int, int, int, int], seed: int):
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
    in_lens = rng.integers(lengths[0], lengths[1] + 1, size=num_prompts)
    out_lens = rng.integers(lengths[2], lengths[3] + 1, size=num_prompts)
    prompts = [rng.choice(vocab, size=n).tolist() for n in in_lens]
    return prompts, out_lens.tolist()


def run_jaxpaged(args, prompts, out_lens) -> dict:
    from jaxpaged import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.input_max + args.output_max,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_gib << 30)
    startup = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    stats = llm.llm_engine.stats()
    return {"engine": "jaxpaged", "seconds": seconds, "startup_seconds": startup, "output_tokens": produced,
            "preemptions": stats["num_preemptions"]}


def run_transformers(args, prompts, out_lens) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged.models.loader import resolve_model_path

    path = resolve_model_path(args.model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    torch.set_num_threads(args.torch_threads or torch.get_num_threads())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    start = time.perf_counter()
    order = range(0, len(prompts), args.hf_batch_size)
    for b in order:
        batch, lens = prompts[b:b + args.hf_batch_size], out_lens[b:b + args.hf_batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=pad)
        print(f"  transformers batch {b // args.hf_batch_size + 1}/{len(order)} done", flush=True)
    seconds = time.perf_counter() - start
    return {"engine": f"transformers generate (static batch {args.hf_batch_size})", "seconds": seconds,
            "output_tokens": sum(out_lens)}


def throughput_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="offline.py throughput", description=THROUGHPUT_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-min", type=int, default=32)
    parser.add_argument("--input-max", type=int, default=512)
    parser.add_argument("--output-min", type=int, default=32)
    parser.add_argument("--output-max", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--torch-threads", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--save-json", default=None)
    args = parser.parse_args(argv)

    from jaxpaged.models.loader import load_model
    tokenizer = load_model(args.model).tokenizer
    lengths = (args.input_min, args.input_max, args.output_min, args.output_max)
    prompts, out_lens = make_workload(tokenizer, args.num_prompts, lengths, args.seed)
    print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} input tokens, {sum(out_lens)} output "
          f"tokens (in {lengths[0]}-{lengths[1]}, out {lengths[2]}-{lengths[3]}, seed {args.seed})")
    results = [run_jaxpaged(args, prompts, out_lens)]
    if not args.skip_transformers:
        results.append(run_transformers(args, prompts, out_lens))
    print(f"\n{'engine':44s} {'seconds':>9s} {'output tok/s':>13s} {'requests/s':>11s}")
    for r in results:
        r["output_tokens_per_s"] = r["output_tokens"] / r["seconds"]
        r["requests_per_s"] = len(prompts) / r["seconds"]
        print(f"{r['engine']:44s} {r['seconds']:9.1f} {r['output_tokens_per_s']:13.1f} {r['requests_per_s']:11.2f}")
    if len(results) == 2:
        ratio = results[0]["output_tokens_per_s"] / results[1]["output_tokens_per_s"]
        print(f"{'ratio jaxpaged / transformers':44s} {'':9s} {ratio:12.2f}x")
    print(f"(jaxpaged start-up incl. warm-up compile: {results[0]['startup_seconds']:.1f} s, "
          f"preemptions: {results[0]['preemptions']})")
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


# ---- structured --------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 30},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 4},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "hobbies", "employed"], "additionalProperties": False}
PROMPTS = ["Describe a person who lives in {}.", "Invent a character from {}.", "Tell me about someone from {}."]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul"]


def request_body(i: int, constrained: bool, max_tokens: int, model: str) -> dict:
    prompt = PROMPTS[i % len(PROMPTS)].format(CITIES[i % len(CITIES)])
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.8, "seed": i}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    return body


async def run_load(url: str, model: str, concurrency: int, max_tokens: int, constrained_every: int) -> dict:
    """`concurrency` requests at once; every `constrained_every`-th constrained (0: none)."""
    import httpx
    async with httpx.AsyncClient(timeout=600) as client:
        bodies = [request_body(i, bool(constrained_every) and i % constrained_every == 0, max_tokens, model)
                  for i in range(concurrency)]
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=b) for b in bodies))
        wall = time.perf_counter() - start
    tokens = constrained_tokens = valid = constrained = 0
    for body, reply in zip(bodies, replies):
        reply.raise_for_status()
        data = reply.json()
        tokens += data["usage"]["completion_tokens"]
        if "response_format" in body:
            constrained += 1
            constrained_tokens += data["usage"]["completion_tokens"]
            try:
                json.loads(data["choices"][0]["message"]["content"])
                valid += 1
            except ValueError:
                pass
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "constrained": constrained,
            "constrained_tokens": constrained_tokens, "valid_json": valid}


def structured_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="offline.py structured", description=STRUCTURED_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2, help="times each load runs (alternating)")
    args = p.parse_args(argv)
    import servers  # benchmarks/servers.py, the one server launcher (it imports httpx)
    port = servers.free_port()
    spec = servers.jaxpaged_spec(None, port, f"--max-model-len {args.max_model_len} --max-num-seqs "
                                 f"{args.concurrency} --max-num-batched-tokens {args.max_num_batched_tokens}", args.model)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as logs, servers.running_server(spec, Path(logs) / "server.log", 900):
        asyncio.run(run_load(url, args.model, 4, 8, 2))  # compiles the schema, touches every path once
        rows: dict[str, list[dict]] = {"unconstrained": [], "half constrained": []}
        for _ in range(args.rounds):
            rows["unconstrained"].append(asyncio.run(run_load(url, args.model, args.concurrency, args.max_tokens, 0)))
            rows["half constrained"].append(asyncio.run(run_load(url, args.model, args.concurrency,
                                                                 args.max_tokens, 2)))
    print(f"{args.concurrency} concurrent chat requests, {args.max_tokens} max tokens, model {args.model}")
    print(f"{'load':<18} {'round':>5} {'wall s':>8} {'out tokens':>10} {'out tok/s':>10} {'valid JSON':>10}")
    for name, results in rows.items():
        for i, r in enumerate(results):
            valid = f"{r['valid_json']}/{r['constrained']}" if r["constrained"] else "-"
            print(f"{name:<18} {i:>5} {r['wall_s']:>8.2f} {r['tokens']:>10} {r['tok_s']:>10.1f} {valid:>10}")
    free = [r["tok_s"] for r in rows["unconstrained"]]
    half = [r["tok_s"] for r in rows["half constrained"]]
    ratio = (sum(half) / len(half)) / (sum(free) / len(free))
    spread = (max(free) - min(free)) / (sum(free) / len(free))
    print(f"half constrained / unconstrained output tok/s: {ratio:.2f} (target >= 0.80); "
          f"unconstrained round-to-round spread: {spread:.0%}")
    return 0


# ---- update-weights ----------------------------------------------------------------------------------------

def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` runs (device work waited for)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def row(name: str, times: list[float]) -> str:
    runs = " ".join(f"{t:.3f}" for t in times)
    return f"{name:40s} {times[0]:8.3f} {statistics.median(times):9.3f}   ({runs})"


def greedy(engine: LLMEngine) -> list[int]:
    """Eight greedy tokens of a fixed prompt (`run_greedy`)."""
    (tokens, _), = run_greedy(engine, [list(range(100, 140))], 8, logprobs=False)[0].values()
    return tokens


def measure(engine: LLMEngine, weights: dict, repeats: int) -> list[tuple[str, list[float]]]:
    """(name, seconds of each run) of the update and sleep rows and the copy floor."""
    host = {n: x * np.asarray(1.001, x.dtype) for n, x in weights.items()}
    device = jax.device_put(weights)
    layer0 = {n: x for n, x in weights.items() if n.startswith("model.layers.0.")}

    def after_update(w):
        engine.update_weights(w)
        return jax.tree.leaves(engine.runner.params)

    rows = [("update, host numpy, all tensors", lambda: after_update(host)),
            ("update, jax.Array, all tensors", lambda: after_update(device)),
            (f"update, one layer ({len(layer0)} tensors)", lambda: after_update(layer0)),
            ("sleep(1) + wake_up()", lambda: (engine.sleep(1), engine.wake_up(), jax.tree.leaves(engine.runner.kv))),
            ("floor: device_put, all tensors", lambda: jax.device_put(host))]
    return [(name, timed(fn, repeats)) for name, fn in rows]


def random_engine(shape: str) -> LLMEngine:
    """An engine on random bf16 weights of `shape` (benchmarks/gpu_engine.py's), a small KV pool (the device
    also holds the jax.Array copy of the weights)."""
    from gpu_engine import LLAMA3_8B, SMOKE, random_model  # pylint: disable=import-outside-toplevel
    config = {"llama3-8b": LLAMA3_8B, "smoke": SMOKE}[shape]
    args = EngineArgs(model="random", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256,
                      kv_cache_memory=1 << 30, warmup=False)
    return LLMEngine(args, loaded=random_model(config))


def update_weights_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="offline.py update-weights", description=UPDATE_WEIGHTS_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--random", choices=("llama3-8b", "smoke"), help="random bf16 weights of this shape")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--target-seconds", type=float)
    args = parser.parse_args(argv)
    engine_args = {"dtype": args.dtype, "max_model_len": args.max_model_len, "warmup": False}
    engine = random_engine(args.random) if args.random else LLM(args.model, **engine_args).llm_engine
    name = f"random {args.random} (bfloat16)" if args.random else f"{args.model} ({args.dtype})"
    before = greedy(engine)
    weights = engine.get_weights()
    print(f"{name}, {len(weights)} tensors, {sum(x.nbytes for x in weights.values()) / 2**20:.0f} MiB, "
          f"{args.repeats} runs each, {jax.devices()[0].device_kind}; layout {engine.runner.layout}")
    print(f"{'':40s} {'first s':>8s} {'median s':>9s}   (each run)")
    rows = measure(engine, weights, args.repeats)
    for label, times in rows:
        print(row(label, times))
    engine.update_weights(weights)
    print(f"greedy tokens after restoring the weights equal those before: {greedy(engine) == before}")
    if not args.random:
        del engine
        print(row("baseline: a new engine (no warm-up)",
                  timed(lambda: LLM(args.model, **engine_args), min(args.repeats, 3))))
    if args.target_seconds is not None:
        median = statistics.median(dict(rows)["update, jax.Array, all tensors"])
        verdict = "PASS" if median < args.target_seconds else "MISS"
        print(f"{verdict:10s} update_weights of {name} (jax.Array, all tensors): median {median:.3f} s, "
              f"target < {args.target_seconds} s")
    return 0


# ---- batch-invariant -----------------------------------------------------------------------------------------

BATCH_INVARIANT_DOC = """Batch-invariant mode (docs/rl.md): are a row's bits its own, and what does the mode cost?

    python benchmarks/offline.py batch-invariant            # on the GPU machine (part of scripts/gpu_check.sh)
    python benchmarks/offline.py batch-invariant --smoke    # tiny shapes, any device (kernel in interpret mode)

From one run: (1) the Llama-3-8B weight dots in bf16 at 1, 64 and 2048 rows, the fixed-tile GEMM
(pallas_kernels/batch_invariant_matmul.py) against XLA's dot, ms each, and row 0's bits alone vs in 64 rows;
(2) a random bf16 Llama-3.2-1B-shaped engine, batch_invariant=True and the default one after the other: a greedy
request's tokens and log-probs alone vs beside 63 others (equal bits?), and 64 concurrent requests' output tok/s.
--json appends one JSON object per row."""

# (name, K, N, transpose_w): the Llama-3-8B weight dots as the engine holds them on a GPU
DOTS_8B = (("wqkv", 4096, 6144, False), ("wo", 4096, 4096, False), ("w_gate_up", 4096, 28672, False),
           ("w_down", 14336, 4096, False), ("lm_head", 4096, 128256, False))
DOTS_SMOKE = (("wqkv", 128, 256, False), ("w_down", 200, 128, False), ("tied_head", 128, 500, True))


def same_bits(a, b) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def invariant_dots(args) -> None:
    """Part 1: each weight dot at 1, 64 and 2048 rows, ours vs XLA's (median ms); row 0 alone vs in 64 rows."""
    import functools  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from pallas_kernels.batch_invariant_matmul import batch_invariant_matmul  # pylint: disable=import-outside-toplevel
    from gpu_engine import Report  # pylint: disable=import-outside-toplevel
    report, interpret = Report(args.json), jax.default_backend() != "gpu"
    dtype = jnp.float32 if interpret else jnp.bfloat16
    for name, k, n, transpose_w in DOTS_SMOKE if args.smoke else DOTS_8B:
        w = (jax.random.normal(jax.random.PRNGKey(k + n), (n, k) if transpose_w else (k, n), jnp.float32)
             / np.sqrt(k)).astype(dtype)
        ours = jax.jit(functools.partial(batch_invariant_matmul, transpose_w=transpose_w, interpret=interpret))
        xla = jax.jit(lambda x, w, t=transpose_w: x @ (w.T if t else w))
        for m in (1, 8, 64) if args.smoke else (1, 64, 2048):
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(dtype)
            a, b = (1e3 * statistics.median(timed(lambda f=f: f(x, w), args.iters + 1)[1:]) for f in (ours, xla))
            report.row(f"dot {name} M={m}", f"ours {a:8.3f} ms  xla {b:8.3f} ms", f"ours/xla x{a / b:5.2f}",
                       part="dot", dot=name, m=m, ours_ms=a, xla_ms=b)
        x = jax.random.normal(jax.random.PRNGKey(7), (64, k), jnp.float32).astype(dtype)
        alone = {f: same_bits(fn(x[:1], w)[0], fn(x, w)[0]) for f, fn in (("ours", ours), ("xla", xla))}
        report.row(f"dot {name} row 0", f"ours {alone['ours']}  xla {alone['xla']}", "alone == in 64 rows (bits)",
                   part="dot_bits", dot=name, ours_equal=alone["ours"], xla_equal=alone["xla"])


def run_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, logprobs: bool) -> tuple[dict, float]:
    """{index: (token ids, sampled log-probs)} of greedy requests run to the end together, and the seconds."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            logprobs=0 if logprobs else None)
    tag = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    done, start = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lps = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)] if logprobs else []
                done[int(out.request_id.rsplit("-", 1)[1])] = (list(c.token_ids), np.asarray(lps, np.float32))
    return done, time.perf_counter() - start


def invariant_engine_rows(args) -> None:
    """Part 2: per mode, a request alone vs beside 63 others (bits), and 64 concurrent requests' tokens/s."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from jaxpaged.models.llama import LlamaConfig  # pylint: disable=import-outside-toplevel
    from jaxpaged.models.params import init_params  # pylint: disable=import-outside-toplevel
    from jaxpaged.models.loader import LoadedModel  # pylint: disable=import-outside-toplevel
    from jaxpaged.tokenizer import GenerationConfig  # pylint: disable=import-outside-toplevel
    from gpu_engine import SMOKE, Report  # pylint: disable=import-outside-toplevel
    report, on_gpu = Report(args.json), jax.default_backend() == "gpu"
    config = dataclasses.replace(SMOKE, head_dim=64) if args.smoke else LlamaConfig(  # Llama-3.2-1B's shape
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096,
        tie_word_embeddings=True)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32  # the CPU's mode needs float32 (its native kernels)
    loaded = LoadedModel(config=config, params=init_params(config, jax.random.PRNGKey(0), dtype), tokenizer=None,
                         generation_config=GenerationConfig(), source=Path("random"), dtype=np.dtype(dtype),
                         load_seconds=0.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, int(rng.integers(8, args.prompt_len))).tolist()
               for _ in range(args.concurrency)]
    rates = {}
    for invariant in (True, False):
        label = "batch-invariant" if invariant else "default"
        engine = LLMEngine(EngineArgs(model="random", dtype=np.dtype(dtype).name,
                                      max_model_len=args.prompt_len + args.output_len + 16,
                                      max_num_seqs=args.concurrency, max_num_batched_tokens=args.batched_tokens,
                                      batch_invariant=invariant, enable_prefix_caching=False), loaded=loaded)
        alone, _ = run_greedy(engine, prompts[:1], args.output_len, logprobs=True)
        together, _ = run_greedy(engine, prompts, args.output_len, logprobs=True)
        equal = alone[0][0] == together[0][0] and same_bits(alone[0][1], together[0][1])
        report.row(f"engine {label}", "EQUAL BITS" if equal else "DIFFER",
                   f"alone vs beside {len(prompts) - 1} (tokens equal: {alone[0][0] == together[0][0]})",
                   part="engine_bits", mode=label, equal=equal, others=len(prompts) - 1)
        _, seconds = run_greedy(engine, prompts, args.output_len, logprobs=False)
        rates[label] = args.concurrency * args.output_len / seconds
        report.row(f"engine {label}", f"{rates[label]:.1f} out tok/s", f"{args.concurrency} concurrent",
                   part="engine_rate", mode=label, out_tok_s=rates[label])
        del engine
    ratio = rates["default"] / rates["batch-invariant"]
    report.row("engine cost", f"x{ratio:.2f}", "default / batch-invariant output tok/s", part="engine_cost",
               ratio=ratio, concurrency=args.concurrency)


def batch_invariant_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="offline.py batch-invariant", description=BATCH_INVARIANT_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args(argv)
    if not args.smoke and jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (backend is {jax.default_backend()!r}); use --smoke elsewhere")
    args.iters = args.iters or (2 if args.smoke else 20)
    args.concurrency, args.prompt_len, args.output_len = (8, 24, 8) if args.smoke else (64, 128, 64)
    args.batched_tokens = 64 if args.smoke else 512
    print(f"== batch-invariant mode, jax {jax.__version__}, {jax.devices()[0].device_kind}"
          + (" (smoke: tiny shapes, not a measurement)" if args.smoke else ""))
    invariant_dots(args)
    if not args.skip_engine:
        invariant_engine_rows(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"throughput": throughput_main, "structured": structured_main, "update-weights": update_weights_main,
                "batch-invariant": batch_invariant_main}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

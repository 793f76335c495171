"""The engine end to end on a GPU with a Llama-3-8B-shaped model of random bf16 weights (no download).

    python scripts/bench_engine_gpu.py            # on the GPU machine (part of scripts/gpu_check.sh)
    python scripts/bench_engine_gpu.py --smoke    # tiny shapes, any device: checks the script runs

Prints batch-1 decode tokens/s against the weight-read roofline (weight bytes /
device-to-device copy bandwidth measured in the same run), then offline output
throughput at 64 and 256 concurrent sequences (fixed lengths, EOS ignored),
with the KV pool sized from free device memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import copy_bandwidth  # noqa: E402  (one definition for both GPU scripts)
from jaxpaged.engine import EngineArgs, LLMEngine  # noqa: E402
from jaxpaged.models.llama import LlamaConfig, init_params, unstack_layers  # noqa: E402
from jaxpaged.models.loader import LoadedModel  # noqa: E402
from jaxpaged.sampler import RowInfo, make_sampling_batch, sample_jit  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402
from jaxpaged.scheduler import ScheduledRequest  # noqa: E402
from jaxpaged.tokenizer import GenerationConfig  # noqa: E402

LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=8192)
SMOKE = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)


def build_engine(config: LlamaConfig, args) -> LLMEngine:
    params = init_params(config, jax.random.PRNGKey(0), jnp.bfloat16)
    loaded = LoadedModel(config=config, params=params, tokenizer=None, generation_config=GenerationConfig(),
                         source=Path("random-llama3-8b-shape"), dtype=np.dtype(jnp.bfloat16), load_seconds=0.0)
    engine_args = EngineArgs(model="random", max_model_len=args.prompt_len + args.output_len + 16,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             gpu_memory_utilization=0.85, kv_cache_memory=args.kv_cache_memory)
    return LLMEngine(engine_args, loaded=loaded)


def run(engine: LLMEngine, num_seqs: int, prompt_len: int, output_len: int, vocab: int) -> tuple[float, int]:
    rng = np.random.default_rng(num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for i in range(num_seqs):
        engine.add_request(f"{num_seqs}-{i}", {"prompt_token_ids": rng.integers(0, vocab, prompt_len).tolist()},
                           params)
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return time.perf_counter() - start, produced


def decode_rate(engine: LLMEngine, prompt_len: int, output_len: int, vocab: int) -> float:
    """Batch-1 decode tokens/s: time of output_len tokens minus that of 1 (the prefill)."""
    one, _ = run(engine, 1, prompt_len, 1, vocab)
    full, _ = run(engine, 1, prompt_len, output_len, vocab)
    return (output_len - 1) / (full - one)


def median_ms(fn, iters: int) -> float:
    """Median wall time of fn() in ms, after one untimed call."""
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


# Lets a cuBLAS gemm read a layer's weights in place from the stacked params the layer scan slices
# (scripts/bench_layer_scan.py asks whether XLA copies them otherwise).
DSF = {"xla_gpu_enable_dynamic_slice_fusion": True}


def model_variant(runner, step, iters: int, *, options: dict | None = None, params=None) -> float:
    """Median ms of the runner's forward at `step`, compiled with XLA `options` and/or run on another
    layout of the params. The pool is donated: each call's pool goes back to the runner, as in `execute`."""
    params = runner.params if params is None else params
    compiled = runner.lower(step, params).compile(compiler_options=options)

    def call():
        logits, _, runner.kv = compiled(params, runner.kv, step)
        jax.block_until_ready(logits)
    return median_ms(call, iters)


def step_breakdown(engine: LLMEngine, context: int, iters: int) -> dict[str, float]:
    """A batch-1 decode step at `context` tokens, split into its parts (ms).

    prepare: host packing of the step input; model: the jitted forward alone,
    waited for; sample: the sampler on its logits plus the copy to the host;
    engine step: the whole `LLMEngine.step` (scheduler, both device calls,
    output bookkeeping) on a live request. The direct probes' page table is
    all null page (page 0, where padding writes anyway), so they touch no page
    a request or the prefix cache owns. They read as many K/V bytes as a real
    step, but from one page that stays in cache: a slight underestimate.
    """
    runner = engine.runner
    step, entry, params = probe_step(engine, context, iters)
    out = {"prepare": median_ms(lambda: runner.prepare([entry]), iters),
           "model": median_ms(lambda: jax.block_until_ready(runner.execute(step)), iters)}
    logits = runner.execute(step)
    batch = make_sampling_batch([RowInfo(params=params, seed=0)], logits.shape[0], logits.shape[1])
    out["sample"] = median_ms(lambda: jax.device_get(sample_jit(logits, batch)), iters)
    engine.add_request("probe", {"prompt_token_ids": [1] * context}, params)
    while engine.has_unfinished_requests() and not any(  # the prefill, up to the first token
            o.outputs[0].token_ids for o in engine.step()):
        pass
    out["engine step"] = median_ms(engine.step, iters)
    engine.abort_request("probe")
    return out


def probe_step(engine: LLMEngine, context: int, iters: int):
    """(step input, its ScheduledRequest, its SamplingParams) of a batch-1 decode at `context` whose
    page table is all null page."""
    pages = (0,) * (context // engine.runner_config.page_size + 1)
    params = SamplingParams(temperature=0.0, max_tokens=iters + 8, ignore_eos=True, detokenize=False)
    entry = ScheduledRequest("probe", (1,), context, pages, True, params, context)
    return engine.runner.prepare([entry]), entry, params


def forward_variants(engine: LLMEngine, context: int, iters: int):
    """Yields (name, ms or the exception) of the batch-1 forward compiled with XLA's dynamic-slice
    fusion, then on per-layer weights (a transient copy of the layers; every layer compiled)."""
    runner = engine.runner
    step, _, _ = probe_step(engine, context, iters)
    variants = {"dynamic-slice fusion": lambda: model_variant(runner, step, iters, options=DSF),
                "per-layer weights": lambda: model_variant(runner, step, iters,
                                                           params=unstack_layers(runner.params))}
    for name, time_it in variants.items():
        try:
            yield name, time_it()
        except Exception as e:  # pylint: disable=broad-except  (an XLA without the option; memory)
            yield name, e


def show_row(name: str, value: str, note: str) -> None:
    print(f"{name:18s} {value:>22s}   {note}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)  # few shapes: short warm-up
    parser.add_argument("--kv-cache-memory", type=int, default=None)
    parser.add_argument("--concurrency", default="64,256")
    args = parser.parse_args(argv)
    if not args.smoke and jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (backend is {jax.default_backend()!r}); use --smoke elsewhere")
    config = SMOKE if args.smoke else LLAMA3_8B
    if args.smoke:
        args.prompt_len, args.output_len, args.max_num_seqs, args.max_num_batched_tokens = 16, 8, 16, 64
        args.kv_cache_memory, args.concurrency = args.kv_cache_memory or (64 << 20), "4,16"
    print(f"device: {jax.devices()[0]} | jax {jax.__version__}")
    bandwidth = copy_bandwidth(1 << (24 if args.smoke else 30), rounds=5, inner=20)
    start = time.perf_counter()
    engine = build_engine(config, args)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.model.params))
    print(f"engine ready in {time.perf_counter() - start:.1f} s; weights {weight_bytes / 2**30:.2f} GiB; "
          f"KV pool {engine.runner_config.num_pages - 1} pages; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("\n== engine on device (Llama-3-8B shape, random bf16 weights)" if not args.smoke else "\n== smoke")
    rate = decode_rate(engine, args.prompt_len, args.output_len, config.vocab_size)
    roofline = bandwidth / weight_bytes
    show_row("batch-1 decode", f"{rate:.1f} tok/s", f"roofline {roofline:.1f} tok/s ({rate / roofline:.0%})")
    for n in (int(c) for c in args.concurrency.split(",")):
        seconds, produced = run(engine, n, args.prompt_len, args.output_len, config.vocab_size)
        show_row(f"{n} concurrent", f"{produced / seconds:.0f} output tok/s",
                 f"{n} x ({args.prompt_len} in, {args.output_len} out) in {seconds:.1f} s")
    iters = 5 if args.smoke else 30
    parts = step_breakdown(engine, args.prompt_len, iters)
    show_row("batch-1 step", f"{parts['engine step']:.2f} ms",
             "; ".join(f"{k} {v:.2f} ms" for k, v in parts.items() if k != "engine step")
             + f"; weight read {1e3 * weight_bytes / bandwidth:.2f} ms")
    # Last, each printed when done: they compile the step again (per-layer weights: every layer).
    for name, ms in forward_variants(engine, args.prompt_len, iters):
        show_row("batch-1 model", f"{ms:.2f} ms" if isinstance(ms, float) else "failed",
                 f"{name} (default {parts['model']:.2f} ms)" if isinstance(ms, float)
                 else f"{name}: {type(ms).__name__}: {str(ms)[:160]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Batch-invariant mode on a GPU (docs/rl.md): are a row's bits its own, and what does the mode cost?

    python benchmarks/batch_invariant_gpu.py            # on the GPU machine (part of scripts/gpu_check.sh)
    python benchmarks/batch_invariant_gpu.py --smoke    # tiny shapes, any device (kernel in interpret mode)

Prints, from one run, ours and the baseline side by side:
  1. the weight dots of the Llama-3-8B shape (wqkv, wo, w_gate_up, w_down, the LM head) in bf16 at 1, 64 and 2048
     rows: the fixed-tile GEMM (pallas_kernels/batch_invariant_matmul.py) against XLA's dot, ms each and the ratio;
     and whether row 0's bits are the same computed alone as in the 64-row product, for both;
  2. the engine on a random bf16 model of the Llama-3.2-1B shape, batch_invariant=True and the default, one after
     the other: a greedy request's tokens and sampled log-probs alone and beside 63 others, equal bits or not; and
     64 concurrent requests' output tokens/s, the mode's cost.
Random weights: no download. --json appends one JSON object per row.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxpaged.config import EngineArgs  # noqa: E402
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.models.llama import LlamaConfig, init_params  # noqa: E402
from jaxpaged.models.loader import LoadedModel  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402
from jaxpaged.tokenizer import GenerationConfig  # noqa: E402
from pallas_kernels.batch_invariant_matmul import batch_invariant_matmul  # noqa: E402

# (name, K, N, transpose_w): the Llama-3-8B weight dots as the engine holds them on a GPU
DOTS_8B = (("wqkv", 4096, 6144, False), ("wo", 4096, 4096, False), ("w_gate_up", 4096, 28672, False),
           ("w_down", 14336, 4096, False), ("lm_head", 4096, 128256, False))
DOTS_SMOKE = (("wqkv", 128, 256, False), ("w_down", 200, 128, False), ("tied_head", 128, 500, True))
LLAMA32_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=500000.0, max_position_embeddings=4096, tie_word_embeddings=True)
SMOKE = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)


def emit(path: str | None, name: str, line: str, **data) -> None:
    print(f"{name:34s} {line}", flush=True)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"name": name, **data}) + "\n")


def timed_ms(fn, *args, iters: int) -> float:
    """Median wall ms of fn(*args) (compiled first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def same_bits(a, b) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def dots(args) -> None:
    """Part 1: each weight dot at 1, 64 and 2048 rows, ours vs XLA's; row 0 alone vs in 64 rows."""
    interpret = jax.default_backend() != "gpu"
    dtype = jnp.float32 if interpret else jnp.bfloat16
    rows = (1, 8, 64) if args.smoke else (1, 64, 2048)
    for name, k, n, transpose_w in DOTS_SMOKE if args.smoke else DOTS_8B:
        key = jax.random.PRNGKey(k + n)
        w = (jax.random.normal(key, (n, k) if transpose_w else (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
        ours = jax.jit(functools.partial(batch_invariant_matmul, transpose_w=transpose_w, interpret=interpret))
        xla = jax.jit(lambda x, w, t=transpose_w: x @ (w.T if t else w))
        for m in rows:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(dtype)
            a, b = timed_ms(ours, x, w, iters=args.iters), timed_ms(xla, x, w, iters=args.iters)
            emit(args.json, f"dot {name} M={m}", f"ours {a:8.3f} ms  xla {b:8.3f} ms  ours/xla x{a / b:5.2f}",
                 part="dot", dot=name, m=m, ours_ms=a, xla_ms=b)
        x = jax.random.normal(jax.random.PRNGKey(7), (64, k), jnp.float32).astype(dtype)
        alone = {f: same_bits(fn(x[:1], w)[0], fn(x, w)[0]) for f, fn in (("ours", ours), ("xla", xla))}
        emit(args.json, f"dot {name} row 0 alone == in 64", f"ours {alone['ours']}  xla {alone['xla']}",
             part="dot_bits", dot=name, ours_equal=alone["ours"], xla_equal=alone["xla"])


def random_model(config: LlamaConfig, dtype) -> LoadedModel:
    params = init_params(config, jax.random.PRNGKey(0), dtype)
    return LoadedModel(config=config, params=params, tokenizer=None, generation_config=GenerationConfig(),
                       source=Path("random"), dtype=np.dtype(dtype), load_seconds=0.0)


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, logprobs: bool) -> tuple[dict, float]:
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


def engine_rows(args) -> None:
    """Part 2: per mode, a request alone vs beside 63 others (bits), and 64 concurrent requests' tokens/s."""
    on_gpu = jax.default_backend() == "gpu"
    config = SMOKE if args.smoke else LLAMA32_1B
    dtype = jnp.bfloat16 if on_gpu else jnp.float32   # the CPU's mode needs float32 (its native kernels)
    loaded = random_model(config, dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, int(rng.integers(8, args.prompt_len))).tolist()
               for _ in range(args.concurrency)]
    rates = {}
    for invariant in (True, False):
        label = "batch-invariant" if invariant else "default"
        engine = LLMEngine(EngineArgs(model="random", dtype="bfloat16" if on_gpu else "float32",
                                      max_model_len=args.prompt_len + args.output_len + 16,
                                      max_num_seqs=args.concurrency, max_num_batched_tokens=args.batched_tokens,
                                      batch_invariant=invariant, enable_prefix_caching=False), loaded=loaded)
        alone, _ = generate(engine, prompts[:1], args.output_len, logprobs=True)
        together, _ = generate(engine, prompts, args.output_len, logprobs=True)
        equal = alone[0][0] == together[0][0] and same_bits(alone[0][1], together[0][1])
        emit(args.json, f"engine {label}: alone == beside {len(prompts) - 1}",
             f"{'EQUAL BITS' if equal else 'DIFFER'} (tokens {alone[0][0] == together[0][0]})",
             part="engine_bits", mode=label, equal=equal, others=len(prompts) - 1)
        _, seconds = generate(engine, prompts, args.output_len, logprobs=False)
        rates[label] = args.concurrency * args.output_len / seconds
        emit(args.json, f"engine {label}: {args.concurrency} concurrent", f"{rates[label]:9.1f} out tok/s",
             part="engine_rate", mode=label, out_tok_s=rates[label])
        del engine
    ratio = rates["default"] / rates["batch-invariant"]
    emit(args.json, "engine batch-invariant cost", f"default / batch-invariant x{ratio:.2f}", part="engine_cost",
         ratio=ratio, concurrency=args.concurrency)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    dots(args)
    if not args.skip_engine:
        engine_rows(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

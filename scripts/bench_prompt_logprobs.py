"""Prompt log-probabilities: their cost next to the plain path, in one run (same engine, same load).

Prints the warm-up split (step shapes vs the extra prompt_logprobs_step shapes) and the median time of a
request of --prompt-len tokens and one output token, without and with prompt_logprobs=5.

    python scripts/bench_prompt_logprobs.py [--model smollm2-135m-instruct] [--prompt-len 400] [--iters 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from jaxpaged.sample import sampler
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.worker.step_input import empty_step
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


def run_once(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, warmup=False, enable_prefix_caching=False,
                                  compilation_cache_dir=None))
    runner = engine.runner
    start = time.perf_counter()
    for t, s, pages in runner.config.buckets:
        jax.block_until_ready(runner._run(empty_step(t, s, pages)))
    steps = time.perf_counter() - start
    start = time.perf_counter()
    for lowered in runner.lower_prompt_logprobs():
        lowered.compile()
    extra = time.perf_counter() - start
    for s in runner.config.seq_buckets:  # the sampler's parts (lower_sampler would lower the above again)
        sampler.warmup(s, runner.model_config.vocab_size)
    print(f"{args.model} on {jax.default_backend()}: warm-up of {len(runner.config.buckets)} step shapes "
          f"{steps:.1f} s; prompt_logprobs_step at {len({t for t, _, _ in runner.config.buckets})} T buckets "
          f"+{extra:.1f} s")
    prompt = [(i * 7919) % 1000 + 100 for i in range(args.prompt_len)]
    plain = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
    asks = SamplingParams(max_tokens=1, prompt_logprobs=5, output_kind=RequestOutputKind.FINAL_ONLY)
    times = {"plain": [], "prompt_logprobs=5": []}
    for i in range(args.iters):  # interleaved, so load drifts hit both sides
        times["plain"].append(run_once(engine, f"a{i}", prompt, plain))
        times["prompt_logprobs=5"].append(run_once(engine, f"b{i}", prompt, asks))
    for name, values in times.items():
        print(f"{args.prompt_len}-token prompt, 1 output token, {name:>18}: "
              f"median {statistics.median(values) * 1e3:.0f} ms over {args.iters}")


if __name__ == "__main__":
    main()

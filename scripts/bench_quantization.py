"""Weight-only int8 against float32 on CPU, in one run: what it costs in quality, what it gains in speed.

    python scripts/bench_quantization.py                       # the documented run
    python scripts/bench_quantization.py --batch-sizes 1,32 --max-tokens 64 --rounds 3

Two engines over the same weights (SmolLM2-135M-Instruct dequantised to float32 from its Q4_1 GGUF): one as
loaded, one with quantization="int8" (the weight dots' weights as int8 with a float32 scale per
output column and run of 32 rows, computed in float32 by the native CPU matmul).

Quality, over benchmark_latency.py's prompts (grounded, open, grounded-more: 32 chats), teacher-forced: each
engine scores every prompt token (prompt_logprobs=1): each side's perplexity, how often the two sides' most
likely next tokens agree, and the mean |difference| of the log-probabilities they give the actual token.
Then each prompt's greedy answer (--max-tokens, EOS allowed) on both: how many are identical, and the mean
length of their common prefix.

Speed: for each batch size B (--batch-sizes), B of those chats at once decoding --max-tokens tokens each
(ignore_eos, greedy) on each engine in turn, the side that goes first alternating over --rounds rounds:
output tok/s per round, the medians and int8 / float32. At batch 1 a decode step reads every weight once
per token, so int8 reads a quarter of the bytes; at 32 rows the step is bound by the FMAs, which int8 does
not cut (its values are widened to float32 in registers).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmark_latency import GROUNDED, GROUNDED_MORE, OPEN, chat_ids  # noqa: E402 (scripts/, beside this one)

SIDES = ("float32", "int8")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes for the speed rounds")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (speed and greedy answers)")
    p.add_argument("--rounds", type=int, default=4, help="speed rounds per batch size (first side alternates)")
    return p.parse_args(argv)


def make_engines(model: str) -> dict:
    """The two sides, each an `LLM` (the model loads from jaxpaged's model cache after the first)."""
    from jaxpaged import LLM

    base = dict(dtype="float32", max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512,
                kv_cache_memory=256 << 20)
    return {"float32": LLM(model, **base), "int8": LLM(model, quantization="int8", **base)}


def run(llm, prompts: list[list[int]], params) -> tuple[float, list]:
    """All prompts at once, to the end: wall seconds and the outputs in prompt order."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def quality(engines: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    from jaxpaged.sampling_params import SamplingParams

    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = {side: run(engine, prompts, score)[1] for side, engine in engines.items()}
    nll = {side: [] for side in SIDES}
    agree, diffs = 0, []
    for i, prompt in enumerate(prompts):
        for pos in range(1, len(prompt)):  # entry 0 is None: nothing predicts the first token
            entries = {side: scored[side][i].prompt_logprobs[pos] for side in SIDES}
            actual = {side: entries[side][prompt[pos]].logprob for side in SIDES}
            top = {side: next(t for t, lp in entries[side].items() if lp.rank == 1) for side in SIDES}
            for side in SIDES:
                nll[side].append(-actual[side])
            agree += top["float32"] == top["int8"]
            diffs.append(abs(actual["float32"] - actual["int8"]))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    answers = {side: [o.outputs[0].token_ids for o in run(engine, prompts, greedy)[1]]
               for side, engine in engines.items()}
    prefixes = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                for x, y in zip(answers["float32"], answers["int8"])]
    return {"tokens_scored": len(diffs), "perplexity": {side: math.exp(float(np.mean(nll[side]))) for side in SIDES},
            "top1_agreement": agree / len(diffs), "mean_abs_logprob_diff": float(np.mean(diffs)),
            "identical_answers": sum(x == y for x, y in zip(answers["float32"], answers["int8"])),
            "answers": len(prompts), "mean_common_prefix": float(np.mean(prefixes)),
            "mean_answer_tokens": float(np.mean([len(a) for a in answers["float32"]]))}


def speed(engines: dict, prompts: list[list[int]], batch: int, max_tokens: int, rounds: int) -> dict:
    from jaxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    chosen = [prompts[i % len(prompts)] for i in range(batch)]
    for engine in engines.values():  # untimed: each step shape's first run costs extra
        run(engine, chosen, dataclasses.replace(params, max_tokens=8))
    rates = {side: [] for side in SIDES}
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            seconds, _ = run(engines[side], chosen, params)
            rates[side].append(batch * max_tokens / seconds)
    medians = {side: statistics.median(v) for side, v in rates.items()}
    return {"batch": batch, "rates": rates, "median": medians, "ratio": medians["int8"] / medians["float32"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    engines = make_engines(args.model)
    prompts = chat_ids(engines["float32"].get_tokenizer(), GROUNDED + OPEN + GROUNDED_MORE)
    q = quality(engines, prompts, args.max_tokens)
    print(f"## quality: {len(prompts)} chats, {q['tokens_scored']} prompt tokens scored\n")
    print("| | float32 | int8 |\n|---|---:|---:|")
    print(f"| perplexity (prompt tokens) | {q['perplexity']['float32']:.3f} | {q['perplexity']['int8']:.3f} |")
    print(f"\ntop-1 next-token agreement {100 * q['top1_agreement']:.2f}%, mean |logprob difference| of the actual "
          f"token {q['mean_abs_logprob_diff']:.4f}; greedy answers (up to {args.max_tokens} tokens, mean "
          f"{q['mean_answer_tokens']:.0f}): {q['identical_answers']}/{q['answers']} identical, mean common prefix "
          f"{q['mean_common_prefix']:.1f} tokens\n", flush=True)
    print(f"## speed: output tok/s, {args.max_tokens} tokens a request, greedy, {args.rounds} rounds\n")
    print("| batch | float32 (rounds) | int8 (rounds) | float32 median | int8 median | int8 / float32 |")
    print("|---:|---|---|---:|---:|---:|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        s = speed(engines, prompts, batch, args.max_tokens, args.rounds)
        rounds = {side: " ".join(f"{v:.1f}" for v in s["rates"][side]) for side in SIDES}
        print(f"| {batch} | {rounds['float32']} | {rounds['int8']} | {s['median']['float32']:.1f} "
              f"| {s['median']['int8']:.1f} | **{s['ratio']:.2f}x** |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

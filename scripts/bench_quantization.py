"""int8 weights (weight-only, and W8A8) against float32 on CPU, in one run: what each costs in quality, what
it gains in speed.

    python scripts/bench_quantization.py                       # the documented run
    python scripts/bench_quantization.py --batch-sizes 1,32 --max-tokens 64 --rounds 3 --quantizations w8a8

Engines over the same weights (SmolLM2-135M-Instruct dequantised to float32 from its Q4_1 GGUF): one as
loaded, and one per --quantizations entry: "int8" (the weight dots' weights as int8 with a float32 scale per
output column and run of 32 rows, computed in float32 by the native CPU matmul) and "w8a8" (the same weights,
each dot's x quantised too per row and run of 32 values: integer dots, on AVX-512 VNNI where the CPU has it).

Quality, over benchmark_latency.py's prompts (grounded, open, grounded-more: 32 chats), teacher-forced: each
engine scores every prompt token (prompt_logprobs=1): each side's perplexity, how often each quantised side's
most likely next token agrees with float32's, and the mean |difference| of the log-probabilities they give the
actual token. Then each prompt's greedy answer (--max-tokens, EOS allowed) on every side: how many equal
float32's, and the mean length of their common prefix.

Speed: for each batch size B (--batch-sizes), B of those chats at once decoding --max-tokens tokens each
(ignore_eos, greedy) on each engine in turn, the side that goes first rotating over --rounds rounds: output
tok/s per round, the medians and each side / float32. At batch 1 a decode step reads every weight once per
token, so int8 reads a quarter of the bytes; at 8-32 rows the step is bound by the multiply-adds, which
weight-only int8 does not cut (its values are widened to float32 in registers) and W8A8's VNNI dots do.
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
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from latency import GROUNDED, GROUNDED_MORE, OPEN, chat_ids  # noqa: E402

BASE = "float32"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantizations", default="int8,w8a8", help="comma-separated quantised sides (int8, w8a8)")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes for the speed rounds")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (speed and greedy answers)")
    p.add_argument("--rounds", type=int, default=4, help="speed rounds per batch size (first side rotates)")
    return p.parse_args(argv)


def make_engines(model: str, quantizations: list[str]) -> dict:
    """float32 and each quantised side, each an `LLM` (the model loads from jaxpaged's model cache after the first)."""
    from jaxpaged import LLM

    base = dict(dtype="float32", max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512,
                kv_cache_memory=256 << 20)
    return {BASE: LLM(model, **base), **{q: LLM(model, quantization=q, **base) for q in quantizations}}


def run(llm, prompts: list[list[int]], params) -> tuple[float, list]:
    """All prompts at once, to the end: wall seconds and the outputs in prompt order."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def quality(engines: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    """Per side: perplexity; per quantised side, against float32: top-1 agreement, mean |logprob difference|,
    identical greedy answers and their mean common prefix."""
    from jaxpaged.sampling_params import SamplingParams

    sides = list(engines)
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = {side: run(engine, prompts, score)[1] for side, engine in engines.items()}
    nll = {side: [] for side in sides}
    agree = {side: 0 for side in sides[1:]}
    diffs = {side: [] for side in sides[1:]}
    for i, prompt in enumerate(prompts):
        for pos in range(1, len(prompt)):  # entry 0 is None: nothing predicts the first token
            entries = {side: scored[side][i].prompt_logprobs[pos] for side in sides}
            actual = {side: entries[side][prompt[pos]].logprob for side in sides}
            top = {side: next(t for t, lp in entries[side].items() if lp.rank == 1) for side in sides}
            for side in sides:
                nll[side].append(-actual[side])
            for side in sides[1:]:
                agree[side] += top[BASE] == top[side]
                diffs[side].append(abs(actual[BASE] - actual[side]))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    answers = {side: [o.outputs[0].token_ids for o in run(engine, prompts, greedy)[1]]
               for side, engine in engines.items()}
    out = {"tokens_scored": len(diffs[sides[1]]) if len(sides) > 1 else 0, "answers": len(prompts),
           "mean_answer_tokens": float(np.mean([len(a) for a in answers[BASE]])),
           "perplexity": {side: math.exp(float(np.mean(nll[side]))) for side in sides}}
    for side in sides[1:]:
        prefixes = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                    for x, y in zip(answers[BASE], answers[side])]
        out[side] = {"top1_agreement": agree[side] / len(diffs[side]),
                     "mean_abs_logprob_diff": float(np.mean(diffs[side])),
                     "identical_answers": sum(x == y for x, y in zip(answers[BASE], answers[side])),
                     "mean_common_prefix": float(np.mean(prefixes))}
    return out


def speed(engines: dict, prompts: list[list[int]], batch: int, max_tokens: int, rounds: int) -> dict:
    from jaxpaged.sampling_params import SamplingParams

    sides = list(engines)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    chosen = [prompts[i % len(prompts)] for i in range(batch)]
    for engine in engines.values():  # untimed: each step shape's first run costs extra
        run(engine, chosen, dataclasses.replace(params, max_tokens=8))
    rates = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            seconds, _ = run(engines[side], chosen, params)
            rates[side].append(batch * max_tokens / seconds)
    medians = {side: statistics.median(v) for side, v in rates.items()}
    return {"batch": batch, "rates": rates, "median": medians,
            "ratio": {side: medians[side] / medians[BASE] for side in sides[1:]}}


def main(argv=None) -> int:
    args = parse_args(argv)
    quantizations = [q for q in args.quantizations.split(",") if q]
    engines = make_engines(args.model, quantizations)
    sides = list(engines)
    prompts = chat_ids(engines[BASE].get_tokenizer(), GROUNDED + OPEN + GROUNDED_MORE)
    q = quality(engines, prompts, args.max_tokens)
    print(f"## quality: {len(prompts)} chats, {q['tokens_scored']} prompt tokens scored, greedy answers up to "
          f"{args.max_tokens} tokens (float32's mean {q['mean_answer_tokens']:.0f})\n")
    print("| | " + " | ".join(sides) + " |\n|---|" + "---:|" * len(sides))
    print("| perplexity (prompt tokens) | " + " | ".join(f"{q['perplexity'][s]:.3f}" for s in sides) + " |")
    rows = [("top-1 next-token agreement with float32", lambda m: f"{100 * m['top1_agreement']:.2f}%"),
            ("mean abs logprob difference of the actual token", lambda m: f"{m['mean_abs_logprob_diff']:.4f}"),
            ("greedy answers identical to float32's", lambda m: f"{m['identical_answers']}/{q['answers']}"),
            ("mean common prefix with float32's (tokens)", lambda m: f"{m['mean_common_prefix']:.1f}")]
    for label, fmt in rows:
        print(f"| {label} | | " + " | ".join(fmt(q[s]) for s in sides[1:]) + " |")
    print(f"\n## speed: output tok/s, {args.max_tokens} tokens a request, greedy, {args.rounds} rounds\n", flush=True)
    print("| batch | " + " | ".join(f"{s} (rounds)" for s in sides) + " | " + " | ".join(f"{s} median" for s in sides)
          + " | " + " | ".join(f"{s} / float32" for s in sides[1:]) + " |")
    print("|---:|" + "---|" * len(sides) + "---:|" * (2 * len(sides) - 1))
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        r = speed(engines, prompts, batch, args.max_tokens, args.rounds)
        print(f"| {batch} | " + " | ".join(" ".join(f"{v:.1f}" for v in r["rates"][s]) for s in sides) + " | "
              + " | ".join(f"{r['median'][s]:.1f}" for s in sides) + " | "
              + " | ".join(f"**{r['ratio'][s]:.2f}x**" for s in sides[1:]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

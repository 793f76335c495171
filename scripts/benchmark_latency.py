"""Batch-1 latency with and without n-gram speculative decoding (like `vllm bench latency`), in one run.

    python scripts/benchmark_latency.py                                  # the documented run
    python scripts/benchmark_latency.py --num-speculative-tokens 4 --max-tokens 64

Two engines over the same weights (float32, loaded once): one plain, one with
speculative_config={"method": "ngram", ...}. Each prompt is run alone (batch 1), greedy, end to end
(add_request to the finished output), on both engines in turn, so load on a shared machine hits both
sides alike, after an untimed pass over the workload on both (--warmup-passes). Two workloads of SmolLM2-135M-Instruct chat prompts:

  grounded  answers that copy spans of the prompt: rewrite, fix, extract, edit code
  open      nothing to copy: open questions and stories

Per workload: output tok/s of each side, their ratio, mean latency, the acceptance rate (accepted /
drafted tokens) and mean tokens per verification step; the two sides' outputs must be identical
(greedy decoding is exact under speculation), and the script says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

GROUNDED = [
    "Fix the spelling mistakes in this text and write out the corrected text:\n\n"
    "The quick brown fox jumpd over the lazy dog. The dog was not amused, and it barkd loudly at the fox, "
    "wich ran away into the forrest. Later that day, the fox came back with its freinds.",
    "Rename the function `add` to `add_numbers` everywhere in this Python code. Output the full code.\n\n"
    "```python\ndef add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\n"
    "def total(values):\n    result = 0\n    for value in values:\n        result = add(result, value)\n"
    "    return result\n\n\nprint(total([1, 2, 3, 4]))\n```",
    "Copy the following paragraph exactly, word for word:\n\n"
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts.",
    "Rewrite this list as a numbered list, keeping every item exactly as written:\n\n"
    "- two cups of flour\n- one teaspoon of baking soda\n- half a cup of sugar\n- two large eggs\n"
    "- one cup of milk\n- a pinch of salt",
    "Convert this Python function to use a list comprehension. Keep the name and the docstring.\n\n"
    "```python\ndef squares(numbers):\n    \"\"\"Return the squares of the even numbers.\"\"\"\n"
    "    result = []\n    for n in numbers:\n        if n % 2 == 0:\n            result.append(n * n)\n"
    "    return result\n```",
    "Extract the sentences that mention Paris from this text and write them out unchanged:\n\n"
    "Anna moved to Paris in 2015 to study art. Her brother stayed in Berlin. In Paris she met Louis, a "
    "painter from Lyon. They opened a small gallery near the Seine in Paris in 2019.",
]

OPEN = [
    "Write a short story about a dragon who is afraid of the dark.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Describe a sunset at the beach to someone who has never seen one.",
    "Give me some ideas for a birthday party for a ten year old.",
    "Why do leaves change colour in autumn?",
    "Invent a new board game and explain its rules.",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    # 1 + 7 = a T bucket (8). Grounded workload on the Intel dev machine, one run each: k = 3 1.59x, 5 1.56x,
    # 7 1.70x, 12 1.68x (7 with prompt_lookup_min 1: 1.57x)
    p.add_argument("--num-speculative-tokens", type=int, default=7)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="runs of each prompt on each side")
    p.add_argument("--warmup-passes", type=int, default=1,
                   help="untimed passes over each workload first (like vllm bench latency's warm-up iterations): "
                        "the first run of a step shape costs up to ~0.3 s more, which would go to whichever side "
                        "meets that shape first")
    p.add_argument("--workloads", default="grounded,open")
    p.add_argument("--json", action="store_true", help="print one JSON object per workload as well")
    p.add_argument("--show", action="store_true", help="print each output's text")
    return p.parse_args(argv)


def make_engines(args):
    from jaxpaged.engine import EngineArgs, LLMEngine
    from jaxpaged.models.loader import load_model

    loaded = load_model(args.model, dtype="float32")
    base = EngineArgs(model=args.model, dtype="float32", max_model_len=1024, max_num_seqs=4,
                      max_num_batched_tokens=512, kv_cache_memory=128 << 20)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    plain = LLMEngine(base, loaded=loaded)
    speculative = LLMEngine(dataclasses.replace(base, speculative_config=spec), loaded=loaded)
    return loaded.tokenizer, plain, speculative


def run_one(engine, prompt_ids, max_tokens) -> tuple[float, list[int]]:
    from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY)
    start = time.perf_counter()
    engine.add_request("r", {"prompt_token_ids": prompt_ids}, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return time.perf_counter() - start, list(out.outputs[0].token_ids)


def spec_counters(engine) -> tuple[int, int, int]:
    s = engine.stats()
    return s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def run_workload(name, prompts, tokenizer, plain, speculative, args) -> dict:
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True) for p in prompts]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ids]
    times = {"plain": 0.0, "spec": 0.0}
    produced = {"plain": 0, "spec": 0}
    latencies = {"plain": [], "spec": []}
    identical = True
    for _ in range(args.warmup_passes):  # untimed: each step shape's first run costs extra, on either side
        for prompt in ids:
            for engine in (plain, speculative):
                run_one(engine, prompt, args.max_tokens)
    before = spec_counters(speculative)
    for prompt in ids:
        for _ in range(args.repeats):
            outputs = {}
            for side, engine in (("plain", plain), ("spec", speculative)):
                seconds, outputs[side] = run_one(engine, prompt, args.max_tokens)
                times[side] += seconds
                produced[side] += len(outputs[side])
                latencies[side].append(seconds)
            identical &= outputs["plain"] == outputs["spec"]
            if args.show:
                print(f"--- {name}: {tokenizer.decode(outputs['spec'])!r}", flush=True)
    drafts, drafted, accepted = (b - a for a, b in zip(before, spec_counters(speculative)))
    tok_s = {side: produced[side] / times[side] for side in times}
    return {"workload": name, "prompts": len(ids), "repeats": args.repeats, "output_tokens": produced["plain"],
            "plain_tok_s": tok_s["plain"], "spec_tok_s": tok_s["spec"], "ratio": tok_s["spec"] / tok_s["plain"],
            "plain_mean_latency_s": sum(latencies["plain"]) / len(latencies["plain"]),
            "spec_mean_latency_s": sum(latencies["spec"]) / len(latencies["spec"]),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_per_draft": accepted / drafts if drafts else 0.0,
            "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted, "outputs_identical": identical}


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    tokenizer, plain, speculative = make_engines(args)
    print(f"engines ready in {time.perf_counter() - start:.0f} s; speculative_config "
          f"{speculative.args.speculative_config}", flush=True)
    warm = tokenizer("Hello, how are you?")["input_ids"]
    for engine in (plain, speculative):  # first-request effects out of the timed runs
        run_one(engine, warm, 8)
    workloads = {"grounded": GROUNDED, "open": OPEN}
    results = [run_workload(name, workloads[name], tokenizer, plain, speculative, args)
               for name in args.workloads.split(",")]
    print(f"\nbatch 1, greedy, max_tokens {args.max_tokens}, k = {args.num_speculative_tokens}, "
          f"prompt_lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}")
    print(f"{'workload':<10}{'tokens':>8}{'plain tok/s':>13}{'spec tok/s':>12}{'ratio':>8}"
          f"{'plain lat s':>13}{'spec lat s':>12}{'accept':>8}{'tok/draft':>11}{'same':>6}")
    for r in results:
        print(f"{r['workload']:<10}{r['output_tokens']:>8}{r['plain_tok_s']:>13.1f}{r['spec_tok_s']:>12.1f}"
              f"{r['ratio']:>7.2f}x{r['plain_mean_latency_s']:>13.2f}{r['spec_mean_latency_s']:>12.2f}"
              f"{r['acceptance_rate']:>8.2f}{r['mean_accepted_per_draft']:>11.2f}{str(r['outputs_identical']):>6}")
    if args.json:
        for r in results:
            print(json.dumps(r))
    return 0 if all(r["outputs_identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

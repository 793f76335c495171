"""Batch-1 latency with and without n-gram speculative decoding (like `vllm bench latency`), in one run.

    python benchmarks/latency.py                                  # the documented run
    python benchmarks/latency.py --num-speculative-tokens 4 --max-tokens 64

Two engines over the same weights (float32, loaded once): one plain, one with
speculative_config={"method": "ngram", ...}. Each prompt is run alone (batch 1), greedy unless
--temperature says otherwise, end to end (add_request to the finished output), on both engines in
turn (each side first for every other prompt), so load on a shared machine and whatever one run
leaves in the caches hit both sides alike, after an untimed pass over the workload on both
(--warmup-passes). Workloads of SmolLM2-135M-Instruct chat prompts:

  grounded       answers that copy spans of the prompt: rewrite, fix, extract, edit code
  open           nothing to copy: open questions and stories
  grounded-more  20 more of the first kind (formats, code edits, extraction, a template, a poem;
                 written after k and the lookup bounds were tuned on `grounded`): a wider check than 6 prompts
                 (not run by default: ~3 min more)
  grounded-long  6 more with longer sources (164-364 prompt tokens: a 45-line Python file to edit, a
                 story to correct or rewrite, notes to tabulate, quotes from a document; not run
                 by default; try --max-tokens 256)
  extract-json   6 extractions (a listing, an invoice, a biography, meeting notes, an address, a recipe),
                 each answer constrained to its JSON schema (structured outputs, llguidance) on every
                 side: drafts the grammar forbids are cut, each verified position gets its own mask
                 (not run by default)

The built-in prompts are in benchmarks/prompts/workloads.json.

--prompts-file PATH adds a workload of your own: a JSON list of prompt strings, named by the
file's stem (`--prompts-file my_edits.json --workloads my_edits`).

--mixed-batch N adds one batch of N requests sent at once, half grounded-more prompts, half open
ones (each list cycled), on a plain and a speculating engine of max_num_seqs N: whether the
requests with little to copy are slowed when others in their batch verify drafts (per class: mean
time to first token, time per output token after it (mean, and the largest of one request), mean
latency; and the batch's output tok/s).
--disable-by-batch-size M passes vLLM's `disable_by_batch_size` (no drafts while more than M
requests are enqueued) to the speculating engines.
--draft-length fixed|adaptive|both: the speculating engine verifies every draft the proposer finds
(fixed, vLLM's behaviour), or only those expected to pay for their rows (adaptive, the engine's
default: spec_decode.DraftLengthPolicy), or both engines run beside the plain one, interleaved, so
the two are compared in the same run (the plain engine's tokens are the ratios' base for each).

--temperature T samples instead (OpenAI's default for a request that names none is 1.0), each request
seeded (--seed S: prompt i's request gets seed S + i on every side): speculation keys each position's
sample as decoding without it would, so seeded outputs are identical too, and the acceptance rate shows
what sampling costs the drafts.

Per workload: output tok/s of each side, their ratio, mean latency, the acceptance rate (accepted /
drafted tokens) and mean tokens per verification step; the two sides' outputs must be identical
(greedy and seeded decoding are exact under speculation), and the script says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

# The built-in workloads' prompts (and extract-json's schemas), described in the docstring above.
_BUILT_IN = json.loads((pathlib.Path(__file__).resolve().parent / "prompts" / "workloads.json").read_text())
GROUNDED, OPEN, GROUNDED_MORE, GROUNDED_LONG = (_BUILT_IN[k] for k in ("grounded", "open", "grounded-more",
                                                                       "grounded-long"))
WORKLOADS = {"grounded": GROUNDED, "open": OPEN, "grounded-more": GROUNDED_MORE, "grounded-long": GROUNDED_LONG,
             "extract-json": [item["prompt"] for item in _BUILT_IN["extract-json"]]}
SCHEMAS = {"extract-json": [item["schema"] for item in _BUILT_IN["extract-json"]]}  # a workload's schema per prompt


def named_or_file_prompts(path: str) -> list[str]:
    """A built-in workload's prompts by name, else the file's (serve.py bench's `--dataset prompts`)."""
    if pathlib.Path(path).exists():
        return read_prompts(path)
    if path not in WORKLOADS:
        raise ValueError(f"no such file, nor a benchmarks/latency.py workload ({', '.join(WORKLOADS)})")
    return WORKLOADS[path]


def read_prompts(path: str) -> list[str]:
    """The file's prompts: a JSON list of non-empty strings; anything else is a ValueError."""
    try:
        prompts = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read a JSON list of prompts ({err})") from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(x, str) and x for x in prompts):
        raise ValueError("expected a JSON list of non-empty prompt strings")
    return prompts


def load_prompts_file(path: str) -> tuple[str, list[str]]:
    """(the file's stem, its prompts) for --prompts-file (see `read_prompts`); a ValueError names the flag."""
    file = pathlib.Path(path)
    try:
        prompts = read_prompts(path)
    except ValueError as err:
        raise ValueError(f"--prompts-file {path}: {err}") from None
    if file.stem in WORKLOADS:
        raise ValueError(f"--prompts-file {path}: {file.stem!r} names a built-in workload; rename the file")
    return file.stem, prompts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    # 1 + 7 = a T bucket (8). Grounded workload on the Intel dev machine, one run each: k = 3 1.59x, 5 1.56x,
    # 7 1.70x, 12 1.68x (7 with prompt_lookup_min 1: 1.57x)
    p.add_argument("--num-speculative-tokens", type=int, default=7)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: seeded sampling")
    p.add_argument("--seed", type=int, default=0, help="with --temperature: prompt i's requests get seed S + i")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, on every request (every side)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, on every request (every side)")
    p.add_argument("--quantization", default=None, choices=("int8", "w8a8"),
                   help="both engines' weight dots as int8 (weight-only, or W8A8; EngineArgs.quantization)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each prompt on each side")
    p.add_argument("--warmup-passes", type=int, default=1,
                   help="untimed passes over each workload first (like vllm bench latency's warm-up iterations): "
                        "the first run of a step shape costs up to ~0.3 s more, which would go to whichever side "
                        "meets that shape first")
    p.add_argument("--workloads", default="grounded,open", help=f"comma-separated: {', '.join(WORKLOADS)}, "
                   "or a --prompts-file's stem")
    p.add_argument("--prompts-file", action="append", default=[], metavar="PATH",
                   help="a workload of your own: a JSON list of prompts, named by the file's stem (repeatable)")
    p.add_argument("--mixed-batch", type=int, default=0, metavar="N",
                   help="also run N requests at once, half grounded-more, half open, with and without speculation")
    p.add_argument("--disable-by-batch-size", type=int, default=None, metavar="M",
                   help="speculative_config's disable_by_batch_size: no drafts while more than M requests are enqueued")
    p.add_argument("--draft-length", default="adaptive", choices=("adaptive", "fixed", "both"),
                   help="speculative_config's adaptive_draft_length (adaptive: on), or both side by side")
    p.add_argument("--overlap-verification", action=argparse.BooleanOptionalAction, default=None,
                   help="greedy verification steps overlap the next step (EngineArgs.overlap_verification; "
                        "default: the engine's, off on CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object per workload as well")
    p.add_argument("--show", action="store_true", help="print each output's text")
    args = p.parse_args(argv)
    args.prompts = dict(WORKLOADS)
    try:
        args.prompts.update(load_prompts_file(path) for path in args.prompts_file)
    except ValueError as err:
        p.error(str(err))
    args.workload_names = [name for name in args.workloads.split(",") if name]  # '': the mixed batch only
    unknown = [name for name in args.workload_names if name not in args.prompts]
    if unknown:
        p.error(f"unknown workloads {unknown}; known: {sorted(args.prompts)}")
    if not args.workload_names and not args.mixed_batch:
        p.error("nothing to run: give --workloads, --mixed-batch or both")
    if args.temperature < 0 or args.seed < 0:
        p.error(f"--temperature {args.temperature} / --seed {args.seed}: both must be >= 0")
    if args.mixed_batch == 1 or args.mixed_batch < 0:
        p.error(f"--mixed-batch {args.mixed_batch}: a batch needs at least 2 requests (0: no mixed batch)")
    args.spec_sides = ("adaptive", "fixed") if args.draft_length == "both" else (args.draft_length,)
    try:
        args.speculative_configs = {side: spec_config(args, side == "adaptive") for side in args.spec_sides}
    except ValueError as err:
        p.error(str(err))
    args.speculative_config = args.speculative_configs[args.spec_sides[0]]
    return args


def spec_config(args, adaptive: bool = True):
    from jaxpaged.spec_decode.ngram import SpeculativeConfig

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min,
            "adaptive_draft_length": adaptive}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    return SpeculativeConfig.from_dict(spec)  # a bad value: ValueError, before any model loads


def make_engines(args, loaded, max_num_seqs: int = 4) -> dict:
    """{"plain": engine, then one speculating engine per --draft-length side} over the same loaded weights."""
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine

    base = EngineArgs(model=args.model, dtype="float32", max_model_len=1024, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=512, kv_cache_memory=(32 << 20) * max_num_seqs,
                      quantization=args.quantization)
    engines = {"plain": LLMEngine(base, loaded=loaded)}
    for side, config in args.speculative_configs.items():
        engines[side] = LLMEngine(dataclasses.replace(base, speculative_config=config,
                                                      overlap_verification=args.overlap_verification), loaded=loaded)
    return engines


def turns(engines: dict, i: int) -> list:
    """The (side, engine) pairs in run i's order: each side first in turn."""
    sides = list(engines.items())
    shift = i % len(sides)
    return sides[shift:] + sides[:shift]


def sampling(args, i: int, kind: str = "FINAL_ONLY", max_tokens: int | None = None, schema: dict | None = None):
    """Request i's SamplingParams: greedy, or --temperature seeded with --seed + i (the same on every side);
    its output constrained to `schema` (a JSON schema) if given."""
    from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    seed = None if args.temperature == 0 else args.seed + i
    return SamplingParams(temperature=args.temperature, seed=seed, max_tokens=max_tokens or args.max_tokens,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          output_kind=RequestOutputKind[kind],
                          structured_outputs=None if schema is None else StructuredOutputsParams(json=schema))


def sampling_label(args) -> str:
    label = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g} (seeds {args.seed} + i)"
    penalties = [f"{name} penalty {value:g}" for name, value in
                 (("presence", args.presence_penalty), ("frequency", args.frequency_penalty)) if value]
    return ", ".join([label] + penalties)


def run_one(engine, prompt_ids, params) -> tuple[float, list[int]]:
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


def run_workload(name, prompts, tokenizer, engines, args) -> list[dict]:
    """Each prompt alone on every engine in turn; one result per speculating side, against the plain one."""
    ids = chat_ids(tokenizer, prompts)
    schemas = SCHEMAS.get(name, [None] * len(ids))
    times, produced = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
    latencies = {side: [] for side in engines}
    identical = dict.fromkeys(engines, True)
    for _ in range(args.warmup_passes):  # untimed: each step shape's first run costs extra, on either side
        for i, prompt in enumerate(ids):
            for engine in engines.values():
                run_one(engine, prompt, sampling(args, i, schema=schemas[i]))
    before = {side: spec_counters(engines[side]) for side in args.spec_sides}
    for i, prompt in enumerate(ids):
        for repeat in range(args.repeats):
            outputs = {}
            for side, engine in turns(engines, i + repeat):
                seconds, outputs[side] = run_one(engine, prompt, sampling(args, i, schema=schemas[i]))
                times[side] += seconds
                produced[side] += len(outputs[side])
                latencies[side].append(seconds)
            for side in args.spec_sides:
                identical[side] &= outputs["plain"] == outputs[side]
            if args.show:
                print(f"--- {name}: {tokenizer.decode(outputs['plain'])!r}", flush=True)
    tok_s = {side: produced[side] / times[side] for side in times}
    results = []
    for side in args.spec_sides:
        drafts, drafted, accepted = (b - a for a, b in zip(before[side], spec_counters(engines[side])))
        results.append({
            "workload": name, "draft_length": side, "prompts": len(ids), "repeats": args.repeats,
            "output_tokens": produced["plain"], "plain_tok_s": tok_s["plain"], "spec_tok_s": tok_s[side],
            "ratio": tok_s[side] / tok_s["plain"],
            "plain_mean_latency_s": sum(latencies["plain"]) / len(latencies["plain"]),
            "spec_mean_latency_s": sum(latencies[side]) / len(latencies[side]),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_per_draft": accepted / drafts if drafts else 0.0,
            "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "outputs_identical": identical[side]})
    return results


def chat_ids(tokenizer, prompts) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def run_batch(engine, requests, args) -> tuple[float, dict]:
    """All `requests` ((class, prompt ids) each) added at once (request i sampled as `sampling(args, i)`), stepped
    to the end: the wall time and, per request, (class, time to first token, time per output token after it,
    latency, token ids)."""
    start = time.perf_counter()
    for i, (_, prompt) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, sampling(args, i, "DELTA"))
    first, last, tokens = {}, {}, {str(i): [] for i in range(len(requests))}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                tokens[o.request_id].extend(o.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return wall, {rid: (requests[int(rid)][0], first[rid] - start, (last[rid] - first[rid]) / max(1, len(ids) - 1),
                        last[rid] - start, ids) for rid, ids in tokens.items()}


def run_mixed(args, loaded) -> dict:
    """--mixed-batch: N requests at once, half grounded-more, half open, on fresh engines of max_num_seqs N;
    per side and class the mean TTFT, TPOT and latency (ms / s) and the largest TPOT, and the batch's
    output tok/s."""
    n = args.mixed_batch
    grounded = chat_ids(loaded.tokenizer, [GROUNDED_MORE[i % len(GROUNDED_MORE)] for i in range(n - n // 2)])
    open_ = chat_ids(loaded.tokenizer, [OPEN[i % len(OPEN)] for i in range(n // 2)])
    requests = [("grounded", p) for p in grounded] + [("open", p) for p in open_]
    engines = make_engines(args, loaded, max_num_seqs=n)
    for engine in engines.values():  # untimed: first runs of the batch's step shapes
        run_batch(engine, requests, args)
    before = {side: spec_counters(engines[side]) for side in args.spec_sides}
    rows = {side: {"wall": 0.0, "tokens": 0, "requests": []} for side in engines}
    identical = True
    for repeat in range(args.repeats):
        outputs = {}
        for side, engine in turns(engines, repeat):
            wall, per_request = run_batch(engine, requests, args)
            rows[side]["wall"] += wall
            rows[side]["tokens"] += sum(len(r[4]) for r in per_request.values())
            rows[side]["requests"] += per_request.values()
            outputs[side] = {rid: r[4] for rid, r in per_request.items()}
        identical &= all(outputs["plain"] == outputs[side] for side in args.spec_sides)
    result = {"mixed_batch": n, "repeats": args.repeats, "outputs_identical": identical}
    for side in args.spec_sides:
        drafts, drafted, accepted = (b - a for a, b in zip(before[side], spec_counters(engines[side])))
        result[f"{side}_acceptance_rate"] = accepted / drafted if drafted else 0.0
        result[f"{side}_drafts"] = drafts
    for side, row in rows.items():
        result[f"{side}_tok_s"] = row["tokens"] / row["wall"]
        for cls in ("grounded", "open"):
            mine = [r for r in row["requests"] if r[0] == cls]
            for i, name in ((1, "ttft_ms"), (2, "tpot_ms"), (3, "latency_s")):
                scale = 1e3 if name.endswith("ms") else 1.0
                result[f"{side}_{cls}_{name}"] = scale * sum(r[i] for r in mine) / len(mine)
            result[f"{side}_{cls}_tpot_max_ms"] = 1e3 * max(r[2] for r in mine)  # the most slowed request
    return result


def print_mixed(r: dict, args) -> None:
    n = r["mixed_batch"]
    metrics = (("ttft_ms", "TTFT ms", 1), ("tpot_ms", "TPOT ms", 1), ("tpot_max_ms", "max TPOT", 1),
               ("latency_s", "lat s", 3))
    acceptance = ", ".join(f"{side} {r[f'{side}_acceptance_rate']:.2f}" for side in args.spec_sides)
    print(f"\nmixed batch: {n} requests at once ({n - n // 2} grounded-more, {n // 2} open), {sampling_label(args)}, "
          f"max_tokens {args.max_tokens}, {r['repeats']} run(s) a side; acceptance {acceptance}; outputs "
          f"identical: {r['outputs_identical']}")
    print(f"{'':<15}{'':>8}  {'grounded':^40}  {'open':^40}")
    print(f"{'side':<15}{'tok/s':>8}  " + "  ".join("".join(f"{label:>10}" for _, label, _ in metrics)
                                                     for _ in range(2)))
    for side in ("plain", *args.spec_sides):
        print(f"{side:<15}{r[f'{side}_tok_s']:>8.1f}  " + "  ".join(
            "".join(f"{r[f'{side}_{c}_{m}']:>10.{digits}f}" for m, _, digits in metrics) for c in ("grounded", "open")))
    for side in args.spec_sides:
        print(f"{side + '/plain':<15}{r[f'{side}_tok_s'] / r['plain_tok_s']:>7.2f}x  " + "  ".join(
            "".join(f"{r[f'{side}_{c}_{m}'] / r[f'plain_{c}_{m}']:>9.2f}x" for m, _, _ in metrics)
            for c in ("grounded", "open")))


def run_batch_one(args, loaded) -> list[dict]:
    """The batch-1 workloads (--workloads) on a plain and the speculating engines; prints their table."""
    start = time.perf_counter()
    tokenizer = loaded.tokenizer
    engines = make_engines(args, loaded)
    print(f"engines ready in {time.perf_counter() - start:.0f} s; speculative_config "
          f"{engines[args.spec_sides[0]].args.speculative_config}", flush=True)
    warm = tokenizer("Hello, how are you?")["input_ids"]
    for engine in engines.values():  # first-request effects out of the timed runs
        run_one(engine, warm, sampling(args, 0, max_tokens=8))
    results = [r for name in args.workload_names
               for r in run_workload(name, args.prompts[name], tokenizer, engines, args)]
    print(f"\nbatch 1, {sampling_label(args)}, max_tokens {args.max_tokens}, k = {args.num_speculative_tokens}, "
          f"prompt_lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}")
    print(f"{'workload':<14}{'drafts':>9}{'tokens':>8}{'plain tok/s':>13}{'spec tok/s':>12}{'ratio':>8}"
          f"{'plain lat s':>13}{'spec lat s':>12}{'accept':>8}{'tok/draft':>11}{'same':>6}")
    for r in results:
        print(f"{r['workload']:<14}{r['draft_length']:>9}{r['output_tokens']:>8}{r['plain_tok_s']:>13.1f}"
              f"{r['spec_tok_s']:>12.1f}{r['ratio']:>7.2f}x{r['plain_mean_latency_s']:>13.2f}"
              f"{r['spec_mean_latency_s']:>12.2f}{r['acceptance_rate']:>8.2f}{r['mean_accepted_per_draft']:>11.2f}"
              f"{str(r['outputs_identical']):>6}")
    for side in args.spec_sides:
        policy = engines[side].draft_policy
        if policy is not None:  # what the adaptive engine measured: a decode step's ms by rows fed
            print(f"{side}: step ms by rows fed (batch 1): " + ", ".join(
                f"{n}: {1e3 * t:.1f}" for n, t in policy.step_seconds().items()))
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxpaged.models.loader import load_model

    loaded = load_model(args.model, dtype="float32")
    results = run_batch_one(args, loaded) if args.workload_names else []
    if args.mixed_batch:
        results.append(run_mixed(args, loaded))
        print_mixed(results[-1], args)
    if args.json:
        for r in results:
            print(json.dumps(r))
    return 0 if all(r["outputs_identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Where a served workload's time goes, offline: every engine step timed and grouped by its shape.

The 32-concurrent chat workload of `compare_servers.py` without the server: --num-prompts prompts of
--prompt-len random token ids, --output-len tokens each (EOS ignored), greedy, through `LLM.generate`
with max_num_seqs = --concurrency (the scheduler keeps that many in flight, as the benchmark client does).
Each `execute_model` call is timed (forward, sampler, results back on the host) and grouped by kind
(decode only, or mixed: some request fed more than one token) and by its (T, S) bucket. Prints the
total output tok/s and, per group: steps, seconds, ms per step, tokens fed. Steps run one at a time
(async scheduling off, as `EngineArgs(async_scheduling=False)`), so each is timed whole; --async-scheduling
keeps the engine's default (the total tok/s as served, no per-step table: steps then overlap).

    python scripts/profile_workload.py                       # 64 x (160 in, 128 out) at 32
    python scripts/profile_workload.py --max-num-batched-tokens 512 --weight-layout stacked
    python scripts/profile_workload.py --tree /path/to/other/checkout    # the same on another tree
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--weight-layout", default="auto")
    ap.add_argument("--quantization", choices=["int8", "w8a8"], default=None)
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the engine's default async scheduling (no per-step table)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--tree", default=str(pathlib.Path(__file__).resolve().parents[1]),
                    help="the checkout whose jaxpaged runs (default: this one)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, args.tree)
    import numpy as np

    from jaxpaged import LLM, SamplingParams

    extra = {} if args.weight_layout == "auto" else {"weight_layout": args.weight_layout}
    extra |= {} if args.async_scheduling else {"async_scheduling": False}
    extra |= {"quantization": args.quantization} if args.quantization else {}
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, max_num_seqs=args.concurrency,
              max_num_batched_tokens=args.max_num_batched_tokens, **extra)
    print(f"{args.tree}: engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    runner = llm.llm_engine.runner
    execute, log = runner.execute_model, []

    def timed(out, *a, **kw):  # (kind, T, S, tokens fed, seconds) per step
        begin = time.perf_counter()
        result = execute(out, *a, **kw)
        entries = out.scheduled_requests
        fed = sum(e.num_tokens for e in entries)
        shape = runner.config.bucket_for(fed, len(entries), 1)[:2]
        log.append(("decode" if fed == len(entries) else "mixed", *shape, fed, time.perf_counter() - begin))
        return result

    runner.execute_model = timed
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(1000, 40000, size=args.prompt_len).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.output_len,
                            ignore_eos=True, seed=0 if args.temperature else None)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{produced} output tokens in {seconds:.1f} s: {produced / seconds:.0f} tok/s; {len(log)} steps, "
          f"{sum(entry[-1] for entry in log):.1f} s in execute_model")
    groups = collections.defaultdict(lambda: [0, 0.0, 0])
    for kind, t, s, fed, step_seconds in log:
        g = groups[(kind, t, s)]
        g[0], g[1], g[2] = g[0] + 1, g[1] + step_seconds, g[2] + fed
    print(f"{'kind':8s}{'T':>6s}{'S':>5s}{'steps':>7s}{'seconds':>9s}{'ms/step':>9s}{'tokens':>8s}")
    for (kind, t, s), (n, total, fed) in sorted(groups.items()):
        print(f"{kind:8s}{t:6d}{s:5d}{n:7d}{total:9.2f}{1e3 * total / n:9.1f}{fed:8d}")


if __name__ == "__main__":
    main()

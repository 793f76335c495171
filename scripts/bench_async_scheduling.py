"""Async scheduling: the synchronous and the overlapped engine loop side by side, interleaved in one process.

    python scripts/bench_async_scheduling.py                       # SmolLM2-135M f32, batch 1 and 32
    python scripts/bench_async_scheduling.py --batches 1,8,32 --output-len 64 --rounds 3

Two LLMEngines over one loaded model, identical but for EngineArgs.async_scheduling, run the same greedy
workload (`batch` requests of --input-len random prompt tokens, --output-len tokens each, ignore_eos, all
added at once; batch 1 runs --batch1-requests requests one after the other) in alternating order, --rounds
times, so that load on a shared machine hits both alike. Prints output tokens/s per run and the median of
each side, and checks that both produced the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.models.loader import DEFAULT_MODEL, load_model
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


def run(engine: LLMEngine, prompts: list[list[int]], output_len: int, one_by_one: bool) -> tuple[float, list]:
    """(output tokens/s, tokens of every request) for the prompts, all at once or one after the other."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    groups = [[p] for p in prompts] if one_by_one else [prompts]
    tokens, start = [], time.perf_counter()
    for g, group in enumerate(groups):
        for i, prompt in enumerate(group):
            engine.add_request(f"{g}-{i}", {"prompt_token_ids": prompt}, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        tokens += [done[f"{g}-{i}"] for i in range(len(group))]
    seconds = time.perf_counter() - start
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--batch1-requests", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engine-args", default="max_model_len=1024,max_num_seqs=32,max_num_batched_tokens=256,"
                   "kv_cache_memory=268435456", help="EngineArgs fields, k=v comma list (ints)")
    args = p.parse_args()
    fields = {k: int(v) for k, v in (kv.split("=") for kv in args.engine_args.split(",") if kv)}
    loaded = load_model(args.model, dtype="float32")
    engines = {mode: LLMEngine(EngineArgs(model=args.model, async_scheduling=mode, **fields), loaded=loaded)
               for mode in (False, True)}
    rng = np.random.default_rng(0)
    vocab = int(loaded.config.vocab_size)
    results: dict[tuple[int, bool], list[float]] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        count = args.batch1_requests if batch == 1 else batch
        prompts = [rng.integers(0, vocab, args.input_len).tolist() for _ in range(count)]
        run(engines[False], prompts[:1], 4, True)  # warm both on this batch's shapes
        run(engines[True], prompts[:1], 4, True)
        outputs = {}
        for r in range(args.rounds):
            for mode in ((False, True) if r % 2 == 0 else (True, False)):
                tok_s, outputs[mode] = run(engines[mode], prompts, args.output_len, batch == 1)
                results.setdefault((batch, mode), []).append(tok_s)
                name = "async" if mode else "sync "
                print(f"batch {batch:3d}  round {r}  {name}  {tok_s:8.2f} out tok/s", flush=True)
        assert outputs[False] == outputs[True], "the two loops produced different tokens"
    print("\n| batch | sync out tok/s (median) | async out tok/s (median) | async / sync |\n|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        sync, overlapped = (statistics.median(results[(batch, m)]) for m in (False, True))
        print(f"| {batch} | {sync:.2f} | {overlapped:.2f} | {overlapped / sync:.2f}x |")


if __name__ == "__main__":
    main()

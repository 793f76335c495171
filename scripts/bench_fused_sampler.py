#!/usr/bin/env python3
"""The fused sampler on CPU: decode step time with the sampler inside the step's program vs separate, in one run.

    python scripts/bench_fused_sampler.py [--batch 1 32] [--rounds 15] [--steps-per-round 3]

Two engines over the same SmolLM2-135M-Instruct weights (float32, loaded once): fuse_sampler="off" (the
forward program, then the sampler's programs) and "on" (one program per step). For each batch size and
sampling setting (greedy; temperature 0.8 + top_p 0.95, seeded), both engines get the same B requests and
run them into decode; then rounds of --steps-per-round `LLMEngine.step()` calls alternate between the two
sides (the order flipped every round), so load on a shared machine hits both alike. Printed per row: each
side's best and median step ms and the ratio off / on of the best (> 1: fused is faster). The step shapes
run are compiled by the first steps (before timing), not by a full warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.models.loader import load_model  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402

PROMPT = ("You are a helpful assistant. Explain, step by step and with a short example, how a hash map handles "
          "collisions, and when a balanced tree would be the better choice for a given workload. ")
SETTINGS = {"greedy": dict(temperature=0.0), "t0.8 top_p0.95": dict(temperature=0.8, top_p=0.95)}


def make_engines(max_num_seqs: int) -> dict[str, LLMEngine]:
    loaded = load_model("smollm2-135m-instruct", dtype="float32")
    base = EngineArgs(model="smollm2-135m-instruct", dtype="float32", max_model_len=1024, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=512, kv_cache_memory=512 << 20, warmup=False)
    return {side: LLMEngine(dataclasses.replace(base, fuse_sampler=side), loaded=loaded) for side in ("off", "on")}


def into_decode(engine: LLMEngine, prompt: list[int], batch: int, setting: dict, tag: str) -> None:
    """Add `batch` requests and step until every one has its first token (all in decode), then 2 steps more."""
    for i in range(batch):
        params = SamplingParams(max_tokens=900, ignore_eos=True, seed=i, detokenize=False, **setting)
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()


def measure(engines: dict[str, LLMEngine], prompt, batch: int, setting: dict, rounds: int, steps: int, tag: str):
    """{side: [step seconds]} over interleaved rounds."""
    for side, engine in engines.items():
        into_decode(engine, prompt, batch, setting, tag)
    times = {side: [] for side in engines}
    order = list(engines)
    for r in range(rounds):
        for side in (order if r % 2 == 0 else order[::-1]):
            for _ in range(steps):
                t0 = time.perf_counter()
                engines[side].step()
                times[side].append(time.perf_counter() - t0)
    for engine in engines.values():
        engine.abort_request([f"{tag}-{i}" for i in range(batch)])
        while engine.has_unfinished_requests():
            engine.step()
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps-per-round", type=int, default=3)
    args = p.parse_args(argv)
    engines = make_engines(max(args.batch))
    prompt = list(engines["off"].tokenizer(PROMPT)["input_ids"])
    print(f"SmolLM2-135M f32, prompt {len(prompt)} tokens, {args.rounds} rounds x {args.steps_per_round} decode "
          "steps a side, interleaved; step ms best / median")
    print(f"{'batch':>5s} {'setting':16s} {'off best':>9s} {'off med':>8s} {'on best':>8s} {'on med':>7s} "
          f"{'off/on best':>11s} {'off/on med':>10s}")
    for batch in args.batch:
        for name, setting in SETTINGS.items():
            times = measure(engines, prompt, batch, setting, args.rounds, args.steps_per_round, f"{batch}-{name}")
            best = {s: 1e3 * min(t) for s, t in times.items()}
            med = {s: 1e3 * float(np.median(t)) for s, t in times.items()}
            print(f"{batch:5d} {name:16s} {best['off']:9.1f} {med['off']:8.1f} {best['on']:8.1f} {med['on']:7.1f} "
                  f"{best['off'] / best['on']:10.2f}x {med['off'] / med['on']:9.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

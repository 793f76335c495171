"""Seconds of `update_weights` (jaxpaged/worker/live_weights.py) on a real or a random model, side by side with
what it replaces (a new engine on the new weights) and with the bare copy of the same bytes, from one run.

    python scripts/bench_update_weights.py                       # SmolLM2-135M (the default model), float32
    python scripts/bench_update_weights.py --model /a/hf/folder --dtype bfloat16 --repeats 5
    python scripts/bench_update_weights.py --random llama3-8b --target-seconds 2   # GPU: random bf16 8B shape
    python scripts/bench_update_weights.py --random smoke        # any machine: the tiny random shape

Rows (first run, median, every run; the first run of a process also pays its fresh memory's page faults):
  update, host numpy, all tensors   every weight as a host numpy array (get_weights' copies, scaled): a host-side
                                    trainer; includes the finite/shape checks
  update, jax.Array, all tensors    the same already on the engine's device (on a GPU: converted there, the
                                    trainer-in-the-same-process case)
  update, one layer                 layer 0's tensors (a fused projection's other parts read back)
  sleep(1) + wake_up()              the KV pool freed and allocated again
  floor: device_put, all tensors    the host arrays copied to the device as they are (no conversion, no checks)
  baseline: a new engine            (a real model) LLM(...) on the same model, no warm-up: what a restart costs
--target-seconds T prints a PASS / MISS line for the median of "update, jax.Array, all tensors" (issue #65: SmolLM2
on the CPU < 1 s; the Llama-3-8B shape on the H200 < 2 s).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxpaged import LLM, SamplingParams  # noqa: E402
from jaxpaged.config import EngineArgs  # noqa: E402
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` runs (device work waited for)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def row(name: str, times: list[float]) -> str:
    runs = " ".join(f"{t:.3f}" for t in times)
    return f"{name:40s} {times[0]:8.3f} {statistics.median(times):9.3f}   ({runs})"


def greedy(engine: LLMEngine) -> list[int]:
    engine.add_request("bench", {"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    return tokens


def measure(engine: LLMEngine, weights: dict, repeats: int) -> list[tuple[str, list[float]]]:
    """(name, seconds of each run) of the update and sleep rows and the copy floor."""
    host = {n: x * np.asarray(1.001, x.dtype) for n, x in weights.items()}
    device = jax.device_put(weights)
    layer0 = {n: x for n, x in weights.items() if n.startswith("model.layers.0.")}

    def after_update(w):
        engine.update_weights(w)
        return jax.tree.leaves(engine.runner.params)

    rows = [("update, host numpy, all tensors", lambda: after_update(host)),
            ("update, jax.Array, all tensors", lambda: after_update(device)),
            (f"update, one layer ({len(layer0)} tensors)", lambda: after_update(layer0)),
            ("sleep(1) + wake_up()", lambda: (engine.sleep(1), engine.wake_up(), jax.tree.leaves(engine.runner.kv))),
            ("floor: device_put, all tensors", lambda: jax.device_put(host))]
    return [(name, timed(fn, repeats)) for name, fn in rows]


def random_engine(shape: str) -> LLMEngine:
    """An engine on random bf16 weights of `shape` (scripts/bench_engine_gpu.py's), a small KV pool (the device
    also holds the jax.Array copy of the weights)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engine_gpu import LLAMA3_8B, SMOKE, random_model  # pylint: disable=import-outside-toplevel
    config = {"llama3-8b": LLAMA3_8B, "smoke": SMOKE}[shape]
    args = EngineArgs(model="random", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256,
                      kv_cache_memory=1 << 30, warmup=False)
    return LLMEngine(args, loaded=random_model(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--random", choices=("llama3-8b", "smoke"), help="random bf16 weights of this shape")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--target-seconds", type=float)
    args = parser.parse_args()
    engine_args = {"dtype": args.dtype, "max_model_len": args.max_model_len, "warmup": False}
    engine = random_engine(args.random) if args.random else LLM(args.model, **engine_args).llm_engine
    name = f"random {args.random} (bfloat16)" if args.random else f"{args.model} ({args.dtype})"
    before = greedy(engine)
    weights = engine.get_weights()
    print(f"{name}, {len(weights)} tensors, {sum(x.nbytes for x in weights.values()) / 2**20:.0f} MiB, "
          f"{args.repeats} runs each, {jax.devices()[0].device_kind}; layout {engine.runner.layout}")
    print(f"{'':40s} {'first s':>8s} {'median s':>9s}   (each run)")
    rows = measure(engine, weights, args.repeats)
    for label, times in rows:
        print(row(label, times))
    engine.update_weights(weights)
    print(f"greedy tokens after restoring the weights equal those before: {greedy(engine) == before}")
    if not args.random:
        del engine
        print(row("baseline: a new engine (no warm-up)",
                  timed(lambda: LLM(args.model, **engine_args), min(args.repeats, 3))))
    if args.target_seconds is not None:
        median = statistics.median(dict(rows)["update, jax.Array, all tensors"])
        verdict = "PASS" if median < args.target_seconds else "MISS"
        print(f"{verdict:10s} update_weights of {name} (jax.Array, all tensors): median {median:.3f} s, "
              f"target < {args.target_seconds} s")


if __name__ == "__main__":
    main()

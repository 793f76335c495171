"""Seconds of `LLM.update_weights` on a real model, side by side with the way round it (a new engine on the new
weights), from one run.

    python scripts/bench_update_weights.py                       # SmolLM2-135M (the default model), float32
    python scripts/bench_update_weights.py --model /a/hf/folder --dtype bfloat16 --repeats 5

Rows (each the median of --repeats runs, the first run also shown: it pays the fresh memory's page faults):
  update, host numpy, all tensors   every weight as a numpy array (get_weights' copies, perturbed), the trainer's
                                    host-side case; includes the finite/shape checks
  update, jax.Array, all tensors    the same as jax.Arrays already on the engine's device
  update, one layer                 the 9 tensors of layer 0 (a fused projection's other parts read back)
  sleep(1) + wake_up()              the KV pool freed and allocated again
  baseline: a new engine            LLM(...) on the same model (load, convert, pool, no warm-up): what a restart
                                    costs instead
The target (issue #65) is < 1 s for SmolLM2 on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np

from jaxpaged import LLM, SamplingParams


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def row(name: str, times: list[float]) -> str:
    runs = " ".join(f"{t:.3f}" for t in times)
    return f"{name:40s} {times[0]:8.3f} {statistics.median(times):9.3f}   ({runs})"


def measure(llm: LLM, weights: dict, repeats: int) -> list[tuple[str, list[float]]]:
    """The update and sleep rows: (name, seconds of each run)."""
    rng = np.random.default_rng(0)
    host = {n: x * np.asarray(1 + 1e-3 * rng.standard_normal(), x.dtype) for n, x in weights.items()}
    device = {n: jnp.asarray(x) for n, x in weights.items()}
    layer0 = {n: x for n, x in weights.items() if n.startswith("model.layers.0.")}
    rows = [("update, host numpy, all tensors", lambda: llm.update_weights(host)),
            ("update, jax.Array, all tensors", lambda: llm.update_weights(device)),
            (f"update, one layer ({len(layer0)} tensors)", lambda: llm.update_weights(layer0)),
            ("sleep(1) + wake_up()", lambda: (llm.sleep(1), llm.wake_up()))]
    return [(name, timed(fn, repeats)) for name, fn in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()
    engine_args = dict(dtype=args.dtype, max_model_len=args.max_model_len, warmup=False)
    llm = LLM(args.model, **engine_args)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(100, 140))}]
    before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    weights = llm.get_weights()
    print(f"{args.model} ({args.dtype}, {len(weights)} tensors, "
          f"{sum(x.nbytes for x in weights.values()) / 2**20:.0f} MiB), {args.repeats} runs each; "
          f"layout {llm.llm_engine.runner.layout}")
    print(f"{'':40s} {'first s':>8s} {'median s':>9s}   (each run)")
    for name, times in measure(llm, weights, args.repeats):
        print(row(name, times))
    llm.update_weights(weights)
    after = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    print(f"greedy tokens after restoring the weights equal those before: {after == before}")
    del llm
    print(row("baseline: a new engine (no warm-up)", timed(lambda: LLM(args.model, **engine_args),
                                                            min(args.repeats, 3))))


if __name__ == "__main__":
    main()

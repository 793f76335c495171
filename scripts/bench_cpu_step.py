#!/usr/bin/env python3
"""Where one CPU decode step goes: forward (matmuls, attention), sampler, host. SmolLM2-135M.

Real weights (the smollm2-135m-instruct GGUF, float32), the engine's own runner and sampler.
B requests with chat-length prompts are run to context ~CTX, all in decode; then each part is
timed on that same batch (median of --steps):

  step      LLMEngine.step(): everything, as served
  forward   ModelRunner.execute on the step's input (block_until_ready)
  matmuls   the same jitted forward with attention replaced by its KV write only (q passes through)
  attention forward - matmuls
  sampler   sample_jit on the step's logits, per sampling setting (greedy, temperature 0.8 +
            top_p 0.95, top_k 40, temperature-only), logprobs off as in serving
  host      step - forward - sampler(greedy): prepare, sampling batch, scheduler, detokenizer

With --xla-options the forward is also compiled per XLA:CPU option set (compiler_options of the
same jitted step) and timed side by side; the engine's own choice is `model_runner.CPU_COMPILER_OPTIONS`.

    python scripts/bench_cpu_step.py --batch 1 32 [--steps 5] [--xla-options]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jaxpaged import model_runner  # noqa: E402
from jaxpaged.engine import EngineArgs, LLMEngine  # noqa: E402
from jaxpaged.sampler import RowInfo, make_sampling_batch, sample_jit  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {"greedy": SamplingParams(temperature=0.0), "t0.8 top_p0.95": SamplingParams(temperature=0.8, top_p=0.95),
            "top_k40": SamplingParams(temperature=1.0, top_k=40), "t0.8": SamplingParams(temperature=0.8)}
OPTION_SETS = {
    "default": {},
    "ynn dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "onednn dot": {"xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
}
PROMPT = ("You are a helpful assistant. Explain, step by step and with a short example, how a hash map handles "
          "collisions, and when a balanced tree would be the better choice for a given workload. ")


def median_ms(fn, steps: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def _write_only(q, k, v, k_pool, v_pool, step, layer, *, sm_scale, attention):
    kp, vp = model_runner.write_kv_inner(k_pool, v_pool, k, v, step.slot_mapping, layer=layer)
    return q, kp, vp


def decode_batch(engine: LLMEngine, batch: int, context: int):
    """Add `batch` requests and step until all decode at ~context; returns the next step's scheduled entries."""
    prompt = engine.tokenizer.encode(PROMPT * max(1, context // 40))[:context - 8]
    for i in range(batch):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
    while True:
        engine.step()
        reqs = list(engine.scheduler.running)
        if len(reqs) == batch and all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in reqs) \
                and min(r.num_computed_tokens for r in reqs) >= context:
            return


def forward_parts(engine: LLMEngine, steps: int, xla_options: bool) -> dict[str, float]:
    runner = engine.runner
    entries = engine.scheduler.schedule().scheduled_requests
    step = runner.prepare(entries)
    out = {"forward": median_ms(lambda: runner.execute(step), steps)}
    cfg, att = runner.model_config, runner.config.attention

    def timed(compiled) -> float:  # the pool is donated, as in the runner: thread it through
        def call():
            logits, runner.kv = compiled(runner.params, runner.kv, step)
            return logits
        return median_ms(call, steps)

    def compile_forward(forward, opts):
        return jax.jit(forward, static_argnums=(0, 1), donate_argnums=(3,), compiler_options=opts) \
            .lower(cfg, att, runner.params, runner.kv, step).compile()

    write_only = functools.partial(_patched_forward, _write_only)
    out["matmuls"] = timed(compile_forward(write_only, _engine_options()))
    out["attention"] = out["forward"] - out["matmuls"]
    if xla_options:
        for name, opts in OPTION_SETS.items():
            try:
                out[f"forward[{name}]"] = timed(compile_forward(model_runner.paged_forward, opts))
                out[f"matmuls[{name}]"] = timed(compile_forward(write_only, opts))
            except Exception as e:  # an option this jaxlib does not know
                print(f"  {name}: not accepted ({type(e).__name__}: {str(e)[:100]})")
    logits = runner.execute(step)
    for name, params in SETTINGS.items():  # the batch's real logits, each row with its own seed and step
        rows = [RowInfo(params=params, seed=i, step=_num_output_tokens(engine, e)) for i, e in enumerate(entries)]
        batch = make_sampling_batch(rows, logits.shape[0], logits.shape[1])
        out[f"sampler {name}"] = median_ms(lambda: sample_jit(logits, batch, num_top_logprobs=0), steps)
    return out  # the step scheduled here is dropped: the engine is not stepped again


def _num_output_tokens(engine, entry) -> int:
    if hasattr(entry, "num_output_tokens"):
        return entry.num_output_tokens
    return engine._child_to_parent[entry.request_id][1].request.num_output_tokens  # before the runner seam


def _engine_options() -> dict:
    """The runner's own XLA options (none in checkouts from before they existed)."""
    return getattr(model_runner, "cpu_compiler_options", dict)()


def _patched_forward(attend, config, attention, params, kv, step):
    saved = model_runner._attend_paged
    model_runner._attend_paged = attend  # read by paged_forward at trace time
    try:
        return model_runner.paged_forward(config, attention, params, kv, step)
    finally:
        model_runner._attend_paged = saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=170)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--xla-options", action="store_true", help="also time the forward per XLA option set")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.default_backend()}; SmolLM2-135M f32, decode at context ~{args.context}, "
          f"median of {args.steps}; engine compiler options {_engine_options()}")
    for batch in args.batch:
        engine = LLMEngine(EngineArgs(model="smollm2-135m-instruct", dtype="float32", max_num_seqs=max(batch, 4),
                                      max_model_len=512, warmup=False))
        decode_batch(engine, batch, args.context)
        whole = median_ms(lambda: engine.step(), args.steps)
        parts = forward_parts(engine, args.steps, args.xla_options)
        parts = {"step": whole, **parts, "host": whole - parts["forward"] - parts["sampler greedy"]}
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + " (ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

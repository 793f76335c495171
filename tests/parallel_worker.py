"""Tensor-parallel checks in a fresh process: `python -m tests.parallel_worker <mode> '<json args>'`.

JAX fixes its device count when it starts, so tests/test_parallel.py runs these in
subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=N (or under
jax.distributed); each mode prints one JSON line, prefixed RESULT=, on stdout.

Modes:
  serve       {model, tps, prompts, max_tokens, checkpoint?, save_to?, attention_backend?, engine_args?,
              async_scheduling?}
              per tp: greedy tokens,
              the logits of a 30-token prefill, the params' shardings and per-device bytes;
              checkpoint: `model` is a jaxpaged checkpoint, restored into each tp's shardings;
              save_to: save the last tp's sharded params there as a jaxpaged checkpoint;
              attention_backend: reference (default), xla or pallas; engine_args: more EngineArgs fields;
              async_scheduling: EngineArgs'
  error       {model, tp}                                     the ValueError message LLMEngine raises
  multihost   {model, tp, prompts, max_tokens, coordinator, num_processes, process_id, async_scheduling?}
              process 0: greedy tokens; others: how many steps they followed; each: whether the engine
              runs the overlapped loop (multi-process falls back to the synchronous one)
"""

from __future__ import annotations

import json
import sys

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, num_pages=64, block_size=16,
              compilation_cache_dir=None, warmup=False, attention_backend="reference")


def greedy_tokens(engine, prompts, max_tokens) -> list[list[int]]:
    from jaxpaged.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def prefill_logits(engine, tokens) -> list[float]:
    """Logits at the last of `tokens`, fed as one chunk into fresh pages 1.."""
    import numpy as np
    from jaxpaged.sampling_params import SamplingParams
    from jaxpaged.core.scheduler_output import ScheduledRequest
    pages = tuple(range(1, len(tokens) // engine.runner.config.page_size + 2))
    entry = ScheduledRequest("p", tuple(tokens), 0, pages, True, SamplingParams(), len(tokens))
    return np.asarray(engine.runner.execute(engine.runner.prepare([entry]))[0]).tolist()


def shard_report(params) -> dict:
    """Per leaf: the spec, total bytes and the bytes on each device."""
    import jax
    report = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        report[jax.tree_util.keystr(path)] = {
            "spec": str(getattr(leaf.sharding, "spec", None)), "bytes": int(leaf.nbytes),
            "device_bytes": sorted(int(s.data.nbytes) for s in leaf.addressable_shards),
            "devices": len(leaf.sharding.device_set)}
    return report


def load(model: str):
    from jaxpaged.models.loader import load_model
    return load_model(model, dtype="float32")


def serve(args: dict) -> dict:
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine
    results = {}
    loaded = None if args.get("checkpoint") else load(args["model"])
    for tp in args["tps"]:
        engine_args = EngineArgs(model=args["model"], dtype="float32", tensor_parallel_size=tp,
                                 async_scheduling=args.get("async_scheduling", False),
                                 **{**ENGINE, "attention_backend": args.get("attention_backend", "reference"),
                                    **args.get("engine_args", {})})
        engine = LLMEngine(engine_args, loaded=loaded)  # a checkpoint restores into tp's shardings
        results[str(tp)] = {
            "tokens": greedy_tokens(engine, args["prompts"], args["max_tokens"]),
            "logits": prefill_logits(engine, list(range(3, 33))),
            "shards": shard_report(engine.runner.params),
            "kv_device_bytes": sorted(int(s.data.nbytes) for s in engine.runner.kv.k.addressable_shards),
            "kv_bytes": int(engine.runner.kv.k.nbytes),
        }
    if args.get("save_to"):  # the last engine's sharded params, saved as a jaxpaged checkpoint
        import dataclasses
        from jaxpaged.convert import save_model
        save_model(dataclasses.replace(engine.model, params=engine.runner.params), args["save_to"])
    return results


def error(args: dict) -> dict:
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine
    try:
        LLMEngine(EngineArgs(model=args["model"], dtype="float32", tensor_parallel_size=args["tp"], **ENGINE),
                  loaded=load(args["model"]))
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None}


def multihost(args: dict) -> dict:
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(
        model=args["model"], dtype="float32", tensor_parallel_size=args["tp"],
        distributed_coordinator=args["coordinator"], num_processes=args["num_processes"],
        process_id=args["process_id"], async_scheduling=args.get("async_scheduling", False), **ENGINE))
    import jax
    info = {"process_count": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "async_scheduling": engine.async_scheduling}
    if args["process_id"] == 0:
        info["tokens"] = greedy_tokens(engine, args["prompts"], args["max_tokens"])
        engine.shutdown()
    else:
        info["steps_followed"] = engine.follow()
    return info


if __name__ == "__main__":
    mode, payload = sys.argv[1], json.loads(sys.argv[2])
    result = {"serve": serve, "error": error, "multihost": multihost}[mode](payload)
    print("RESULT=" + json.dumps(result), flush=True)

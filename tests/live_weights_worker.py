"""update_weights and sleep/wake on a tensor-parallel mesh, in a fresh process with N CPU devices (JAX fixes its
device count at start): `python -m tests.live_weights_worker '<json args>'` prints one RESULT= JSON line.

Args {a, b, tp, prompts, max_tokens}: an engine on checkpoint `a` sharded over `tp` devices takes `b`'s tensors,
first as host numpy arrays, then (from `a` again and back to `b`) as jax.Arrays put on the mesh and converted
there with jax.numpy (as an accelerator's would be); reports the greedy tokens after each, a fresh `b` engine's,
whether every leaf kept its sharding, the jit cache misses during the updates and the generations after them,
and the tokens after sleep(2) and wake_up().
"""

from __future__ import annotations

import json
import sys


def main(args: dict) -> dict:
    import jax
    from safetensors.numpy import load_file

    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine
    from jaxpaged.worker import live_weights
    from tests.parallel_worker import ENGINE, greedy_tokens

    def engine_on(path):
        return LLMEngine(EngineArgs(model=path, dtype="float32", tensor_parallel_size=args["tp"],
                                    async_scheduling=False, **ENGINE))

    def tokens(engine):
        return greedy_tokens(engine, args["prompts"], args["max_tokens"])

    misses = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _d, **kw: misses.append(kw.get("fun_name")) if event.endswith("jaxpr_to_mlir_module_duration")
        else None)
    a, b = (load_file(f"{p}/model.safetensors") for p in (args["a"], args["b"]))
    engine = engine_on(args["a"])
    before = tokens(engine)
    shardings = [x.sharding for x in jax.tree.leaves(engine.runner.params)]
    result = {"before": before}
    start = len(misses)
    engine.update_weights(b)
    result["host"] = tokens(engine)
    result["host_misses"] = misses[start:]
    live_weights._off_host = lambda x: isinstance(x, jax.Array)  # the accelerator's path, on these CPU devices
    replicated = jax.sharding.NamedSharding(engine.mesh, jax.sharding.PartitionSpec())
    engine.update_weights({n: jax.device_put(x, replicated) for n, x in a.items()})
    result["device_back_to_a"] = tokens(engine)
    engine.update_weights({n: jax.device_put(x, replicated) for n, x in b.items()})
    result["device"] = tokens(engine)
    result["same_shardings"] = [x.sharding for x in jax.tree.leaves(engine.runner.params)] == shardings
    engine.sleep(2)
    engine.wake_up()
    result["after_wake"] = tokens(engine)
    result["fresh_b"] = tokens(engine_on(args["b"]))
    return result


if __name__ == "__main__":
    print("RESULT=" + json.dumps(main(json.loads(sys.argv[1]))), flush=True)

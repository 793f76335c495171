"""LLM.update_weights / get_weights (jaxpaged/worker/live_weights.py, jaxpaged/engine/weight_control.py): an engine
loaded from checkpoint A and updated with checkpoint B's tensors generates what a fresh engine from B does, in every
family and weight form; nothing compiles again; bad dicts change nothing; the prefix cache is dropped."""

from __future__ import annotations

import contextlib
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.weight_dots import PackedWeight
from jaxpaged.worker.live_weights import WeightUpdateError, hf_slots
from tests.conftest import make_tiny_checkpoint
from tests.models.tiny_families import FAMILY_VARIANTS, make_family_checkpoint

ARGS = dict(dtype="float32", seed=0, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, num_pages=64,
            block_size=8, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(3, 20)), [7, 1, 250, 3, 99]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{variant: (A, B)}: two random checkpoints of each family (seeds 0 and 1); "llama": LlamaForCausalLM's."""
    root = tmp_path_factory.mktemp("live")
    pairs = {v: (make_family_checkpoint(root / f"{v}-a", v, 0), make_family_checkpoint(root / f"{v}-b", v, 1))
             for v in FAMILY_VARIANTS}
    pairs["llama"] = (make_tiny_checkpoint(root / "llama-a", "gqa4", seed=0),
                      make_tiny_checkpoint(root / "llama-b", "gqa4", seed=1))
    return pairs


def tensors(folder) -> dict[str, np.ndarray]:
    return load_file(str(folder / "model.safetensors"))


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@contextlib.contextmanager
def count_compiles():
    """Counts jit cache misses (each lowering to MLIR, whether XLA then compiles or the persistent cache has it)."""
    events = []

    def listener(event, _duration, **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            events.append(_.get("fun_name", event))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("variant", sorted(FAMILY_VARIANTS) + ["llama"])
def test_update_equals_a_fresh_engine_in_every_family(checkpoints, variant):
    """Packed float32 weights (the CPU default): A's engine, its prefix cache full of the prompts, takes B's
    tensors and then generates B's greedy tokens, with no program compiled for the update or after it."""
    a, b = checkpoints[variant]
    llm = LLM(model=str(a), **ARGS)
    before = greedy(llm)
    assert llm.llm_engine.scheduler.pool.num_cached_pages > 0
    with count_compiles() as compiles:
        llm.update_weights(tensors(b))
        assert llm.llm_engine.scheduler.pool.num_cached_pages == 0
        after = greedy(llm)
    assert compiles == [], compiles
    expected = greedy(LLM(model=str(b), **ARGS))
    assert after == expected and after != before


@pytest.mark.parametrize("args", [dict(dtype="bfloat16"), dict(weight_layout="stacked", attention_backend="xla"),
                                  dict(quantization="int8"), dict(quantization="fp8")],
                         ids=["bf16-per-layer", "stacked-xla", "int8", "fp8"])
def test_update_equals_a_fresh_engine_in_every_weight_form(checkpoints, args):
    """Per-layer bf16 arrays (host float32 tensors cast), an unpacked scanned stack, int8 and fp8 weight dots."""
    a, b = checkpoints["qwen2"]
    llm = LLM(model=str(a), **{**ARGS, **args})
    greedy(llm)
    llm.update_weights(tensors(b))
    assert greedy(llm) == greedy(LLM(model=str(b), **{**ARGS, **args}))


@pytest.mark.parametrize("args", [{}, dict(dtype="bfloat16"), dict(quantization="int8")],
                         ids=["packed", "bf16-per-layer", "int8"])
def test_subsets_and_device_arrays(checkpoints, args, monkeypatch):
    """B's tensors in two halves (a fused projection's parts split across them), the second as jax.Arrays taken as
    an accelerator's are (converted with jax.numpy where they are, not read by numpy): the same as all at once; a
    one-layer subset changes only that layer's tensors."""
    from jaxpaged.worker import live_weights
    monkeypatch.setattr(live_weights, "_off_host", lambda x: isinstance(x, jax.Array))
    a, b = checkpoints["gemma3"]
    args = {**ARGS, **args}
    llm = LLM(model=str(a), **args)
    new = tensors(b)
    top = ["model.embed_tokens.weight", "model.norm.weight"]  # kept as they are (no transform): in the 2nd half
    names = sorted(set(new) - set(top))
    llm.update_weights({n: new[n] for n in names[::2]})
    second = {n: jnp.asarray(new[n]) for n in names[1::2] + top}
    llm.update_weights(second)
    for x in second.values():  # the caller's arrays are its own: the engine keeps none of them
        x.delete()
    assert greedy(llm) == greedy(LLM(model=str(b), **args))
    before = llm.get_weights()
    q = "model.layers.1.self_attn.q_proj.weight"
    llm.update_weights({q: np.ones_like(before[q])})
    after = llm.get_weights()
    np.testing.assert_allclose(after[q], np.ones_like(before[q]), rtol=1e-6)  # int8: 127 * (1 / 127)
    assert all(np.array_equal(after[n], before[n]) for n in before if n != q)


@pytest.mark.parametrize("args", [{}, dict(dtype="bfloat16"), dict(quantization="int8"), dict(quantization="fp8")],
                         ids=["packed", "bf16", "int8", "fp8"])
def test_get_weights_round_trip(checkpoints, args):
    """get_weights: the checkpoint's names and shapes (float32 values as loaded); update(get()) is the identity."""
    a, _ = checkpoints["qwen3"]
    llm = LLM(model=str(a), **{**ARGS, **args})
    got = llm.get_weights()
    stored = tensors(a)
    assert set(got) == set(stored) and all(got[n].shape == stored[n].shape for n in got)
    if not args:
        assert all(np.array_equal(got[n], stored[n]) for n in got)
    llm.update_weights(got)
    again = llm.get_weights()
    if args.get("quantization") == "fp8":  # a scale recomputed from its own dequantised channel: within an ulp
        for n in got:
            np.testing.assert_allclose(again[n], got[n], rtol=1e-6, atol=1e-8, err_msg=n)
    else:
        assert all(np.array_equal(again[n], got[n]) for n in got)


def _bad(names, shape_of):
    first, second = names[0], names[1]
    return [
        ({"model.layers.9.mlp.up_proj.weight": np.zeros(3, np.float32)}, "unknown parameter name"),
        ({first: np.zeros((1, 2), np.float32)}, "wrong shape"),
        ({first: np.zeros(shape_of[first], np.int32)}, "wrong shape or dtype"),
        ({second: np.zeros(shape_of[second], np.float32), first: np.full(shape_of[first], np.nan, np.float32)},
         "NaN or infinite"),
        ({first: jnp.full(shape_of[first], jnp.inf, jnp.bfloat16)}, "NaN or infinite"),
        ({first: "weights"}, "wrong shape or dtype"),
        ([("x", 1)], "must map"),
    ]


def test_bad_weights_change_nothing(checkpoints):
    a, _ = checkpoints["mistral"]
    llm = LLM(model=str(a), **ARGS)
    tokens, weights = greedy(llm), llm.get_weights()
    shapes = {n: s.shape for n, s in hf_slots(llm.llm_engine.model.config).items()}
    for bad, match in _bad(sorted(weights), shapes):
        with pytest.raises(WeightUpdateError, match=match):
            llm.update_weights(bad)
    now = llm.get_weights()
    assert all(np.array_equal(now[n], weights[n]) for n in weights)
    assert greedy(llm) == tokens


def test_any_float_dtype_is_cast(checkpoints):
    """bfloat16 host tensors into a float32 engine: the values bfloat16 holds."""
    a, b = checkpoints["qwen2"]
    llm = LLM(model=str(a), **ARGS)
    new = {n: x.astype(ml_dtypes.bfloat16) for n, x in tensors(b).items()}
    llm.update_weights(new)
    got = llm.get_weights()
    assert all(np.array_equal(got[n], new[n].astype(np.float32)) for n in new)


def test_update_mid_request_keeps_its_pages_out_of_the_cache(checkpoints):
    """A request running across the update finishes; its pages (KV partly from the old weights) are never cached,
    so the same prompt afterwards computes everything again and gets B's tokens."""
    a, b = checkpoints["mistral"]
    llm = LLM(model=str(a), **ARGS)
    engine = llm.llm_engine
    engine.add_request("running", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.has_unfinished_requests()
    llm.update_weights(tensors(b))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.pool.num_cached_pages == 0
    assert greedy(llm) == greedy(LLM(model=str(b), **ARGS))


def test_update_weights_from_disk(checkpoints, tmp_path):
    a, b = checkpoints["qwen3"]
    llm = LLM(model=str(a), **ARGS)
    llm.llm_engine.update_weights_from_disk(str(b))
    assert greedy(llm) == greedy(LLM(model=str(b), **ARGS))
    with pytest.raises(WeightUpdateError, match="lacks"):
        llm.llm_engine.update_weights_from_disk(str(checkpoints["qwen2"][0]))
    partial = tmp_path / "partial"
    shutil.copytree(a, partial)
    stored = tensors(a)
    save_file({n: x for n, x in stored.items() if "layers.0." not in n}, str(partial / "model.safetensors"))
    with pytest.raises(WeightUpdateError, match="lacks"):
        llm.llm_engine.update_weights_from_disk(str(partial))
    with pytest.raises(Exception, match="not a folder"):
        llm.llm_engine.update_weights_from_disk(str(tmp_path / "nowhere"))


def test_packed_weights_stay_packed(checkpoints):
    a, b = checkpoints["qwen2"]
    llm = LLM(model=str(a), **ARGS)
    llm.update_weights(tensors(b))
    layers = llm.llm_engine.runner.params["layers"]
    assert isinstance(layers["wqkv"], PackedWeight) and isinstance(layers["w_down"], PackedWeight)
    assert llm.llm_engine.model.params is llm.llm_engine.runner.params


# ----------------------------------------------------------------------------- sleep / wake


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wake_up_serves_the_same(checkpoints, level):
    """Level 1 deletes the KV pool's buffers, level 2 the weights' too; requests while asleep are refused (nothing
    queued); after wake_up the greedy tokens are those from before."""
    from jaxpaged.engine.weight_control import EngineSleepingError
    a, _ = checkpoints["qwen2"]
    llm = LLM(model=str(a), **ARGS)
    engine = llm.llm_engine
    tokens = greedy(llm)
    kv = jax.tree.leaves(engine.runner.kv)
    weights = [x for x in jax.tree.leaves(engine.runner.params) if isinstance(x, jax.Array)]
    expected = sum(x.nbytes for x in kv) + (sum(x.nbytes for x in weights) if level == 2 else 0)
    before = live_bytes()
    llm.sleep(level)
    assert all(x.is_deleted() for x in kv) and all(x.is_deleted() == (level == 2) for x in weights)
    assert before - live_bytes() >= expected
    assert engine.is_sleeping and engine.sleep_level == level
    with pytest.raises(EngineSleepingError, match="asleep"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep(1)
    if level == 2:
        with pytest.raises(EngineSleepingError, match="wake_up"):
            llm.update_weights({})
    llm.wake_up()
    assert not engine.is_sleeping
    with count_compiles() as compiles:
        assert greedy(llm) == tokens
    assert compiles == [], compiles


def test_sleep_update_wake_is_the_rl_cycle(checkpoints):
    """Asleep at level 1 (the trainer's step), update, wake: B's tokens."""
    a, b = checkpoints["qwen3"]
    llm = LLM(model=str(a), **ARGS)
    greedy(llm)
    llm.sleep(1)
    llm.update_weights(tensors(b))
    llm.wake_up()
    assert greedy(llm) == greedy(LLM(model=str(b), **ARGS))


def test_sleep_refuses_while_requests_are_unfinished(checkpoints):
    llm = LLM(model=str(checkpoints["qwen2"][0]), **ARGS)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match="unfinished requests"):
        llm.sleep(1)
    assert not engine.is_sleeping
    with pytest.raises(ValueError, match="choose 1"):
        engine.abort_request("r") or llm.sleep(3)
    assert not engine.is_sleeping and engine.runner.kv is not None


def test_on_a_tensor_parallel_mesh(checkpoints):
    """tp=2 over CPU devices: host and on-mesh (jax.numpy) updates equal a fresh B engine, every leaf keeps its
    sharding, no jit cache miss from the host update on, and sleep(2)/wake_up serves the same."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    a, b = checkpoints["qwen2"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    payload = {"a": str(a), "b": str(b), "tp": 2, "prompts": PROMPTS, "max_tokens": 8}
    proc = subprocess.run([sys.executable, "-m", "tests.live_weights_worker", json.dumps(payload)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT=")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT="):])
    assert result["host"] == result["device"] == result["after_wake"] == result["fresh_b"] != result["before"]
    assert result["device_back_to_a"] == result["before"]
    assert result["same_shardings"]
    assert result["host_misses"] == [], result["host_misses"]


def test_sleep_waits_for_the_step_left_in_flight(checkpoints):
    """Async scheduling: a request that stops on a token leaves the next step (its wasted slot) in flight after it
    finished; sleep waits for that step before deleting the pool it writes."""
    llm = LLM(model=str(checkpoints["qwen2"][0]), **ARGS)
    engine = llm.llm_engine
    assert engine.async_scheduling
    tokens = greedy(llm)
    stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[tokens[0][2]])
    engine.add_request("stops", {"prompt_token_ids": PROMPTS[0]}, stop)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._in_flight is not None
    llm.sleep(1)
    assert engine._in_flight is None
    llm.wake_up()
    assert greedy(llm) == tokens


def test_update_weights_from_a_broken_folder_changes_nothing(checkpoints, tmp_path):
    a, b = checkpoints["qwen2"]
    llm = LLM(model=str(a), **ARGS)
    tokens = greedy(llm)
    broken = tmp_path / "broken"
    shutil.copytree(b, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:len(data) // 2])  # truncated
    from jaxpaged.models.weights import WeightLoadError
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        llm.llm_engine.update_weights_from_disk(str(broken))
    assert greedy(llm) == tokens


def test_a_weight_form_it_does_not_convert_is_refused_before_anything_changes(checkpoints):
    """A leaf in another form (here: the final norm held as int8, as a quantised form the module does not know
    would be): a NotImplementedError naming it, no other leaf replaced."""
    llm = LLM(model=str(checkpoints["qwen2"][0]), **ARGS)
    runner = llm.llm_engine.runner
    weights = llm.get_weights()
    runner.params = dict(runner.params, final_norm=runner.params["final_norm"].astype(jnp.int8))
    before = jax.tree.leaves(runner.params)
    with pytest.raises(NotImplementedError, match="final_norm"):
        llm.update_weights(weights)
    assert all(x is y for x, y in zip(jax.tree.leaves(runner.params), before))
    with pytest.raises(NotImplementedError, match="final_norm"):
        llm.get_weights()

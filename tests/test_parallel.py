"""Tensor parallelism: shardings, tp = 1/2/4 (tiny GQA) and 3 (SmolLM2) agree, two-process serving.

The engine runs in subprocesses (tests/parallel_worker.py): JAX fixes its device
count at start-up, and this pytest process already runs JAX on one CPU device.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpaged.worker import parallel
from jaxpaged.config import EngineArgs
from jaxpaged.models.llama import LlamaConfig
from jaxpaged.models.params import WeightLayout, init_params, param_shapes
from jaxpaged.worker.weight_layout import to_weight_layout

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
SHARDED_AXIS = {"embed": 0, "lm_head": 1, "wq": 2, "wk": 2, "wv": 2, "wo": 1, "w_gate": 2, "w_up": 2, "w_down": 1,
                "wqkv": 2, "w_gate_up": 3}  # the last two: fused projections (the engine's default)


def run_worker(mode: str, payload: dict, devices: int = 8, timeout: int = 300, platform: str = "cpu") -> dict:
    """`devices` CPU devices; platform "gpu": the machine's GPUs instead."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": platform}
    proc = subprocess.run([sys.executable, "-m", "tests.parallel_worker", mode, json.dumps(payload)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    return _result(proc.returncode, proc.stdout, proc.stderr)


def _result(returncode: int, stdout: str, stderr: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT=")]
    assert returncode == 0 and lines, f"worker failed ({returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT="):])


@pytest.fixture(scope="module")
def gqa8(tiny_checkpoints) -> Path:
    return tiny_checkpoints["gqa8"]


@pytest.fixture(scope="module")
def tiny_tp(gqa8) -> dict:
    return run_worker("serve", {"model": str(gqa8), "tps": [1, 2, 4], "prompts": PROMPTS, "max_tokens": 8})


# ----------------------------------------------------------------------------- in-process units


def small_config(**overrides) -> LlamaConfig:
    base = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    return LlamaConfig(**{**base, **overrides})


def test_partition_specs_mirror_param_shapes():
    for tied in (False, True):
        config = small_config(tie_word_embeddings=tied)
        specs = parallel.param_partition_specs(config, 2)
        shapes = param_shapes(config)  # PartitionSpec is a tuple too: both trees stop at tuples
        assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, tuple)) == \
            jax.tree.structure(shapes, is_leaf=lambda x: isinstance(x, tuple))
        for name, axis in SHARDED_AXIS.items():
            spec = specs.get(name) or specs["layers"].get(name)
            if spec is None:
                assert (tied and name == "lm_head") or name in ("wqkv", "w_gate_up")  # fused: not this layout
                continue
            assert spec[axis] == parallel.TP and sum(a == parallel.TP for a in spec) == 1, (name, spec)


def test_partition_specs_of_every_weight_layout():
    """Fused and per-layer params get specs of their own structure: wqkv split on K (each device its kv heads
    with their query heads), w_gate_up on F; per-layer ones drop the L axis."""
    config = small_config()
    for layout in (WeightLayout(fused=True), WeightLayout(per_layer=True), WeightLayout(True, True)):
        specs = parallel.param_partition_specs(config, 2, layout)
        params = to_weight_layout(config, init_params(config, jax.random.PRNGKey(0)), layout)
        assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(params)
        layer = specs["layers"][0] if layout.per_layer else specs["layers"]
        lead = () if layout.per_layer else (None,)
        if layout.fused:
            assert layer["wqkv"] == P(*lead, None, parallel.TP, None, None)
            assert layer["w_gate_up"] == P(*lead, None, None, parallel.TP)
        else:
            assert layer["wq"] == P(*lead, None, parallel.TP, None)


@pytest.mark.parametrize("layout", ["stacked", "stacked unfused"])
def test_tp_agrees_in_other_weight_layouts(gqa8, tiny_tp, layout):
    """The stacked scan (fused) and the unfused stack, sharded at tp = 2 and 4, give tp = 1's tokens and logits
    (the default run, tiny_tp, is per-layer and fused on CPU)."""
    engine_args = {"weight_layout": "stacked"} if layout == "stacked" else {"weight_layout": "stacked", "fuse_projections": False}
    result = run_worker("serve", {"model": str(gqa8), "tps": [2, 4], "prompts": PROMPTS, "max_tokens": 8,
                                  "engine_args": engine_args})
    for tp in ("2", "4"):
        assert result[tp]["tokens"] == tiny_tp["1"]["tokens"], tp
        np.testing.assert_allclose(result[tp]["logits"], tiny_tp["1"]["logits"], atol=1e-4, rtol=0)
        for path, leaf in result[tp]["shards"].items():
            name = path.split("'")[-2]
            if name in SHARDED_AXIS:
                assert leaf["device_bytes"] == [leaf["bytes"] // int(tp)] * int(tp), path


def test_vocab_replicated_when_not_divisible():
    config = small_config(vocab_size=261)
    assert not parallel.vocab_sharded(config, 2)
    specs = parallel.param_partition_specs(config, 2)
    assert specs["embed"] == P(None, None) and specs["lm_head"] == P(None, None)
    assert specs["layers"]["wq"] == P(None, None, parallel.TP, None)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_invalid_tp_is_a_clear_error(tp):
    config = small_config(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    if tp == 3:
        parallel.check_tensor_parallel(config, tp)
        return
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp} must divide .*num_key_value_heads=3 "
                                         r"and num_attention_heads=9.*valid sizes for this model: \[1, 3\]"):
        parallel.check_tensor_parallel(config, tp)


def test_mesh_needs_enough_devices():
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        parallel.make_mesh(jax.device_count() + 1)


@pytest.mark.parametrize("fields, match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(num_processes=2), "distributed_coordinator"),
    (dict(num_processes=2, process_id=2, distributed_coordinator="localhost:1234"), "process_id"),
    (dict(num_processes=0), "num_processes"),
])
def test_engine_args_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="unused", **fields)


# ----------------------------------------------------------------------------- subprocess: 8 CPU devices


def test_tp2_async_scheduling_same_tokens(gqa8, tiny_tp):
    """One process, tp=2: the overlapped loop (placeholder tokens gathered on device 0, replicated onto the
    mesh) gives the synchronous tp=1 tokens."""
    result = run_worker("serve", {"model": str(gqa8), "tps": [2], "prompts": PROMPTS, "max_tokens": 8,
                                  "async_scheduling": True})
    assert result["2"]["tokens"] == tiny_tp["1"]["tokens"]


def test_tp_1_2_4_same_tokens_and_logits(tiny_tp):
    base = tiny_tp["1"]
    for tp in ("2", "4"):
        assert tiny_tp[tp]["tokens"] == base["tokens"]
        np.testing.assert_allclose(tiny_tp[tp]["logits"], base["logits"], atol=1e-4, rtol=0)


def _backends() -> list:
    """xla (the CPU default) always; the Pallas kernel (the GPU default) on a GPU, over its GPUs."""
    gpus = jax.device_count("gpu") if jax.default_backend() == "gpu" else 0
    return ["xla", pytest.param("pallas", marks=pytest.mark.skipif(not gpus, reason="the Pallas kernel needs a GPU"))]


@pytest.mark.parametrize("backend", _backends())
def test_tp_agrees_on_the_default_attention_backends(gqa8, tiny_tp, backend):
    """The sharded attention (shard_map per KV-head shard) with the backends the engine really runs: tp = 1, 2
    and 4 (as many as there are devices) give the reference backend's tokens and logits."""
    platform = "gpu" if backend == "pallas" else "cpu"
    tps = [1, 2, 4] if platform == "cpu" else [t for t in (1, 2, 4) if t <= jax.device_count("gpu")]
    result = run_worker("serve", {"model": str(gqa8), "tps": tps, "prompts": PROMPTS, "max_tokens": 8,
                                  "attention_backend": backend}, platform=platform)
    atol = 1e-4 if platform == "cpu" else 1e-2  # GPU f32 matmuls may round through TF32
    for tp in map(str, tps):
        assert result[tp]["tokens"] == tiny_tp["1"]["tokens"], tp
        np.testing.assert_allclose(result[tp]["logits"], tiny_tp["1"]["logits"], atol=atol, rtol=0)
        assert all(leaf["devices"] == int(tp) for leaf in result[tp]["shards"].values())


@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_holds_one_nth(tiny_tp, tp):
    report = tiny_tp[str(tp)]
    for path, leaf in report["shards"].items():
        name = path.split("'")[-2]
        assert leaf["devices"] == tp, path
        if name in SHARDED_AXIS:  # axes of the stacked layout; a per-layer weight has no leading L axis
            axis = SHARDED_AXIS[name] - bool(re.search(r"\['layers'\]\[\d+\]", path))
            expected = ["None"] * axis + ["'tp'"]
            assert leaf["spec"].startswith("P(" + ", ".join(expected)), (path, leaf["spec"])
            assert leaf["device_bytes"] == [leaf["bytes"] // tp] * tp, path
        else:  # norms: replicated
            assert leaf["spec"] == "P()" and leaf["device_bytes"] == [leaf["bytes"]] * tp, path
    assert report["kv_device_bytes"] == [report["kv_bytes"] // tp] * tp
    unsharded = tiny_tp["1"]["shards"]
    assert all(v["device_bytes"] == [v["bytes"]] for v in unsharded.values())


def test_smollm2_tp3_matches_tp1(smollm2_path):
    prompt = [1, 504, 3458, 282, 4649, 314, 4144, 30]
    result = run_worker("serve", {"model": str(smollm2_path), "tps": [1, 3], "prompts": [prompt], "max_tokens": 6})
    assert result["3"]["tokens"] == result["1"]["tokens"]
    np.testing.assert_allclose(result["3"]["logits"], result["1"]["logits"], atol=1e-3, rtol=0)
    wqkv = result["3"]["shards"]["['layers'][0]['wqkv']"]  # each device: 1 kv head, its 3 query heads, k and v
    assert wqkv["device_bytes"] == [wqkv["bytes"] // 3] * 3


def test_smollm2_tp2_is_a_clear_error(smollm2_path):
    result = run_worker("error", {"model": str(smollm2_path), "tp": 2})
    assert result["error"] and "tensor_parallel_size=2 must divide" in result["error"]
    assert "num_key_value_heads=3" in result["error"] and "num_attention_heads=9" in result["error"]


# ----------------------------------------------------------------------------- two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_serve_like_tp1(gqa8, tiny_tp):
    """jax.distributed on one machine: 2 processes x 1 CPU device, tp=2, gloo collectives. Async scheduling
    asked for: multi-process falls back to the synchronous loop (followers take each step from the host)."""
    payload = {"model": str(gqa8), "tp": 2, "prompts": PROMPTS, "max_tokens": 8,
               "coordinator": f"127.0.0.1:{_free_port()}", "num_processes": 2, "async_scheduling": True}
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel_worker", "multihost",
                               json.dumps({**payload, "process_id": i})], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    leader, follower = (_result(p.returncode, *out) for p, out in zip(procs, outs))
    assert leader["process_count"] == 2 and leader["devices"] == 2 and leader["local_devices"] == 1
    assert leader["tokens"] == tiny_tp["1"]["tokens"]
    assert follower["steps_followed"] > 0
    assert leader["async_scheduling"] is follower["async_scheduling"] is False

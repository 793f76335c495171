"""The step's weight layouts: same logits and pool in every layout, the conversion, and the HLO evidence
that the GPU default reads each weight in place (no per-layer weight slice or copy)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.worker import hlo_stats
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.worker.runner_config import (GPU_COMMAND_BUFFERS, RunnerConfig, command_buffer_options,
                                           gpu_compiler_options, packs_weights)
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.models.llama import LlamaConfig, forward_jit
from jaxpaged.models.params import WeightLayout, init_params, param_shapes
from jaxpaged.models.loader import load_model
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.worker.weight_layout import resolve_weight_layout, to_weight_layout
from pallas_kernels import cpu_matmul, cuda_compile

STACKED, PER_LAYER = WeightLayout(), WeightLayout(per_layer=True)
FUSED, PER_LAYER_FUSED = WeightLayout(fused=True), WeightLayout(per_layer=True, fused=True)
LAYOUTS = {"stacked": STACKED, "stacked+fused": FUSED, "per_layer": PER_LAYER, "per_layer+fused": PER_LAYER_FUSED}
# Sizes chosen so no activation of a one-token step has a layer weight's element count.
SMALL = LlamaConfig(vocab_size=200, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
CONFIG = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=16, num_pages=32,
                      attention_backend="xla", min_token_bucket=1)


def runner_config(layout: WeightLayout, **fields) -> RunnerConfig:
    return dataclasses.replace(CONFIG, weight_layout="per_layer" if layout.per_layer else "stacked",
                               fuse_projections=layout.fused, **fields)


def entry(rid, tokens, start, pages):
    return ScheduledRequest(rid, tuple(tokens), start, tuple(pages), True, SamplingParams(), start + len(tokens))


@pytest.fixture(scope="module")
def small_params():
    return init_params(SMALL, jax.random.PRNGKey(3))


def layer_weight_sizes(config: LlamaConfig) -> set[int]:
    """Element counts of one layer's weight matrices, fused or not."""
    shapes = {**param_shapes(config)["layers"], **param_shapes(config, fused=True)["layers"]}
    return hlo_stats.weight_sizes(shape[1:] for shape in shapes.values())


@pytest.mark.parametrize("variant", ["gqa4", "qwen2"])
def test_every_layout_gives_the_same_logits_and_pool(tiny_checkpoints, tmp_path_factory, variant):
    """Fused and per-layer weights (alone and together) give the checkpoint layout's logits and KV pool
    over a prefill then a decode, and the plain forward runs on fused stacked weights too. qwen2 has q/k/v
    biases; gqa4 two query heads per kv head (the fused wqkv groups them per kv head)."""
    if variant == "qwen2":
        from tests.models.tiny_families import make_family_checkpoint
        path = make_family_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")
    else:
        path = tiny_checkpoints[variant]
    model = load_model(str(path), dtype="float32")
    tokens = np.random.default_rng(0).integers(0, 256, size=21).tolist()
    results = {}
    for name, layout in LAYOUTS.items():
        runner = ModelRunner(model.config, model.params, runner_config(layout))
        assert runner.layout == layout and WeightLayout.of(runner.params) == layout
        runner.execute(runner.prepare([entry("a", tokens[:20], 0, [3, 7])]))
        logits = runner.execute(runner.prepare([entry("a", tokens[20:], 20, [3, 7])]))
        results[name] = (np.asarray(logits[0]), np.asarray(runner.kv.k), np.asarray(runner.kv.v))
    plain = forward_jit(model.config, model.params, jnp.asarray([tokens]))[0, -1]
    np.testing.assert_allclose(results["stacked"][0], np.asarray(plain), atol=1e-4)
    for name, got in results.items():
        for want_array, got_array in zip(results["stacked"], got):
            np.testing.assert_allclose(got_array, want_array, atol=1e-5, err_msg=name)
    fused = to_weight_layout(model.config, model.params, FUSED)
    np.testing.assert_allclose(np.asarray(forward_jit(model.config, fused, jnp.asarray([tokens]))[0, -1]),
                               np.asarray(plain), atol=1e-5)


def test_resolve_weight_layout():
    assert resolve_weight_layout("auto", True, "gpu") == PER_LAYER_FUSED
    assert resolve_weight_layout("auto", True, "cpu") == PER_LAYER_FUSED  # measured faster there too
    # weights packed for the native CPU matmul: the scan reads each layer of the packed stack in place
    assert resolve_weight_layout("auto", True, "cpu", packed=True) == FUSED
    assert resolve_weight_layout("per_layer", True, "cpu", packed=True) == PER_LAYER_FUSED
    assert packs_weights("auto", np.float32) == cpu_matmul.load_cpu_matmul()  # the default CPU engine
    assert not packs_weights("auto", jnp.bfloat16) and not packs_weights("auto", np.float32, sharded=True)
    assert not packs_weights("xla", np.float32) and not packs_weights("reference", np.float32)
    assert resolve_weight_layout("auto", False, "cpu") == PER_LAYER
    assert resolve_weight_layout("stacked", False, "cpu") == STACKED
    assert resolve_weight_layout("stacked", True, "cpu") == FUSED
    assert resolve_weight_layout("per_layer", False, "cpu") == PER_LAYER
    assert resolve_weight_layout("stacked", True, "gpu") == FUSED
    with pytest.raises(ValueError, match="weight_layout='unrolled'"):
        resolve_weight_layout("unrolled", True, "cpu")
    with pytest.raises(ValueError, match="weight_layout"):
        dataclasses.replace(CONFIG, weight_layout="scan")
    with pytest.raises(ValueError, match="weight_layout"):
        EngineArgs(model="unused", weight_layout="scan")


def test_conversion_shapes_ownership_and_refusals(small_params):
    """Fused shapes as documented; a caller's params stay usable unless consumed (consume deletes each
    source once converted); params already in the layout come back as they are; only the checkpoint
    layout converts."""
    layers = small_params["layers"]
    copy = jax.tree.map(jnp.copy, small_params)
    per_layer = to_weight_layout(SMALL, copy, PER_LAYER_FUSED)
    e, k, g, d, f = 48, 2, 2, 16, 80
    assert len(per_layer["layers"]) == 3 and per_layer["layers"][0]["wqkv"].shape == (e, k, g + 2, d)
    assert per_layer["layers"][2]["w_gate_up"].shape == (e, 2, f) and "wq" not in per_layer["layers"][0]
    np.testing.assert_array_equal(per_layer["layers"][1]["wqkv"][:, 1, g + 1], layers["wv"][1, :, 1])
    np.testing.assert_array_equal(per_layer["layers"][1]["wqkv"][:, 1, 1], layers["wq"][1, :, 1 * g + 1])
    np.testing.assert_array_equal(per_layer["layers"][2]["w_gate_up"][:, 1], layers["w_up"][2])
    assert not any(x.is_deleted() for x in jax.tree.leaves(copy))
    assert to_weight_layout(SMALL, per_layer, PER_LAYER_FUSED) is per_layer
    with pytest.raises(ValueError, match="only the checkpoint layout"):
        to_weight_layout(SMALL, per_layer, FUSED)
    consumed = to_weight_layout(SMALL, copy, PER_LAYER_FUSED, consume=True)
    assert all(x.is_deleted() for x in jax.tree.leaves(copy["layers"]))
    assert not any(x.is_deleted() for x in jax.tree.leaves(consumed))
    assert consumed["embed"] is copy["embed"]  # only layer weights change


def test_engine_runs_the_configured_layout_and_leaves_a_callers_params_usable(tiny_checkpoints):
    model = load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")
    args = EngineArgs(model="unused", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, num_pages=32,
                      compilation_cache_dir=None, warmup=False, weight_layout="per_layer")
    engine = LLMEngine(args, loaded=model)
    assert engine.runner.layout == PER_LAYER_FUSED and WeightLayout.of(engine.model.params) == PER_LAYER_FUSED
    assert engine.runner.params is engine.model.params  # one copy: the runner's
    assert not any(x.is_deleted() for x in jax.tree.leaves(model.params))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
    while engine.has_unfinished_requests():
        out = engine.step()
    stacked = LLMEngine(dataclasses.replace(args, weight_layout="stacked", fuse_projections=False), loaded=model)
    stacked.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
    while stacked.has_unfinished_requests():
        want = stacked.step()
    assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    # "auto": the engine converts to the layout its runner runs (they must agree, or the runner refuses
    # params already converted): on CPU a float32 model's packed weights stay stacked, a bfloat16 one's not
    auto = LLMEngine(dataclasses.replace(args, weight_layout="auto"), loaded=model)
    assert auto.runner.layout == (FUSED if packs_weights("auto", np.float32) else PER_LAYER_FUSED)
    auto.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
    while auto.has_unfinished_requests():
        got = auto.step()
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    half = load_model(str(tiny_checkpoints["gqa4"]), dtype="bfloat16")
    assert LLMEngine(dataclasses.replace(args, weight_layout="auto"), loaded=half).runner.layout == PER_LAYER_FUSED


# ----------------------------------------------------------------------------- HLO evidence


def compiled_step_text(params, layout: WeightLayout) -> str:
    runner = ModelRunner(SMALL, params, runner_config(layout))
    step = runner.prepare([entry("a", [11], 40, [3, 7, 9])])  # one decode token: T = 1
    return runner.lower(step).compile().as_text()


@pytest.mark.parametrize("name", LAYOUTS)
def test_compiled_cpu_step_reads_per_layer_weights_in_place(small_params, name):
    """The compiled CPU step writes no buffer of a layer weight's size (no dynamic slice or copy of a weight)
    with per-layer weights; the stacked scan slices every layer's weights out of the stack (the same check
    finds them: what the per-layer layout removes)."""
    layout = LAYOUTS[name]
    text = compiled_step_text(small_params, layout)
    copies = hlo_stats.weight_copies(text, layer_weight_sizes(SMALL))
    if layout.per_layer:
        assert copies == [], "\n".join(copies[:5])
    else:
        assert copies and any("dynamic-slice" in line or "fusion" in line for line in copies)


@pytest.mark.parametrize("layout", [PER_LAYER_FUSED, FUSED], ids=["gpu default", "stacked scan"])
def test_cuda_lowering_of_the_gpu_default_has_no_weight_slices(small_params, layout):
    """The step lowered for CUDA (from this CPU, the Pallas kernel as on a GPU) with the GPU's default
    layout holds no dynamic slice of a layer weight's size; the stacked scan's holds one per weight."""
    assert resolve_weight_layout("auto", RunnerConfig.fuse_projections, "gpu") == PER_LAYER_FUSED
    runner = ModelRunner(SMALL, small_params, runner_config(layout, attention_backend="pallas"))
    step = runner.prepare([entry("a", [11], 40, [3, 7, 9])])
    with cuda_compile.gpu_target():
        text = runner.lower(step, platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text  # the GPU step, with its attention kernel
    slices = hlo_stats.stablehlo_weight_slices(text, layer_weight_sizes(SMALL))
    if layout.per_layer:
        assert slices == [], "\n".join(slices[:5])
    else:
        assert len(slices) >= len(param_shapes(SMALL, fused=True)["layers"]) - 2  # norms are not matrices


def test_op_counts():
    text = """%copy.1 = f32[4]{0} copy(%p)
  %dynamic-slice.2 = f32[1,48]{1,0} dynamic-slice(%a, %i, %j)
  %fusion.3 = f32[4,8]{1,0} fusion(%x), kind=kCustom, calls=%f, custom_call_target="__cublas$lt$matmul"
  %while.4 = (s32[]) while(%t), condition=%c, body=%b
  %call.5 = f32[4]{0} call(%copy.1), to_apply=%layer_fn"""
    assert hlo_stats.op_counts(text) == {"copy": 1, "dynamic-slice": 1, "gemm": 1, "dot": 0, "fusion": 1,
                                         "while": 1, "call": 1}
    assert hlo_stats.weight_copies(text, {48, 32}) == [text.splitlines()[1].strip(), text.splitlines()[2].strip()]


# ----------------------------------------------------------------------------- command buffers


def test_command_buffer_options_are_gpu_only_and_accepted_by_xla(small_params):
    """The runner's command-buffer choices are XLA options this jaxlib parses (compiled here on CPU, where
    XLA:GPU options are parsed and ignored); off GPU the runner sets none."""
    assert gpu_compiler_options("full", "cpu") == {} and RunnerConfig.command_buffers == "auto"
    assert command_buffer_options("xla") == {} and command_buffer_options("off") == {
        "xla_gpu_enable_command_buffer": ""}
    assert command_buffer_options("auto") == command_buffer_options("full")
    runner = ModelRunner(SMALL, small_params, runner_config(PER_LAYER_FUSED))
    step = runner.prepare([entry("a", [11], 40, [3, 7, 9])])
    for choice in GPU_COMMAND_BUFFERS:
        runner.lower(step).compile(compiler_options=command_buffer_options(choice))
    with pytest.raises(ValueError, match="command_buffers"):
        dataclasses.replace(CONFIG, command_buffers="cuda_graphs")

"""FP8 weights: `--quantization fp8` and FP8 checkpoints (compressed-tensors float-quantized per channel / per tensor,
Hugging Face's fp8 with block scales), their accuracy against full precision, the bad inputs refused at
start-up, and the CUDA lowering's FP8 dots."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.config import EngineArgs
from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.models import fp8
from jaxpaged.models.llama import LlamaConfig, UnsupportedModelError
from jaxpaged.models.params import init_params, param_shapes
from jaxpaged.models.loader import load_model
from jaxpaged.models.quant_config import parse_quantization_config
from jaxpaged.models.weights import WeightLoadError
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker import hlo_stats
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.runner_config import RunnerConfig, fp8_gemm
from jaxpaged.worker.weight_layout import to_weight_layout
from pallas_kernels import cuda_compile
from tests.conftest import load_script

quant_accuracy = load_script("benchmarks/accuracy.py")  # the measures `accuracy.py quant` prints

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = quant_accuracy.PROMPTS[:4]
# (format, strategy, block): the checkpoints built below
CHECKPOINTS = {"ct-channel": ("compressed-tensors", "channel", None),
               "ct-tensor": ("compressed-tensors", "tensor", None),
               "hf-block128": ("fp8", "block", (128, 128)),
               "hf-block16x32": ("fp8", "block", (16, 32))}


# ----------------------------------------------------------------------------- a tiny model that predicts

# A random model's next-token distributions are near-uniform: its greedy answers hang on near-ties that any
# rounding flips, so greedy agreement measures the ties, not the quantisation. A tiny model trained for a few
# seconds to continue TRAIN_TEXT is confident where a language model is (its own text), and its answers test it.
TRAIN_TEXT = (
    "Jaxpaged serves language models on JAX. Its cache of keys and values is cut into pages, so memory is not "
    "wasted, and requests that share a prefix share its pages. The scheduler batches requests continuously: a "
    "new request joins the running batch at the next step, and a finished one leaves it at once. Each step is "
    "one compiled program over the donated pool of pages, padded to a bucket of token counts. ")
TRAINED_PROMPTS = [TRAIN_TEXT[i:i + 24] for i in (0, 60, 130, 200, 270, 330)]


def make_trained_checkpoint(folder: Path, variant: str = "gqa4", steps: int = 300) -> Path:
    """A tiny Llama (conftest's TINY_BASE and variant) trained to continue TRAIN_TEXT, saved like the others."""
    import torch
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_BASE, TINY_VARIANTS, tiny_tokenizer
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend
    model = LlamaForCausalLM(HFLlamaConfig(**{**TINY_BASE, **TINY_VARIANTS[variant]})).to(torch.float32)
    data = torch.tensor(list(TRAIN_TEXT.encode()) * 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        starts = torch.randint(0, len(TRAIN_TEXT), (8,))
        batch = torch.stack([data[s:s + 48] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    model.eval().save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The trained tiny model's folder and its full-precision answers and log-probs (the reference)."""
    path = make_trained_checkpoint(tmp_path_factory.mktemp("trained"))
    return path, _measures(str(path), None)


def _measures(path: str, quantization):
    return (quant_accuracy.greedy_answers(path, quantization, "float32", 48, TRAINED_PROMPTS),
            quant_accuracy.position_logprobs(path, quantization, "float32", TRAIN_TEXT))


def _within_bounds(reference, got) -> tuple[float, float]:
    agreement, kl = quant_accuracy.agreement(reference[0], got[0]), quant_accuracy.mean_kl(reference[1], got[1])
    assert agreement >= quant_accuracy.BOUNDS["agreement"] and kl < quant_accuracy.BOUNDS["kl"], (agreement, kl)
    return agreement, kl


# ----------------------------------------------------------------------------- FP8 checkpoints, built here


def _quantize_torch(w, strategy: str, block):
    """(q float8_e4m3fn [out, in], scale f32) of a torch weight [out, in] in the format's layout."""
    import torch
    w = w.float()
    if strategy == "tensor":
        scale = (w.abs().max() / 448.0).reshape(1)
        full = scale
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # [out, 1]
        full = scale
    else:
        b0, b1 = block
        n0, n1 = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
        padded = torch.zeros(n0 * b0, n1 * b1)
        padded[:w.shape[0], :w.shape[1]] = w.abs()
        scale = padded.reshape(n0, b0, n1, b1).amax(dim=(1, 3)) / 448.0  # [n0, n1]
        full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:w.shape[0], :w.shape[1]]
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def make_fp8_checkpoint(src: Path, dst: Path, fmt: str, strategy: str, block=None, edit=None) -> Path:
    """`src` (a float32 checkpoint) with its layers' linear weights stored as float8_e4m3fn and their scales, in
    `fmt`'s layout and config.json. edit(tensors) may break the tensors (bad-input tests)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    scale_name = "weight_scale" if fmt == "compressed-tensors" else "weight_scale_inv"
    for name in [n for n in tensors if n.endswith(".weight") and any(p in n for p in LINEAR)]:
        tensors[name], tensors[name.removesuffix("weight") + scale_name] = _quantize_torch(tensors[name], strategy,
                                                                                           block)
    if edit is not None:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    if fmt == "compressed-tensors":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False,
                            "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                      "symmetric": True}}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_fp8_checkpoint_loads_and_generates_like_full_precision(name, trained, tmp_path):
    """Each format loads as it is (detected from config.json), its weights the checkpoint's q times its scales
    (within e4m3's rounding of the original), and the engine serves it with FP8 weight dots: greedy answers and
    next-token distributions within the issue's bounds of the full-precision model's."""
    fmt, strategy, block = CHECKPOINTS[name]
    source, reference = trained
    path = make_fp8_checkpoint(source, tmp_path / name, fmt, strategy, block)
    loaded, full = load_model(str(path), dtype="float32"), load_model(str(source), dtype="float32")
    assert (loaded.quantization.format, loaded.quantization.strategy) == (fmt, strategy)
    for key in ("wq", "w_down"):  # dequantised: within e4m3's rounding (3 mantissa bits) of the original
        w, want = np.asarray(loaded.params["layers"][key]), np.asarray(full.params["layers"][key])
        assert np.max(np.abs(w - want)) <= np.max(np.abs(want)) / 16 and not np.array_equal(w, want)
    np.testing.assert_array_equal(loaded.params["embed"], full.params["embed"])  # not quantised
    _within_bounds(reference, _measures(str(path), None))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_checkpoint_values_come_back_as_stored(strategy, tiny_checkpoints, tmp_path):
    """A per-channel or per-tensor checkpoint's weights, loaded and quantised per channel again as the engine
    serves them, are the stored values (q times its scale): no second rounding."""
    from safetensors import safe_open
    from jaxpaged.models.fp8_checkpoint import read_raw_f8
    path = make_fp8_checkpoint(tiny_checkpoints["gqa4"], tmp_path / strategy, "compressed-tensors", strategy)
    loaded = load_model(str(path), dtype="float32")
    q, scale = fp8.quantize_weight(loaded.params["layers"]["w_down"][0])  # [E, F], [E]: down_proj's [out, in]
    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        stored_scale = f.get_tensor(name + "_scale")
    stored = read_raw_f8(path / "model.safetensors", name).astype(np.float32) * stored_scale
    np.testing.assert_allclose(np.asarray(fp8.dequantize(q, scale)).T, stored, rtol=1e-6, atol=0)


def test_quantization_fp8_accuracy(trained, caplog):
    """--quantization fp8 on full-precision weights keeps the trained tiny model within the issue's bounds (greedy
    agreement, KL, the lm-eval task's loglikelihood); the start-up log names the weight-only path this CPU runs."""
    path, reference = trained
    with caplog.at_level(logging.INFO, logger="jaxpaged.engine.llm_engine"):
        _within_bounds(reference, _measures(str(path), "fp8"))
    assert "weight dots fp8 (weight-only" in caplog.text
    # the local lm-eval task's loglikelihoods (lm-eval's split), summed: within 1%
    want, got = (quant_accuracy.task_loglikelihoods(str(path), q, "float32") for q in (None, "fp8"))
    assert abs(got.sum() - want.sum()) < quant_accuracy.BOUNDS["loglikelihood"] * abs(want.sum())
    assert not np.array_equal(got, want)


@pytest.mark.parametrize("variant", ["tied", "qwen3", "gemma3"])
def test_quantization_fp8_on_tiny_families(variant, tiny_checkpoints, tmp_path_factory):
    """The families' FP8 paths (tied embeddings, q/k norms, GeGLU and sandwich norms): next-token distributions
    within the KL bound of full precision's over a held-out text (their random weights' greedy answers hang on
    near-ties: see TRAIN_TEXT)."""
    if variant == "tied":
        path = str(tiny_checkpoints[variant])
    else:
        from tests.models.tiny_families import make_family_checkpoint
        path = str(make_family_checkpoint(tmp_path_factory.mktemp(variant), variant))
    reference = quant_accuracy.position_logprobs(path, None, "float32")
    got = quant_accuracy.position_logprobs(path, "fp8", "float32")
    assert 0 < quant_accuracy.mean_kl(reference, got) < quant_accuracy.BOUNDS["kl"]


# ----------------------------------------------------------------------------- bad input


def _break(kind):
    def edit(tensors):
        name = "model.layers.1.self_attn.k_proj.weight_scale"
        if kind == "missing":
            del tensors[name]
        elif kind == "misshaped":
            tensors[name] = tensors[name][:3]
        elif kind == "zero":
            tensors[name] = tensors[name] * 0
    return edit


@pytest.mark.parametrize("kind, message", [("missing", "has no model.layers.1.self_attn.k_proj.weight_scale"),
                                           ("misshaped", r"must be \[16, 1\], got \[3, 1\]"),
                                           ("zero", "not positive finite")])
def test_bad_scales_fail_at_load(kind, message, tiny_checkpoints, tmp_path):
    path = make_fp8_checkpoint(tiny_checkpoints["gqa4"], tmp_path / kind, "compressed-tensors", "channel",
                               edit=_break(kind))
    with pytest.raises(WeightLoadError, match=message):
        load_model(str(path), dtype="float32")


def test_misshaped_block_scales_fail_at_load(tiny_checkpoints, tmp_path):
    def edit(tensors):
        name = "model.layers.0.mlp.up_proj.weight_scale_inv"
        tensors[name] = tensors[name][:1]
    path = make_fp8_checkpoint(tiny_checkpoints["gqa4"], tmp_path / "block", "fp8", "block", (16, 32), edit=edit)
    with pytest.raises(WeightLoadError, match=r"up_proj.weight: block scales \(16 x 32\).*must be \[8, 2\]"):
        load_model(str(path), dtype="float32")


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "format='pack-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}},
     "weight strategy 'group' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
])
def test_unknown_formats_are_refused_by_name(qc, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_quantization_config({"quantization_config": qc})


def test_unknown_format_fails_at_load(tiny_checkpoints, tmp_path):
    path = shutil.copytree(tiny_checkpoints["gqa4"], tmp_path / "awq")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(UnsupportedModelError, match="'awq'"):
        load_model(str(path), dtype="float32")


def test_parsed_schemes():
    assert parse_quantization_config({}) is None
    hf = parse_quantization_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                            "activation_scheme": "dynamic"}})
    assert (hf.format, hf.strategy, hf.block_size, hf.scale_name) == ("fp8", "block", (128, 128), "weight_scale_inv")
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    ct = parse_quantization_config({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": kv, "ignore": ["lm_head"],
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}}})
    assert (ct.strategy, ct.scale_name, ct.ignore, ct.kv_cache_scheme) == ("tensor", "weight_scale", ("lm_head",), kv)


def test_fp8_checkpoint_on_a_mesh_is_refused(tiny_checkpoints, tmp_path):
    """An FP8 checkpoint with tensor parallelism: a clear error when the engine resolves its quantisation, before
    the KV pool or any step exists (a one-device "tp" mesh stands for any: the rule is the mesh's)."""
    from jaxpaged.config import resolve_quantization
    from jaxpaged.worker.parallel import make_mesh
    path = make_fp8_checkpoint(tiny_checkpoints["gqa4"], tmp_path / "ct", "compressed-tensors", "channel")
    loaded = load_model(str(path), dtype="float32")
    assert resolve_quantization(EngineArgs(model=str(path)), loaded, None) == "fp8"
    with pytest.raises(ValueError, match="FP8 checkpoint .* not supported with tensor parallelism"):
        resolve_quantization(EngineArgs(model=str(path)), loaded, make_mesh(1))


def test_fp8_where_it_cannot_run():
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        EngineArgs(quantization="fp8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="runs on \\('cpu', 'gpu'\\) backends, not 'tpu'"):
        fp8_gemm("tpu")
    with pytest.raises(ValueError, match="fuse_projections=True"):
        RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=16, num_pages=32,
                     quantization="fp8", fuse_projections=False)
    with pytest.raises(ValueError, match="fuse_projections=True"):
        EngineArgs(quantization="fp8", fuse_projections=False)
    with pytest.raises(ValueError, match="choose one of \\('fp8', 'int8', 'w8a8'\\)"):
        EngineArgs(quantization="fp4")


# ----------------------------------------------------------------------------- the dots and their lowering


@pytest.mark.parametrize("gemm", [False, True], ids=["weight-only", "fp8 gemm"])
def test_fp8_dot_matches_its_reference(gemm):
    """fp8_dot against the dequantised float32 matmul (reference_dot); a zero row (padding) stays zero."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(96, 40)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(5, 96)).astype(np.float32)).at[4].set(0.0)
    q, scale = fp8.quantize_weight(w)
    weight = fp8.Fp8Weight(q, scale, (96, 40), gemm)
    got, want = np.asarray(weight.dot(x)), np.asarray(fp8.reference_dot(x, weight))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not np.any(got[4])
    exact = np.asarray(x @ w)  # the quantisation's own error: a few % of the outputs' scale
    assert np.max(np.abs(got - exact)) < 0.1 * np.max(np.abs(exact))


SMALL = LlamaConfig(vocab_size=200, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
_RESULT = re.compile(r"->\s*tensor<([\dx]+)x(f32|bf16|f16)>")
_F8_DOT = re.compile(r"stablehlo\.dot_general .*\(tensor<[\dx]+xf8E4M3FN>, tensor<[\dx]+xf8E4M3FN>\)")


def test_cuda_lowering_has_fp8_dots_and_no_dequantised_weight():
    """The step lowered for CUDA from this CPU with --quantization fp8 in its GPU form: every weight dot a
    dot_general on float8_e4m3fn operands (what XLA:GPU makes a cuBLASLt FP8 gemm), and no op of the program
    producing a float tensor of a layer weight's size (no dequantised copy of a weight)."""
    params = init_params(SMALL, jax.random.PRNGKey(0))
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=16, num_pages=32,
                          attention_backend="pallas", min_token_bucket=1, quantization="fp8")
    runner = ModelRunner(SMALL, params, config)
    gpu_params = fp8.quantize_params(to_weight_layout(SMALL, params, runner.layout), gemm=True)
    step = runner.prepare([ScheduledRequest("a", (11,), 40, (3, 7, 9), True, SamplingParams(), 41)])
    with cuda_compile.gpu_target():
        text = runner.lower(step, params=gpu_params, platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text  # the GPU step, with its attention kernel
    # wqkv, wo, w_gate_up, w_down in the one traced layer the step calls per layer (model_runner's per-layer loop)
    assert len(_F8_DOT.findall(text)) == 4
    sizes = hlo_stats.weight_sizes(shape[1:] for shape in param_shapes(SMALL, fused=True)["layers"].values())
    dequantised = [line.strip() for line in text.splitlines() if (m := _RESULT.search(line))
                   and np.prod([int(d) for d in m.group(1).split("x")]) in sizes]
    assert dequantised == [], "\n".join(dequantised[:5])
    # the weight-only form this CPU runs has no FP8 dot: its weights are upcast for XLA:CPU's
    cpu_runner = ModelRunner(SMALL, params, dataclasses.replace(config, attention_backend="xla"))
    cpu_text = cpu_runner.lower(step).as_text()
    assert not _F8_DOT.findall(cpu_text) and "f8E4M3FN" in cpu_text

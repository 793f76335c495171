"""kv_cache_dtype="fp8" end to end: the engine's step over e4m3 pages equals a plain forward whose keys and values
are rounded the same way; the pool's size and start-up log; the scales (checkpoint or calibration) and their
checks; prefix caching over fp8 pages; the accuracy bounds on a small SmolLM2 case."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.models.kv_scales import KVScaleError, read_kv_scales
from jaxpaged.models.llama import causal_attention, decoder_layer, embed_tokens, layer_constants, lm_logits, rope_tables
from jaxpaged.models.loader import load_model
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.kv_scales import (
    CALIBRATION_TEXT,
    HEADROOM,
    calibrate_kv_scales,
    check_kv_scales,
    resolve_kv_scales,
)
from jaxpaged.worker.runner_config import check_fp8_kv_support, compute_capability, resolve_kv_cache_dtype
from tests.conftest import load_script

accuracy = load_script("benchmarks/accuracy.py")  # accuracy.py kv-fp8's measures

BASE = EngineArgs(model="unused", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_pages=100,
                  compilation_cache_dir=None, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")


def run_all(engine, prompts, params=GREEDY):
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages
    return [done[str(i)] for i in range(len(prompts))]


def fp8_rounded_forward(config, params, token_ids, k_scale, v_scale):
    """Plain causal forward (token_ids [1, T]) with every key and value rounded as the pool stores them: divided by
    its layer and head's scale, clamped to +-448, to e4m3 (ml_dtypes, on the host), times the scale."""
    cos_t, sin_t = rope_tables(config, jnp.arange(token_ids.shape[1], dtype=jnp.int32))
    consts, h = layer_constants(config), embed_tokens(params, token_ids, config)
    for i in range(config.num_hidden_layers):
        p = jax.tree.map(lambda x, i=i: x[i], params["layers"])
        c = jax.tree.map(lambda x, i=i: x[i], consts)

        def attend(q, k, v, i=i, c=c):
            def rounded(x, scale):
                s = np.asarray(scale[i], np.float32)[:, None]
                e = np.clip(np.asarray(x, np.float32) / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
                return jnp.asarray(e.astype(np.float32) * s)
            return causal_attention(q, rounded(k, k_scale), rounded(v, v_scale), config.attn_scale, c["window"]), None

        h, _ = decoder_layer(config, p, h, cos_t[c["rope"]], sin_t[c["rope"]], attend)
    return lm_logits(config, params, h)


def greedy_rounded(config, params, prompt, n, k_scale, v_scale):
    ids = list(prompt)
    for _ in range(n):
        logits = fp8_rounded_forward(config, params, jnp.asarray([ids], jnp.int32), k_scale, v_scale)
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt):]


@pytest.mark.parametrize("backend", ["cpu", "xla", "reference"])
def test_fp8_engine_equals_the_forward_over_its_rounded_keys_and_values(tiny, backend):
    """Greedy tokens of an fp8-KV engine (prefill chunks, decodes, a page boundary) are the plain forward's over
    keys and values rounded to e4m3 with the engine's own scales, on every CPU attention backend."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 16, 17, 40)]
    engine = LLMEngine(dataclasses.replace(BASE, kv_cache_dtype="fp8", attention_backend=backend), loaded=tiny)
    kv = engine.runner.kv
    assert kv.k.dtype == jnp.uint8 and engine.runner.kv_dtype == jnp.float8_e4m3fn
    k_scale, v_scale = np.asarray(kv.k_scale), np.asarray(kv.v_scale)
    assert k_scale.shape == v_scale.shape == (tiny.config.num_hidden_layers, tiny.config.num_key_value_heads)
    got = run_all(engine, prompts)
    for prompt, tokens in zip(prompts, got):
        assert tokens == greedy_rounded(tiny.config, tiny.params, prompt, GREEDY.max_tokens, k_scale, v_scale)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_fp8_step_writes_and_reads_the_pool_in_place(tiny, backend):
    """The compiled CPU step has no convert or copy of a pool-sized array: XLA:CPU would convert a whole float8
    pool around each write and read (why the pool holds bytes: pallas_kernels/kv_quant.py)."""
    import re

    from jaxpaged.core.scheduler_output import ScheduledRequest
    from jaxpaged.worker.model_runner import ModelRunner
    from jaxpaged.worker.runner_config import RunnerConfig
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, page_size=16, num_pages=40,
                          attention_backend=backend, kv_cache_dtype="fp8")
    ones = np.ones((tiny.config.num_hidden_layers, tiny.config.num_key_value_heads), np.float32)
    runner = ModelRunner(tiny.config, tiny.params, config, kv_scales=(ones, ones))
    step = runner.prepare([ScheduledRequest("a", (1, 2), 0, (1,), True, GREEDY, 2)])
    text = runner.lower(step).compile().as_text()
    result = re.compile(r"= \w+\[([\d,]+)\]\S* (?:convert|copy|bitcast-convert)\(")
    pool_sized = [line for line in text.splitlines() if (m := result.search(line))
                  and np.prod([int(d) for d in m.group(1).split(",")]) == runner.kv.k.size]
    assert pool_sized == []


def test_calibrated_scales_follow_the_heads_range(tiny):
    """Calibration: HEADROOM x max |k| (|v|) / 448 per layer and KV head, max over a plain forward of the text."""
    ids = np.asarray(tiny.tokenizer.encode(CALIBRATION_TEXT), np.int32)
    k_scale, v_scale = calibrate_kv_scales(tiny.config, tiny.params, ids)
    seen = []
    cos_t, sin_t = rope_tables(tiny.config, jnp.arange(len(ids), dtype=jnp.int32))
    h = embed_tokens(tiny.params, jnp.asarray(ids)[None], tiny.config)
    for i in range(tiny.config.num_hidden_layers):
        p = jax.tree.map(lambda x, i=i: x[i], tiny.params["layers"])

        def attend(q, k, v):
            seen.append((np.abs(np.asarray(k)).max(axis=(0, 1, 3)), np.abs(np.asarray(v)).max(axis=(0, 1, 3))))
            return causal_attention(q, k, v, tiny.config.attn_scale), None

        h, _ = decoder_layer(tiny.config, p, h, cos_t[0], sin_t[0], attend)
    np.testing.assert_allclose(k_scale, HEADROOM * np.stack([k for k, _ in seen]) / 448, rtol=1e-5)
    np.testing.assert_allclose(v_scale, HEADROOM * np.stack([v for _, v in seen]) / 448, rtol=1e-5)


def test_a_model_without_a_tokenizer_calibrates_on_seeded_ids(tiny):
    """Random weights for a benchmark have no tokenizer: calibration runs on 512 seeded random ids, the same
    ones each start (so two engines over the same weights get the same scales)."""
    scales = [resolve_kv_scales(tiny.config, tiny.params, jnp.float8_e4m3fn, tiny.source, None)
              for _ in range(2)]
    ids = np.random.default_rng(0).integers(0, tiny.config.vocab_size, 512, dtype=np.int32)
    ids = ids[: tiny.config.max_position_embeddings]
    for got in scales:
        for have, want in zip(got, calibrate_kv_scales(tiny.config, tiny.params, ids)):
            np.testing.assert_array_equal(have, want)


def test_fp8_pool_holds_twice_bf16_tokens_and_the_log_says_so(tiny, caplog):
    """At the same kv_cache_memory an fp8 pool has 2x the pages of a bf16 one (4x float32's); the ready line names
    the dtype and the token capacity."""
    pages = {}
    for kv in ("bfloat16", "float32", "fp8_e4m3"):
        with caplog.at_level(logging.INFO, logger="jaxpaged.engine.llm_engine"):
            engine = LLMEngine(dataclasses.replace(BASE, kv_cache_dtype=kv, num_pages=None, kv_cache_memory=1 << 22),
                               loaded=tiny)
        pages[kv] = engine.runner_config.num_pages
    per_token = 2 * tiny.config.num_hidden_layers * tiny.config.num_key_value_heads * tiny.config.head_dim
    assert pages["fp8_e4m3"] == (1 << 22) // (per_token * 16) == 2 * pages["bfloat16"] == 4 * pages["float32"]
    ready = [r.getMessage() for r in caplog.records if "ready" in r.getMessage()][-1]
    assert f"= {(pages['fp8_e4m3'] - 1) * 16} tokens (float8_e4m3fn)" in ready


def _with_scales(src: Path, dst: Path, tensors: dict[str, np.ndarray]) -> Path:
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    save_file({**weights, **tensors}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_checkpoint_scales_are_read_and_used(tiny_checkpoints, tmp_path):
    """compressed-tensors' per-layer self_attn.k_scale / v_scale (per tensor here, per head there) become the pool's
    scales; ModelOpt's k_proj.k_scale names read the same; the engine's tokens are the rounded forward's."""
    src = tiny_checkpoints["gqa4"]
    scales = {"model.layers.0.self_attn.k_scale": np.asarray(0.05, np.float32),
              "model.layers.0.self_attn.v_scale": np.asarray([0.002], np.float32),
              "model.layers.1.self_attn.k_proj.k_scale": np.asarray([0.03, 0.04], np.float32),
              "model.layers.1.self_attn.v_proj.v_scale": np.asarray([0.003, 0.001], np.float32)}
    loaded = load_model(str(_with_scales(src, tmp_path / "scaled", scales)), dtype="float32")
    engine = LLMEngine(dataclasses.replace(BASE, kv_cache_dtype="fp8"), loaded=loaded)
    want_k = [[0.05, 0.05], [0.03, 0.04]]
    want_v = [[0.002, 0.002], [0.003, 0.001]]
    np.testing.assert_array_equal(np.asarray(engine.runner.kv.k_scale), np.float32(want_k))
    np.testing.assert_array_equal(np.asarray(engine.runner.kv.v_scale), np.float32(want_v))
    prompt = list(range(30, 60))
    assert run_all(engine, [prompt]) == [greedy_rounded(loaded.config, loaded.params, prompt, GREEDY.max_tokens,
                                                        np.float32(want_k), np.float32(want_v))]
    assert read_kv_scales(src, loaded.config) is None  # no scales stored: calibration's turn


@pytest.mark.parametrize("bad, match", [
    ({"model.layers.0.self_attn.k_scale": np.asarray(0.0, np.float32)}, "finite and > 0"),
    ({"model.layers.0.self_attn.k_scale": np.asarray(-0.1, np.float32)}, "finite and > 0"),
    ({"model.layers.0.self_attn.v_scale": np.asarray(np.nan, np.float32)}, "finite and > 0"),
    ({"model.layers.0.self_attn.v_scale": np.asarray(np.inf, np.float32)}, "finite and > 0"),
    ({"model.layers.0.self_attn.k_scale": np.ones(3, np.float32)}, r"shape \[3\]"),
    ({"model.layers.0.self_attn.k_scale": np.ones((2, 1), np.float32)}, r"shape \[2, 1\]"),
    ({"model.layers.1.self_attn.k_scale": None}, "not k of layer 1"),
])
def test_bad_checkpoint_scales_fail_at_start_up(tiny_checkpoints, tmp_path, bad, match):
    good = {f"model.layers.{i}.self_attn.{kind}_scale": np.asarray(0.01, np.float32) for i in (0, 1)
            for kind in "kv"}
    tensors = {name: value for name, value in {**good, **bad}.items() if value is not None}
    loaded = load_model(str(_with_scales(tiny_checkpoints["gqa4"], tmp_path / "bad", tensors)), dtype="float32")
    with pytest.raises(KVScaleError, match=match):
        LLMEngine(dataclasses.replace(BASE, kv_cache_dtype="fp8"), loaded=loaded)
    LLMEngine(dataclasses.replace(BASE, kv_cache_dtype="float32"), loaded=loaded)  # a float pool reads none


def test_runner_scales_are_checked(tiny):
    config = tiny.config
    fp8 = resolve_kv_cache_dtype("fp8", np.float32, "cpu")
    ones = np.ones((config.num_hidden_layers, config.num_key_value_heads), np.float32)
    with pytest.raises(ValueError, match="needs its scales"):
        check_kv_scales(config, fp8, None)
    with pytest.raises(ValueError, match="expected"):
        check_kv_scales(config, fp8, (ones[:1], ones))
    with pytest.raises(ValueError, match="finite and > 0"):
        check_kv_scales(config, fp8, (ones, -ones))
    with pytest.raises(ValueError, match="for an fp8"):
        check_kv_scales(config, np.float32, (ones, ones))
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineArgs(model="unused", kv_cache_dtype="fp8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="choose one of"):
        EngineArgs(model="unused", kv_cache_dtype="fp8_e5m2")


def test_prefix_caching_over_fp8_pages(tiny):
    """Eight prompts sharing a 200-token prefix: its pages are shared (hits counted) and every answer equals the
    same engine's without prefix caching."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 256, size=200).tolist()
    prompts = [prefix + rng.integers(0, 256, size=20).tolist() for _ in range(8)]
    args = dataclasses.replace(BASE, kv_cache_dtype="fp8", max_model_len=256, num_pages=200)
    cached = LLMEngine(args, loaded=tiny)
    got = run_all(cached, prompts[:1]) + run_all(cached, prompts[1:])
    assert cached.scheduler.pool.prefix_cache_hits >= 7 * 12 * 16
    plain = LLMEngine(dataclasses.replace(args, enable_prefix_caching=False), loaded=tiny)
    assert got == run_all(plain, prompts)



def test_smollm2_fp8_kv_accuracy_bounds(smollm2):
    """The issue's accuracy measures on a small case (the full table: benchmarks/accuracy.py kv-fp8). The mean
    next-token KL over held-out text fed in chunks (later chunks read fp8 pages) meets the target, < 0.02. The
    greedy share does not: the target is >= 60% of a 48-token answer identical to the float KV's, measured
    0.47-0.56 over 32 chats in three runs and 0.46-0.59 on these four (a miss, reported as one in docs/serving.md; one
    near-tie flipped changes the rest of an answer, so an ulp of difference in a scale moves it). Asserted here
    is a floor under that, 0.25: a broken cache diverges within the first tokens."""
    latency = load_script("benchmarks/latency.py")
    GROUNDED, chat_ids = latency.GROUNDED, latency.chat_ids
    shares = accuracy.greedy_agreement(smollm2, chat_ids(smollm2.tokenizer, GROUNDED[:4]), 48)
    kl = accuracy.kv_mean_kl(smollm2, smollm2.tokenizer(accuracy.KV_HELD_OUT)["input_ids"][:96], 32)
    print(f"greedy identical share {np.mean(shares):.3f} ({shares}), mean KL {kl:.5f}")
    assert 0 < kl < 0.02
    assert np.mean(shares) >= 0.25


def test_fp8_pages_under_the_pallas_kernel_need_an_ada_or_newer_gpu():
    ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.6", device_kind="NVIDIA A100")
    with pytest.raises(ValueError, match="capability >= 8.9 .*NVIDIA A100 is 8.6"):
        check_fp8_kv_support(jnp.float8_e4m3fn, "pallas", device=ampere)
    check_fp8_kv_support(jnp.float8_e4m3fn, "xla", device=ampere)  # XLA's path converts e4m3 anywhere
    check_fp8_kv_support(jnp.float32, "pallas", device=ampere)
    check_fp8_kv_support(jnp.float8_e4m3fn, "pallas", device=types.SimpleNamespace(
        platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200"))
    assert compute_capability(types.SimpleNamespace(compute_capability="8.9")) == (8, 9)
    assert compute_capability(jax.devices("cpu")[0]) is None

"""Model runner: buckets, exact step packing, paged forward == plain forward, KV pool sizing."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.worker import hlo_stats
from jaxpaged.worker import parallel
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.worker.runner_config import (CPU_COMPILER_OPTIONS, CPU_SMALL_STEP_OPTIONS, CPU_SMALL_STEP_TOKENS,
                                           RunnerConfig, build_native_kernels, cpu_compiler_options,
                                           resolve_kv_cache_dtype)
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.step_input import kv_bytes_per_page
from jaxpaged.worker.step_program import paged_forward
from jaxpaged.models.llama import forward_jit
from jaxpaged.models.params import WeightLayout, unstack_layers
from jaxpaged.models.weight_dots import PackedWeight
from jaxpaged.models.loader import load_model
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pallas_kernels import cpu_build, cpu_matmul

CONFIG = RunnerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128, page_size=16, num_pages=32,
                      attention_backend="reference")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")


def entry(rid, tokens, start, pages, samples=True):
    return ScheduledRequest(rid, tuple(tokens), start, tuple(pages), samples, SamplingParams(), start + len(tokens))


def test_buckets():
    assert CONFIG.token_buckets == (16, 32, 64)
    assert CONFIG.seq_buckets == (4, 16)
    assert CONFIG.page_buckets == (8,)
    assert CONFIG.bucket_for(17, 5, 3) == (32, 16, 8)
    wide = dataclasses.replace(CONFIG, max_model_len=2048, max_num_batched_tokens=512, max_num_seqs=64)
    assert wide.page_buckets == (8, 16, 32, 64, 128)
    assert wide.seq_buckets == (4, 16, 64)
    assert (16, 64, 8) not in wide.buckets and (64, 64, 8) in wide.buckets and (32, 64, 8) in wide.buckets
    small = dataclasses.replace(CONFIG, min_token_bucket=1)
    assert small.token_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert [(t, s) for t, s, _ in small.buckets] == [(1, 4), (2, 4), (4, 4), (8, 4), (8, 16), (16, 4), (16, 16),
                                                     (32, 4), (32, 16), (64, 4), (64, 16)]
    # every shape bucket_for can produce is compiled at warm-up
    assert {small.bucket_for(t, s, 1) for t in range(1, 65) for s in range(1, min(t, 16) + 1)} <= set(small.buckets)
    assert dataclasses.replace(CONFIG, attention_backend="pallas").page_buckets == (8,)
    # on GPU-like buckets (T from 16) a step of <= 4 tokens over <= 4 slots gets T = S = 4
    assert CONFIG.decode_seq_buckets == (4,) and small.decode_seq_buckets == ()
    assert [(t, s) for t, s, _ in CONFIG.buckets] == [(4, 4), (16, 4), (16, 16), (32, 4), (32, 16), (64, 4), (64, 16)]
    assert CONFIG.bucket_for(1, 1, 1) == (4, 4, 8) and CONFIG.bucket_for(4, 2, 1) == (4, 4, 8)
    assert CONFIG.bucket_for(5, 2, 1) == (16, 4, 8) and CONFIG.bucket_for(16, 16, 1) == (16, 16, 8)
    assert {CONFIG.bucket_for(t, s, 1) for t in range(1, 65) for s in range(1, min(t, 16) + 1)} <= set(CONFIG.buckets)
    assert dataclasses.replace(wide, attention_backend="xla").page_buckets == (128,)
    # x1.5 buckets between doublings from T = 32 on (the CPU engine's): a 40-token step pads to 48, not 64
    mid = dataclasses.replace(wide, mid_token_buckets_from=32)
    assert mid.token_buckets == (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert mid.bucket_for(40, 32, 1)[0] == 48 and mid.bucket_for(97, 32, 1)[0] == 128
    assert {mid.bucket_for(t, s, 1) for t in range(1, 513) for s in range(1, min(t, 64) + 1)} <= set(mid.buckets)
    assert dataclasses.replace(CONFIG, mid_token_buckets_from=32).token_buckets == (16, 32, 48, 64)
    with pytest.raises(ValueError, match="mid_token_buckets_from"):
        dataclasses.replace(CONFIG, mid_token_buckets_from=1)
    # S = 1 (CPU): one decode only; one sequence fed more tokens takes S = 4 (no extra shape)
    one = dataclasses.replace(small, min_seq_bucket=1)
    assert one.seq_buckets == (1, 4, 16) and [(t, s) for t, s, _ in one.buckets if s == 1] == [(1, 1)]
    assert one.bucket_for(1, 1, 1) == (1, 1, 8) and one.bucket_for(5, 1, 1) == (8, 4, 8)
    assert len(one.buckets) == len(small.buckets)  # (1, 1) replaces (1, 4)
    assert {one.bucket_for(t, s, 1) for t in range(1, 65) for s in range(1, min(t, 16) + 1)} <= set(one.buckets)


@pytest.mark.parametrize("field, value", [("attention_backend", "cuda"), ("page_size", 12), ("num_pages", 0),
                                          ("max_num_partial_prefills", 0), ("kv_cache_dtype", "fp8_e5m2"),
                                          ("prompt_lookup", (3, 2)), ("prompt_lookup", (0, 2)),
                                          ("prompt_lookup", [1, 2])])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        dataclasses.replace(CONFIG, **{field: value})


def test_prepare_packs_exact_arrays(tiny):
    runner = ModelRunner(tiny.config, tiny.params, CONFIG)
    step = runner.prepare([entry("a", [7, 8, 9], 14, [5, 2]), entry("b", [4], 3, [9])])
    assert step.token_ids.tolist() == [7, 8, 9, 4]  # 4 tokens over 2 <= 4 slots: T = S = 4
    assert step.positions.tolist() == [14, 15, 16, 3]
    # positions 14, 15 in page 5; 16 in page 2; 3 in page 9
    assert step.slot_mapping.tolist() == [5 * 16 + 14, 5 * 16 + 15, 2 * 16 + 0, 9 * 16 + 3]
    step = runner.prepare([entry("a", [7, 8, 9], 14, [5, 2]), entry("b", [4, 5], 3, [9])])
    assert step.token_ids.tolist() == [7, 8, 9, 4, 5] + [0] * 11  # padding tokens in the null page
    assert step.slot_mapping.tolist() == [5 * 16 + 14, 5 * 16 + 15, 2 * 16 + 0, 9 * 16 + 3, 9 * 16 + 4] + [0] * 11
    step = runner.prepare([entry("a", [7, 8, 9], 14, [5, 2]), entry("b", [4], 3, [9])])
    assert step.page_table.shape == (4, 8)
    assert step.page_table[:2, :2].tolist() == [[5, 2], [9, 0]] and not step.page_table[2:].any()
    assert step.kv_lens.tolist() == [17, 4, 0, 0]
    assert step.cu_q_lens.tolist() == [0, 3, 4, 4, 4]
    assert step.logits_indices.tolist() == [2, 3, 0, 0]
    assert int(step.num_seqs) == 2
    # an entry whose page table stops short of a position it feeds (a scheduler bug) is refused, not sent to page 0
    with pytest.raises(ValueError, match="past its page table"):
        runner.prepare([entry("a", [7, 8, 9], 14, [5, 2]), entry("b", [4], 16, [9])])


def test_mixed_step_under_max_num_partial_prefills_matches_plain_forward(tiny):
    """Two prefill chunks and three decodes in one T > S step, with attention sized for 2 prefills
    (the CPU path; the kernel's own split is tested in tests/pallas_kernels)."""
    config = dataclasses.replace(CONFIG, attention_backend="xla", max_num_partial_prefills=2)
    runner = ModelRunner(tiny.config, tiny.params, config)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (9, 30, 17, 5, 12)]
    pages = [[1], [2, 3], [4, 5], [6], [7]]
    for i in (0, 3, 4):  # the decodes' prompts, all but the last token, one step each
        runner.execute(runner.prepare([entry(f"d{i}", prompts[i][:-1], 0, pages[i], samples=False)]))
    step = runner.prepare([entry("d0", prompts[0][-1:], 8, pages[0]), entry("p1", prompts[1], 0, pages[1]),
                           entry("d3", prompts[3][-1:], 4, pages[3]), entry("p2", prompts[2], 0, pages[2]),
                           entry("d4", prompts[4][-1:], 11, pages[4])])
    assert step.token_ids.shape[0] > step.kv_lens.shape[0]  # T > S: the split attention path
    logits = runner.execute(step)
    for row, i in enumerate((0, 1, 3, 2, 4)):
        plain = forward_jit(tiny.config, tiny.params, jnp.asarray([prompts[i]]))[0, -1]
        np.testing.assert_allclose(np.asarray(logits[row]), np.asarray(plain), atol=1e-4)


def test_chunked_prefill_over_cached_prefix_matches_plain_forward(tiny):
    runner = ModelRunner(tiny.config, tiny.params, CONFIG)
    tokens = np.random.default_rng(0).integers(0, 256, size=50).tolist()
    pages = [3, 7, 1, 12]  # shuffled, non-contiguous
    runner.execute(runner.prepare([entry("a", tokens[:20], 0, pages[:2], samples=False)]))
    logits = runner.execute(runner.prepare([entry("a", tokens[20:50], 20, pages)]))
    plain = forward_jit(tiny.config, tiny.params, jnp.asarray([tokens]))[0, -1]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(plain), atol=1e-4)


def test_kv_pool_sized_from_memory_budget(tiny):
    per_page = kv_bytes_per_page(tiny.config, 16, np.float32)
    assert per_page == 2 * 2 * 2 * 16 * 8 * 4  # k and v, layers, kv heads, page, head_dim, f32
    args = EngineArgs(model="unused", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
                      kv_cache_memory=per_page * 50 + 7, compilation_cache_dir=None, warmup=False)
    engine = LLMEngine(args, loaded=tiny)
    assert engine.runner_config.num_pages == 50
    assert engine.runner.kv.k.shape == (2, 2, 50, 16, 8)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLMEngine(dataclasses.replace(args, kv_cache_memory=per_page * 4), loaded=tiny)


def test_lowered_step_compiles_with_xla_options(tiny):
    """`lower` gives the exact step `execute` runs, to read or to compile with XLA options (the GPU benchmark
    tries dynamic-slice fusion this way): same logits, and the pool goes in donated and comes back."""
    tokens = np.random.default_rng(1).integers(0, 256, size=20).tolist()
    want_runner = ModelRunner(tiny.config, tiny.params, CONFIG)
    want = want_runner.execute(want_runner.prepare([entry("a", tokens, 0, [3, 7])]))
    runner = ModelRunner(tiny.config, tiny.params, CONFIG)
    step = runner.prepare([entry("a", tokens, 0, [3, 7])])
    compiled = runner.lower(step).compile(compiler_options={"xla_gpu_enable_dynamic_slice_fusion": True})
    logits, _, kv = compiled(runner.params, runner.kv, step)
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(want[0]), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(kv.k), np.asarray(want_runner.kv.k))
    with pytest.raises(Exception, match="No such compile option"):
        runner.lower(step).compile(compiler_options={"xla_no_such_option": True})


def test_cpu_step_compiles_with_the_engine_xla_options(tiny):
    """On CPU the runner compiles its step with CPU_COMPILER_OPTIONS (XLA:CPU library dot fusions): the
    program is the one an explicit compile with those options gives, not XLA's default one, and its
    logits match the plain forward. Other platforms get no options."""
    assert cpu_compiler_options() == CPU_COMPILER_OPTIONS and cpu_compiler_options("gpu") == {}
    runner = ModelRunner(tiny.config, tiny.params, dataclasses.replace(CONFIG, attention_backend="xla"))
    tokens = np.random.default_rng(2).integers(0, 256, size=20).tolist()
    step = runner.prepare([entry("a", tokens, 0, [3, 7])])

    def library_fusions(text: str) -> int:
        return text.count('"__ynn_fusion"')

    def compiled_with(options):
        return jax.jit(paged_forward, static_argnums=(0, 1), compiler_options=options).lower(
            tiny.config, runner.config.attention, runner.params, runner.kv, step).compile().as_text()

    ours = library_fusions(runner.lower(step).compile().as_text())
    assert ours == library_fusions(compiled_with(CPU_COMPILER_OPTIONS)) != library_fusions(compiled_with({}))
    logits = runner.execute(step)
    plain = forward_jit(tiny.config, tiny.params, jnp.asarray([tokens]))[0, -1]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(plain), atol=1e-4)


def test_warm_cpu_steps_take_xla_dots_up_to_small_shapes_and_library_fusions_above(tiny):
    """Warm-up compiles each CPU step shape with its size's options: T <= CPU_SMALL_STEP_TOKENS without
    YNNPACK (XLA's own dots: faster at a few rows), larger T with YNNPACK's dot fusions; both give the
    plain forward's logits."""
    assert cpu_compiler_options(num_tokens=CPU_SMALL_STEP_TOKENS) == CPU_SMALL_STEP_OPTIONS
    assert cpu_compiler_options(num_tokens=CPU_SMALL_STEP_TOKENS + 1) == CPU_COMPILER_OPTIONS
    config = dataclasses.replace(CONFIG, attention_backend="xla", min_token_bucket=1, min_seq_bucket=1)
    runner = ModelRunner(tiny.config, tiny.params, config)
    runner.warmup()
    for n in (1, 20):
        tokens = np.random.default_rng(n).integers(0, 256, size=n).tolist()
        step = runner.prepare([entry("a", tokens, 0, [3, 7])])
        fusions = runner.compiled_program(step).as_text().count('"__ynn_fusion"')
        assert (fusions == 0) == (len(step.token_ids) <= CPU_SMALL_STEP_TOKENS), (n, len(step.token_ids), fusions)
        logits = runner.execute(step)
        plain = forward_jit(tiny.config, tiny.params, jnp.asarray([tokens]))[0, -1]
        np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(plain), atol=1e-4)


def test_cpu_steps_take_the_native_matmul_and_attention(tiny):
    """The default CPU backend: every step attends through the native kernel. The weight dots whose
    weights the runner holds packed (f32, N a multiple of 64: the native matmul's contiguous column
    blocks) take the native matmul at every step size; the others ([K, N]) at 17-128 tokens, XLA's dots
    elsewhere. Packed, the layers stay stacked and scanned ("auto"): each layer's product reads its layer
    of the packed stack in place, so the compiled step copies none of them out of it. The RoPE tables are
    one native call a step: no cosine is left in the compiled program (XLA:CPU would evaluate them in every
    layer, per head). Logits stay the plain forward's."""
    config = dataclasses.replace(CONFIG, attention_backend="auto", min_token_bucket=1, max_num_batched_tokens=256,
                                 max_model_len=256, weight_layout="auto")
    runner = ModelRunner(tiny.config, tiny.params, config)
    assert runner.config.backend == "cpu" and runner.config.attention.native_matmul
    assert runner.layout == WeightLayout(per_layer=False, fused=True)
    layers = runner.params["layers"]
    # gqa4: wo [64 -> 64], w_gate_up [64 -> 256], w_down [128 -> 64] packed; wqkv (N = 96), lm_head (V = 260) not
    assert {n for n, w in layers.items() if isinstance(w, PackedWeight)} == {"wo", "w_gate_up", "w_down"}
    assert layers["w_gate_up"].data.shape == (2, 4, 64, 64) and layers["w_gate_up"].shape == (64, 2, 128)
    assert not isinstance(runner.params["lm_head"], PackedWeight)
    sizes = {"packed": {64 * 64, 64 * 256, 128 * 64}, "wqkv": {64 * 96}}  # one layer's weights' element counts

    def slices(text, names):  # a weight's layer sliced out of its stack (by the instruction's own name)
        return [line for line in hlo_stats.weight_copies(text, sizes[names])
                if re.search(r"dynamic[-_]slice", line.split(" = ")[0])]

    for n in (1, 20, 100, 200):
        tokens = np.random.default_rng(n).integers(0, 256, size=n).tolist()
        step = runner.prepare([entry("a", tokens, 0, range(3, 3 + -(-n // 16)))])
        compiled = runner.lower(step).compile().as_text()  # the program as run: one layer, in a while loop
        assert " while(" in compiled and 'custom_call_target="jaxpaged_cpu_attention"' in compiled
        assert slices(compiled, "packed") == [] and slices(compiled, "wqkv"), len(step.token_ids)  # wqkv: unpacked
        # packed weights: 3 native calls in the layer; the [K, N] wqkv too at 17-128 tokens (the LM head: 1 row)
        native = 4 if 17 <= len(step.token_ids) <= 128 else 3
        assert compiled.count('custom_call_target="jaxpaged_cpu_matmul"') == native, len(step.token_ids)
        assert compiled.count('custom_call_target="jaxpaged_cpu_rope_tables"') == 1
        assert " cosine(" not in compiled and " sine(" not in compiled
        logits = runner.execute(step)
        plain = forward_jit(tiny.config, tiny.params, jnp.asarray([tokens]))[0, -1]
        np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(plain), atol=1e-4)


@pytest.mark.parametrize("weight_layout", ["stacked", "per_layer"])
def test_padding_tokens_cost_the_packed_weight_dots_nothing(tiny, weight_layout):
    """A step padded to its T bucket: the packed weights' products compute its real tokens only
    (cu_q_lens[-1]), so a padding row's hidden state is its embedding (token 0) untouched: every packed
    product adds zeros to it (wo's, and the MLP's whole path). The real tokens' logits stay the plain
    forward's; in both weight layouts."""
    config = dataclasses.replace(CONFIG, attention_backend="auto", min_token_bucket=1, max_num_batched_tokens=256,
                                 max_model_len=256, weight_layout=weight_layout)
    runner = ModelRunner(tiny.config, tiny.params, config)
    assert isinstance(runner.params["layers"][0]["w_down"] if weight_layout == "per_layer"
                      else runner.params["layers"]["w_down"], PackedWeight)
    tokens = np.random.default_rng(5).integers(1, 256, size=37).tolist()
    step = runner.prepare([entry("a", tokens[:30], 0, [3, 4]), entry("b", tokens[30:], 0, [5])])
    assert len(step.token_ids) > 37 and int(step.cu_q_lens[-1]) == 37  # padded
    logits, hidden = runner._forward(step)
    embed0 = np.asarray(tiny.params["embed"][0])
    np.testing.assert_array_equal(np.asarray(hidden[37:]), np.broadcast_to(embed0, hidden[37:].shape))
    assert not np.allclose(np.asarray(hidden[:37]), np.asarray(tiny.params["embed"])[tokens])
    for row, prompt in enumerate((tokens[:30], tokens[30:])):
        plain = forward_jit(tiny.config, tiny.params, jnp.asarray([prompt]))[0, -1]
        np.testing.assert_allclose(np.asarray(logits[row]), np.asarray(plain), atol=1e-4)


def test_cpu_runner_holds_a_tied_lm_head_as_its_own_copy(tiny_checkpoints):
    """On CPU a tied model's LM head is also held as the embedding transposed, [E, V] (the form XLA:CPU
    runs fast at one row); the logits stay the tied forward's and the caller's params are untouched."""
    tied = load_model(str(tiny_checkpoints["tied"]), dtype="float32")
    assert tied.config.tie_word_embeddings and "lm_head" not in tied.params
    runner = ModelRunner(tied.config, tied.params, CONFIG)
    np.testing.assert_array_equal(np.asarray(runner.params["lm_head"]), np.asarray(tied.params["embed"]).T)
    assert "lm_head" not in tied.params
    tokens = np.random.default_rng(3).integers(0, 256, size=20).tolist()
    logits = runner.execute(runner.prepare([entry("a", tokens, 0, [3, 7])]))
    plain = forward_jit(tied.config, tied.params, jnp.asarray([tokens]))[0, -1]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(plain), atol=1e-5)


def test_per_layer_weights_match_the_scanned_stack(tiny):
    """Per-layer weights (a list, looped over: nothing sliced out of a stack) give the scanned stack's
    logits and pool, and their step has no loop left; on a mesh too (each layer's weights sharded)."""
    tokens = np.random.default_rng(2).integers(0, 256, size=20).tolist()
    stacked = ModelRunner(tiny.config, tiny.params, dataclasses.replace(CONFIG, weight_layout="stacked"))
    per_layer = ModelRunner(tiny.config, tiny.params, dataclasses.replace(CONFIG, weight_layout="per_layer"))
    assert len(per_layer.params["layers"]) == tiny.config.num_hidden_layers
    step = stacked.prepare([entry("a", tokens, 0, [3, 7])])
    assert "stablehlo.while" in stacked.lower(step).as_text()
    assert "stablehlo.while" not in per_layer.lower(step).as_text()
    want, got = stacked.execute(step), per_layer.execute(step)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(per_layer.kv.k), np.asarray(stacked.kv.k))
    np.testing.assert_array_equal(np.asarray(per_layer.kv.v), np.asarray(stacked.kv.v))
    on_mesh = ModelRunner(tiny.config, tiny.params, dataclasses.replace(CONFIG, weight_layout="per_layer"),
                          parallel.make_mesh(1))
    np.testing.assert_allclose(np.asarray(on_mesh.execute(step)), np.asarray(want), atol=1e-6)
    with pytest.raises(ValueError, match="only the checkpoint layout"):
        ModelRunner(tiny.config, unstack_layers(tiny.params), CONFIG)


BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


@pytest.mark.parametrize("choice, model, platform, want", [
    ("auto", BF16, "gpu", BF16), ("auto", BF16, "cpu", F32),  # XLA:CPU has no bf16 scatter
    ("auto", F16, "cpu", F16), ("auto", F32, "cpu", F32), ("bfloat16", BF16, "cpu", BF16),
    ("float32", BF16, "gpu", F32), ("float16", F32, "cpu", F16)])
def test_resolve_kv_cache_dtype(choice, model, platform, want):
    assert resolve_kv_cache_dtype(choice, model, platform) == want
    assert resolve_kv_cache_dtype("fp8", model, platform) == np.dtype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2'"):
        resolve_kv_cache_dtype("fp8_e5m2", model, platform)


def _pool_sized_passes(config, params, num_pages, kv_dtype):
    """Lines of the compiled CPU step that convert or copy an array of the pool's size (pick num_pages so that
    no weight has the pool's element count: a bf16 weight is converted for its dot on CPU)."""
    runner_cfg = dataclasses.replace(CONFIG, attention_backend="xla", num_pages=num_pages, kv_cache_dtype=kv_dtype)
    runner = ModelRunner(config, params, runner_cfg)
    pool = runner.kv
    text = runner.lower(runner.prepare([entry("a", [1, 2], 0, [1])])).compile().as_text()
    # e.g. "%convert.7 = f32[2,2,64,16,8]{4,3,2,1,0} convert(%param.1)"
    result = re.compile(r"= \w+\[([\d,]+)\]\S* (?:convert|copy)\(")
    return [line for line in text.splitlines() if (m := result.search(line))
            and np.prod([int(d) for d in m.group(1).split(",")]) == pool.k.size]


def test_bf16_model_on_cpu_gets_an_f32_pool_written_in_place(tiny):
    """A bf16 pool on XLA:CPU is converted to f32 and back around every layer's scatter (seconds a step at
    a real pool size); "auto" gives a bf16 model an f32 pool there, which the step updates in place."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny.params)
    assert _pool_sized_passes(tiny.config, params, 40, "bfloat16"), "the hazard this guards against is gone?"
    assert _pool_sized_passes(tiny.config, params, 40, "auto") == []
    runner = ModelRunner(tiny.config, params, dataclasses.replace(CONFIG, attention_backend="xla"))
    assert runner.kv.k.dtype == jnp.float32 and runner.kv_dtype == F32
    tokens = np.random.default_rng(0).integers(0, 256, size=20).tolist()
    logits = runner.execute(runner.prepare([entry("a", tokens, 0, [3, 7])]))
    plain = forward_jit(tiny.config, params, jnp.asarray([tokens]))[0, -1]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(plain, np.float32), atol=0.1, rtol=0.05)


def test_pack_weights_packs_stacked_and_per_layer_params_and_consumes_only_what_it_packed(tiny):
    from jaxpaged.worker.host_memory import HugePageArena
    from jaxpaged.worker.step_program import _pack_for_cpu_matmul
    from jaxpaged.models.weight_dots import pack_weights
    from jaxpaged.worker.weight_layout import to_weight_layout
    arena = HugePageArena(1 << 22)
    pack = functools.partial(_pack_for_cpu_matmul, arena=arena)
    params = to_weight_layout(tiny.config, jax.tree.map(jnp.copy, tiny.params), WeightLayout(per_layer=True, fused=True))
    source = params["layers"][0]
    wo = np.array(source["wo"]).reshape(-1, source["wo"].shape[-1])  # [H * D, E], a copy: the source goes
    packed = pack_weights(params, pack, consume=True)["layers"][0]
    assert source["wo"].is_deleted() and source["w_down"].is_deleted()  # packed: the sources went
    assert not source["wqkv"].is_deleted() and packed["wqkv"] is source["wqkv"]  # N = 96: held as it was
    assert packed["wo"].shape == (64, 64) and packed["wo"].layer is None  # wo [H, D, E] as its [H * D, E] view
    np.testing.assert_array_equal(packed["wo"].data, cpu_matmul.block_weight(jnp.asarray(wo)))
    first = arena.empty((1,), np.uint8).ctypes.data  # the arena's next byte: the blocks were written before it
    assert first - (1 << 22) < packed["wo"].data.unsafe_buffer_pointer() < first  # in place, in the arena
    assert pack_weights({"layers": [packed]}, pack)["layers"][0]["wo"] is packed["wo"]
    # stacked layers pack as a stack of blocks [L, N / 64, K, 64] with one layer's shape
    stacked = to_weight_layout(tiny.config, jax.tree.map(jnp.copy, tiny.params), WeightLayout(fused=True))
    w_down = np.array(stacked["layers"]["w_down"])  # [L, F, E]
    layers = pack_weights(stacked, pack, consume=True)["layers"]
    assert layers["w_down"].shape == (128, 64) and layers["w_down"].data.shape == (2, 1, 128, 64)
    np.testing.assert_array_equal(layers["w_down"].data[1], cpu_matmul.block_weight(jnp.asarray(w_down[1])))
    assert layers["wo"].shape == (64, 64) and layers["wo"].data.shape == (2, 1, 64, 64)
    assert not isinstance(layers["wqkv"], PackedWeight) and not layers["wqkv"].is_deleted()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernels are XLA:CPU's")
def test_build_native_kernels_starts_the_kernels_the_step_will_ask_for_in_that_order(monkeypatch):
    asked = []  # the sources of each background build, in their order
    monkeypatch.setattr(cpu_build, "build_in_background", lambda sources: asked.append(
        [Path(s).name for s in sources]))
    build_native_kernels("auto")
    build_native_kernels("xla")
    assert asked == [["cpu_matmul.cc", "cpu_attention.cc", "cpu_rope.cc", "cpu_sampler.cc"], ["cpu_sampler.cc"]]


def test_carry_tokens_takes_each_verifications_first_rejection_or_bonus():
    """A step of 3 entries (rows 0-2) whose entries 0 and 2 verified 3 and 2 drafts, packed in rows 3-5 and 6-7:
    entry 0 accepted 1 (its next token: row 4's sample, 2 rejected), entry 2 all (its bonus row 2, none)."""
    from jaxpaged.worker.in_flight import carry_tokens
    sampled = jnp.array([10, 11, 12, 13, 14, 15, 16, 17, 0, 0], jnp.int32)  # i32[N]: entries', then draft rows
    entry_rows = np.array([0, 2, 8, 8], np.int32)  # M = 4 slots; 8 = size: padding
    sample_rows = np.array([[3, 4, 5], [6, 7, 0], [0, 0, 0], [0, 0, 0]], np.int32)
    draft_ids = np.array([[20, 21, 22], [23, 24, -1], [-1] * 3, [-1] * 3], np.int32)
    num_accepted, num_drafts = jnp.array([1, 2, 0, 0, 9, 9], jnp.int32), np.array([3, 2, 0, 0], np.int32)
    tokens, rejected, accepted = carry_tokens(sampled, sampled, 8, entry_rows, sample_rows, num_accepted, num_drafts,
                                              draft_ids)
    assert tokens.tolist() == [14, 11, 12, 13, 14, 15, 16, 17] and rejected.tolist() == [2, 0, 0, 0, 0, 0, 0, 0]
    assert accepted.tolist() == [[20, -1, -1], [-1] * 3, [23, 24, -1]] + [[-1] * 3] * 5


def test_fill_in_flight_moves_a_sequence_back_by_its_rejected_drafts():
    """Two sequences packed on the host: a decode (tokens 0-1 of a 2-token chunk, untouched) and one fed after a
    verification in flight as if its 3 drafts were accepted: a placeholder and 2 drafts at positions 11-13.
    2 were rejected: positions 9-11, slots through its page table (page size 4), kv_lens 14 -> 12, and the
    placeholder takes the carried token."""
    from jaxpaged.worker.step_input import StepInput
    from jaxpaged.worker.in_flight import fill_in_flight
    step = StepInput(token_ids=np.array([5, 6, -1, 7, 8, 0, 0, 0], np.int32),
                     positions=np.array([3, 4, 11, 12, 13, 0, 0, 0], np.int32),
                     slot_mapping=np.array([7, 8, 31, 36, 37, 0, 0, 0], np.int32),
                     page_table=np.array([[1, 2, 0, 0], [6, 5, 7, 9], [0, 0, 0, 0]], np.int32),
                     kv_lens=np.array([5, 14, 0], np.int32), cu_q_lens=np.array([0, 2, 5, 5], np.int32),
                     num_seqs=np.int32(2), logits_indices=np.array([1, 4, 0], np.int32))
    tokens, rejected = jnp.array([40, 41, 0, 0], jnp.int32), jnp.array([0, 2, 0, 0], jnp.int32)
    sources = np.array([-1, -1, 1, -1, -1, -1, -1, -1], np.int32)  # the placeholder takes row 1's token
    shifts = np.array([-1, -1, 1, 1, 1, -1, -1, -1], np.int32)  # its sequence moves back by row 1's rejected
    filled = jax.jit(fill_in_flight, static_argnums=(5,))(step, tokens, rejected, sources, shifts, 4)
    assert filled.token_ids.tolist() == [5, 6, 41, 7, 8, 0, 0, 0]
    assert filled.positions.tolist() == [3, 4, 9, 10, 11, 0, 0, 0]
    assert filled.slot_mapping.tolist() == [7, 8, 29, 30, 31, 0, 0, 0]  # page 7 (positions 8-11): 28 + offset
    assert filled.kv_lens.tolist() == [5, 12, 0]
    nothing = jax.jit(fill_in_flight, static_argnums=(5,))(step, tokens, rejected, sources, np.full(8, -1, np.int32), 4)
    assert nothing.positions.tolist() == step.positions.tolist() and nothing.kv_lens.tolist() == [5, 14, 0]


def test_key_steps_move_back_by_the_drafts_rejected_in_flight():
    """The sequences of the step above: sampler rows at fed tokens [1, 4] (the decode, and the sequence fed after a
    verification in flight that rejected 2 of its drafts) and 2 draft rows at tokens 2-3 of that sequence, one
    padding row at token 0. The rows of that sequence key 2 output tokens back (steps 20, 18, 19 -> 18, 16, 17),
    the others keep theirs; a padding row at step 0 stays at 0. Host (numpy) and device (in the fused step: jax)
    alike. `PendingStep.key_steps` moves a host batch's steps so; a greedy batch (no key read) or a step packed
    with nothing in flight comes back as is."""
    from jaxpaged.worker.in_flight import PendingStep, steps_moved_back
    from jaxpaged.sample.sampling_batch import RowInfo, make_sampling_batch
    shifts = np.array([-1, -1, 1, 1, 1, -1, -1, -1], np.int32)
    rejected = np.array([0, 2, 0, 0], np.int32)
    token_index = np.array([1, 4, 2, 3, 0], np.int32)
    steps = np.array([7, 20, 18, 19, 0], np.uint32)
    assert steps_moved_back(steps, token_index, shifts, rejected).tolist() == [7, 18, 16, 17, 0]
    assert steps_moved_back(np.array([7, 1, 0, 0, 0], np.uint32), token_index, shifts, rejected).tolist() == \
        [7, 0, 0, 0, 0]  # never below 0 (a row whose sequence the step does not hold)
    on_device = jax.jit(steps_moved_back)(jnp.asarray(steps), jnp.asarray(token_index), jnp.asarray(shifts),
                                          jnp.asarray(rejected))
    assert on_device.dtype == jnp.uint32 and on_device.tolist() == [7, 18, 16, 17, 0]
    seeded, greedy = SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.0)
    rows = [RowInfo(seeded, seed=3, step=int(s)) for s in steps]
    pending = PendingStep((), None, None, None, shifts=shifts, rejected=jnp.asarray(rejected))
    moved = pending.key_steps(make_sampling_batch(rows, 5, 260), token_index)
    assert np.asarray(moved.steps).tolist() == [7, 18, 16, 17, 0]
    batch = make_sampling_batch([dataclasses.replace(r, params=greedy) for r in rows], 5, 260)
    assert pending.key_steps(batch, token_index) is batch
    batch = make_sampling_batch(rows, 5, 260)
    assert PendingStep((), None, None, None).key_steps(batch, token_index) is batch


def test_sampling_batch_from_kept_constants_is_the_batch_of_the_entries_rows(tiny):
    """A step's sampler batch gathers each request's constants kept from earlier steps (`InputBatch`),
    RowInfos only for rows with banned ids, a bias or penalties, then packed draft rows: the batch of the rows
    `sampling_row` makes, row for row. A request id that comes back with other params gets them (made again), and
    finished requests are forgotten."""
    from jaxpaged.worker.in_flight import sampling_row
    from jaxpaged.sample.sampling_batch import make_sampling_batch
    runner = ModelRunner(tiny.config, tiny.params, dataclasses.replace(CONFIG, num_speculative_tokens=2))
    V = tiny.config.vocab_size
    seeded, greedy = SamplingParams(temperature=0.7, top_k=3, top_p=0.8), SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.9, logit_bias={5: 2.0}, presence_penalty=0.5)
    banning = SamplingParams(temperature=0.0, min_tokens=4)  # banned ids come from min_tokens only

    def make(rid, params, seed, outputs, **fields):
        return dataclasses.replace(entry(rid, [7], 20, [1, 2]), sampling_params=params, seed=seed,
                                   num_output_tokens=outputs, output_token_ids=[4] * outputs, **fields)

    entries = [make("a", seeded, 11, 3), make("b", banning, 0, 1, banned_token_ids=(2, 9)),
               make("c", biased, 5, 2, token_ids=(7, 8, 9), spec_token_ids=(8, 9), spec_banned_token_ids=((), (3,))),
               make("d", seeded, 12, 0, token_ids=(7, 6), spec_token_ids=(6,), spec_banned_token_ids=((),))]
    for order in (entries[::-1], entries):  # the second step reads what the first kept
        step, batch_rows = runner.pack(order)
        layout = runner._layout_drafts(order, step)
        assert layout.packed
        batch, _ = runner._sampling_batch(order, batch_rows, step, layout, None)
        rows = [sampling_row(e) for e in order] + list(layout.rows)
        want = make_sampling_batch(rows, len(step.logits_indices), V)
        for field in dataclasses.fields(want):
            got, expected = getattr(batch, field.name), getattr(want, field.name)
            assert (got is None) == (expected is None) and (got is None or np.array_equal(got, expected)), field.name
    assert len(runner.input_batch) == 4
    again = [make("a", greedy, 11, 4)]  # "a" came back with other params
    step, batch_rows = runner.pack(again)
    assert runner._sampling_batch(again, batch_rows, step, None, None)[0].temperature.tolist() == [0.0] * 4
    runner.execute_model(SchedulerOutput(tuple(again), 1, (), ("b", "c")))  # a step told b and c finished
    assert len(runner.input_batch) == 2


def test_outputs_in_flight_are_what_the_host_counts_lack():
    """The step above, as the fused step sees it: entry 0 a 2-token chunk (no placeholder: its host counts are
    whole), entry 1 fed after a verification in flight that accepted 1 draft (40): its placeholder (now 30) and 2
    drafts (7, 8). Sampler rows: entry 0's at token 1, entry 1's at token 4, its 2 draft rows at tokens 2-3, one
    padding row. Each row of entry 1 lacks the accepted draft, the placeholder's token and the drafts fed before
    it; the others lack nothing (without the packed draft rows, rows 2-3 are padding: nothing). The sampler adds
    them to the counts."""
    from jaxpaged.worker.in_flight import PendingStep, _count_from, _placeholder_sources, outputs_in_flight
    from jaxpaged.worker.step_input import StepInput
    from jaxpaged.sample.in_step import _count_fed_tokens
    entries = [ScheduledRequest("a", (5, 6), 3, (1,), True, SamplingParams(), 3),
               ScheduledRequest("b", (-1, 7, 8), 11, (2, 3, 4), True, SamplingParams(), 3, placeholder=True,
                                spec_token_ids=(7, 8), spec_banned_token_ids=((), ()))]
    step = StepInput(token_ids=np.array([5, 6, -1, 7, 8, 0, 0, 0], np.int32), positions=np.zeros(8, np.int32),
                     slot_mapping=np.zeros(8, np.int32), page_table=np.zeros((4, 4), np.int32),
                     kv_lens=np.zeros(4, np.int32), cu_q_lens=np.array([0, 2, 5, 5, 5], np.int32),
                     num_seqs=np.int32(2), logits_indices=np.array([1, 4, 2, 3, 0], np.int32))
    rows = np.array([4, 1])  # the entries' rows of the persistent batch: b's was row 1 in the step before too
    sources = _placeholder_sources(entries, step, PendingStep((ScheduledRequest("b", (9,), 10, (2,), True,
                                                                                SamplingParams(), 3),), None, None, None,
                                                              batch_rows=np.array([1])), rows)
    assert sources.tolist() == [-1, -1, 0, -1, -1, -1, -1, -1]  # the placeholder: row 0 of the step before
    with pytest.raises(RuntimeError, match="'b' feeds a placeholder but sampled nothing"):
        _placeholder_sources(entries, step, PendingStep((ScheduledRequest("c", (9,), 10, (2,), True, SamplingParams(),
                                                                          3),), None, None, None,
                                                        batch_rows=np.array([0])), rows)
    count_from = _count_from(step, sources, 4)
    assert count_from.tolist() == [8, 2, 2, 2, 8]
    assert _count_from(step, sources, 2).tolist() == [8, 2, 8, 8, 8]
    token_ids = np.array([5, 6, 30, 7, 8, 0, 0, 0], np.int32)  # the placeholder filled on the device
    shifts = np.array([-1, -1, 1, 1, 1, -1, -1, -1], np.int32)
    accepted = np.array([[-1] * 3, [40, -1, -1], [-1] * 3, [-1] * 3], np.int32)  # i32[R, k]: row 1 accepted one
    out = jax.jit(outputs_in_flight)(token_ids, step.logits_indices, count_from, shifts, accepted)
    none = [-1] * 7
    assert out.tolist() == [none, [8, 7, 30, -1, 40, -1, -1], [30, -1, -1, -1, 40, -1, -1],
                            [7, 30, -1, -1, 40, -1, -1], none]
    counts = np.asarray(_count_fed_tokens(jnp.ones((5, 50), jnp.int32), out))
    assert [sorted(np.flatnonzero(row > 1).tolist()) for row in counts] == [[], [7, 8, 30, 40], [30, 40],
                                                                           [7, 30, 40], []]
    assert counts.sum() == 5 * 50 + 4 + 2 + 3


def test_penalised_draft_rows_count_the_outputs_in_flight_and_the_drafts_fed():
    """Async scheduling, a penalised request fed a placeholder and 3 drafts (entry "b", outputs [1, 2] listed) that
    the device proposed again (fed [7, 8, -1]: none past what its lookup found), and an unpenalised one ("a").
    Penalty counts of b's draft rows j = 0..2 (`_in_flight_history`, then `_with_history` makes the rows again):
    after the step in flight is handled (nothing before: the lists hold its outputs), its outputs and the drafts
    fed before j; before (the fused step's unpacked rows: they wait for its outcome, accepted 40 then token 30),
    that outcome first; the fused step's own rows: the list itself (by reference: the device counts the rest).
    Key steps stay those of the position; a's rows stay as they were."""
    from jaxpaged.spec_decode.verify import DraftRows
    from jaxpaged.worker.in_flight import (PendingStep, _draft_rows, _in_flight_history, _outcome_in_flight,
                                           _with_history)
    penalised = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    outputs = [1, 2]
    entries = [ScheduledRequest("a", (-1, 5), 9, (1,), True, SamplingParams(temperature=0.0), 3, placeholder=True,
                                spec_token_ids=(5,), spec_banned_token_ids=((),)),
               ScheduledRequest("b", (-1, 3, 4, 6), 9, (2,), True, penalised, 3, num_output_tokens=2,
                                output_token_ids=outputs, placeholder=True, spec_token_ids=(3, 4, 6),
                                spec_banned_token_ids=((), (), ()))]
    layout = DraftRows(True, ("a", "b"), (1, 3), np.zeros((4, 3), np.int32),
                       np.array([[5, -1, -1], [3, 4, 6], [-1] * 3, [-1] * 3], np.int32), np.zeros(4, np.int32),
                       _draft_rows(entries, True, 4, 3),
                       redrafted=jnp.array([[5, -1, -1], [7, 8, -1], [-1] * 3, [-1] * 3], jnp.int32))
    assert [r.output_token_ids for r in layout.rows[1:]] == [[1, 2], [1, 2, 3], [1, 2, 3, 4]]  # the host's drafts

    def rows(outcome):
        history = _in_flight_history(entries, layout, outcome)
        assert set(history) == {"b"}
        made = _with_history(entries, layout, history).rows
        assert made[0] == layout.rows[0]
        assert [(r.step, r.seed) for r in made[1:]] == [(2, 0), (3, 0), (4, 0)]
        return [r.output_token_ids for r in made[1:]]

    assert rows(lambda: {}) == [[1, 2], [1, 2, 7], [1, 2, 7, 8]]
    assert rows(lambda: {"b": (40, 30)}) == [[1, 2, 40, 30], [1, 2, 40, 30, 7], [1, 2, 40, 30, 7, 8]]
    assert all(history is outputs for history in rows(None))
    previous = PendingStep((entries[0], entries[1]), None, None, None)  # rows: a 0, b 1
    carried = (jnp.array([9, 30, 0, 0], jnp.int32), None, jnp.array([[-1] * 3, [40, -1, -1], [-1] * 3, [-1] * 3]))
    assert _outcome_in_flight(previous, carried, entries) == {"a": (9,), "b": (40, 30)}
    assert _outcome_in_flight(previous, (carried[0], None, None), entries) == {"a": (9,), "b": (30,)}
    assert _in_flight_history(entries[:1], layout, lambda: {}) == {}


def test_history_buckets_cover_a_sequence_and_its_drafts():
    """The histories `redraft_in_flight` takes: 256, x4, ... up to max_model_len + 1 (a whole sequence, the
    token after it), only with a prompt lookup and speculation."""
    spec = dataclasses.replace(CONFIG, num_speculative_tokens=4, prompt_lookup=(1, 3), max_model_len=2048)
    assert spec.history_buckets == (256, 1024, 2049)
    assert dataclasses.replace(spec, max_model_len=128).history_buckets == (129,)
    assert dataclasses.replace(spec, prompt_lookup=None).history_buckets == ()
    assert dataclasses.replace(spec, num_speculative_tokens=0).history_buckets == ()


def test_redraft_in_flight_proposes_the_drafts_of_every_slot_in_flight():
    """Two slots fed after a step in flight (rows 0-1 there), one not (row -1), one padding. Slot 0 (known tokens
    1 2 7 9 1 2, 2 drafts in flight [7, 8]): the step accepted 1 (7) and emitted 9, so its sequence is
    1 2 7 9 1 2 7 9: the lookup (n = 1..3) matches "2 7 9" ending at index 3 and proposes what follows (1, 2, 7);
    its 2 slots become [1, 2] (the -1 past them stays). Slot 1 (known 5 5 4, its draft in flight 0 accepted, then
    token 4: 5 5 4 0 4): "4" matches at index 2, so [0, 4], then -1 past the sequence (3 slots). Slot 2 keeps the
    host's drafts. The Redraft carries the slots it proposed and their fed token's index; `fill_in_flight` feeds
    those drafts after it (a slot found none for keeps the host's token), and the fused step's accept reads them."""
    from jaxpaged.spec_decode.verify import Redraft, merge_redrafts, redraft_in_flight
    from jaxpaged.worker.step_input import StepInput
    from jaxpaged.worker.in_flight import fill_in_flight
    draft_ids = np.array([[3, 3, -1], [4, 4, 4], [6, -1, -1], [-1, -1, -1]], np.int32)  # i32[M, k]: the host's
    history = np.zeros((4, 16), np.int32)
    history[0, :8] = [1, 2, 7, 9, 1, 2, 7, 8]  # known (6), then the 2 drafts in flight
    history[1, :4] = [5, 5, 4, 0]
    known, num_previous = np.array([6, 3, 2, 0], np.int32), np.array([2, 1, 0, 0], np.int32)
    rows = np.array([0, 1, -1, -1], np.int32)
    tokens, rejected = jnp.array([9, 4, 0, 0], jnp.int32), jnp.array([1, 0, 0, 0], jnp.int32)
    first = np.array([1, 4, 8, 0], np.int32)
    none = Redraft.none(16, 3)
    verified, redraft = redraft_in_flight(draft_ids, history, known, num_previous, rows, tokens, rejected,
                                          first, none, np.full(4, 16, np.int32), 16, (1, 3))
    assert verified.tolist() == [[1, 2, -1], [0, 4, -1], [6, -1, -1], [-1, -1, -1]]
    assert redraft.drafts.shape == (16, 3) and redraft.proposed.tolist() == [True, True] + [False] * 14
    assert redraft.first[:4].tolist() == [1, 4, 8, 0] and redraft.drafts[0].tolist() == [1, 2, -1]
    step = StepInput(token_ids=np.array([11, -1, 3, 3, -1, 4, 4, 4, 0, 0], np.int32), positions=np.arange(10),
                     slot_mapping=np.arange(10), page_table=np.zeros((3, 4), np.int32),
                     kv_lens=np.zeros(3, np.int32), cu_q_lens=np.array([0, 1, 4, 8], np.int32),
                     num_seqs=np.int32(3), logits_indices=np.zeros(3, np.int32))
    sources = np.array([-1, 0, -1, -1, 1, -1, -1, -1, -1, -1], np.int32)
    filled = fill_in_flight(step, tokens, rejected, sources, np.full(10, -1, np.int32), 4, redraft)
    assert filled.token_ids.tolist() == [11, 9, 1, 2, 4, 0, 4, 4, 0, 0]  # each slot's drafts after its token
    assert merge_redrafts(draft_ids, redraft).tolist() == verified.tolist()
    assert merge_redrafts(draft_ids, Redraft.none(16, 3)).tolist() == draft_ids.tolist()
    # the drafts in flight were themselves proposed on the device ([6, 1] at its slot 5, where the host had
    # [8, 8]), both accepted, then token 2: the sequence 4 5 6 1 2 6 1 2, whose suffix "6 1 2" matches at 2-4
    drafts = np.full((16, 3), -1, np.int32)
    drafts[5, :2] = [6, 1]
    before = Redraft(drafts, np.arange(16) == 5, np.zeros(16, np.int32))
    again = redraft_in_flight(np.array([[3, 3, 3]], np.int32), np.array([[4, 5, 6, 1, 2, 8, 8, 0]], np.int32),
                              np.array([5], np.int32), np.array([2], np.int32), np.array([0], np.int32),
                              jnp.array([2, 0, 0, 0], jnp.int32),
                              jnp.zeros(4, jnp.int32), np.array([0], np.int32), before, np.array([5], np.int32), 16,
                              (1, 3))[0]
    assert again.tolist() == [[6, 1, 2]]  # with the host's drafts in flight: 4 5 6 1 2 8 8 2 -> [8, 8, 2]
    args = (draft_ids, history, known, num_previous, rows, tokens, rejected, first, none,
            np.full(4, 16, np.int32), 16, (1, 3))
    assert "stablehlo" in redraft_in_flight.trace(*args).lower(lowering_platforms=("cuda",)).as_text()  # GPU too

"""Batch-invariant mode (EngineArgs(batch_invariant=True)): a request's logits and log-probs are the same to the bit
whatever else is in the batch, however its prompt was chunked, whether its prefix came from the cache, whichever
(T, S, P) bucket ran it. A model with head_dim 64, so the native CPU attention's query tiles (which the mode turns
off) would run for prefill chunks."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import EngineArgs
from jaxpaged.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxpaged.models import llama
from jaxpaged.models.params import fuse_gate_up, fuse_qkv, init_params
from jaxpaged.worker import model_runner as runner_module
from jaxpaged.worker.runner_config import CPU_SMALL_STEP_OPTIONS, RunnerConfig
from jaxpaged.worker import step_program
from jaxpaged.worker.step_program import batch_invariant_matmul
from jaxpaged.worker.weight_layout import to_weight_layout
from pallas_kernels import cpu_attention, cpu_matmul, cuda_compile, plan_kernel_calls, ragged_paged_attention
from pallas_kernels.tiling import batch_invariant_tiling
from tests.conftest import TINY_BASE, tiny_tokenizer

ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, num_pages=200,
            batch_invariant=True)
HD64 = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)

needs_native = pytest.mark.skipif(not (cpu_matmul.load_cpu_matmul() and cpu_attention.load_cpu_attention()),
                                  reason="the native CPU kernels do not build here")


@pytest.fixture(scope="module")
def hd64_checkpoint(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hd64")
    LlamaForCausalLM(LlamaConfig(**{**TINY_BASE, **HD64})).float().eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llm(hd64_checkpoint):
    return LLM(model=str(hd64_checkpoint), **ARGS)


def _logprobs(out):
    """(sampled tokens' log-probs, prompt tokens' log-probs, token ids) of a request's first completion."""
    c = out.outputs[0]
    sampled = np.array([entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)], np.float32)
    prompt = np.array([entry[t].logprob for t, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])],
                      np.float32)
    return sampled, prompt, c.token_ids


@needs_native
def test_alone_mixed_and_cached_are_bitwise_equal(llm):
    target = list(range(10, 60))
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    alone = _logprobs(llm.generate([target], params, use_tqdm=False)[0])
    # others: prefill chunks beside the target's prompt and decodes (the 64-token budget chunks them), finishing
    # at different steps, so the target's steps run at many (T, S) buckets
    others = [list(range(20 + i, 23 + i + 7 * i)) for i in range(9)]
    other_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(9)]
    outs = llm.generate(others[:4] + [target] + others[4:], other_params[:4] + [params] + other_params[4:],
                        use_tqdm=False)
    mixed = _logprobs(outs[4])
    assert mixed[2] == alone[2]
    np.testing.assert_array_equal(mixed[0], alone[0])
    np.testing.assert_array_equal(mixed[1], alone[1])
    # a prompt run twice, the second time its first 48 tokens (3 pages) from the prefix cache (prompt log-probs
    # would bypass the cache)
    prompt = list(range(150, 198)) + [70, 71, 72]
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=8, logprobs=0, ignore_eos=True)
    fresh, cached = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert fresh.num_cached_tokens == 0 and cached.num_cached_tokens >= 32
    assert cached.outputs[0].token_ids == fresh.outputs[0].token_ids
    np.testing.assert_array_equal(*(np.array([e[t].logprob for t, e in zip(o.outputs[0].token_ids,
                                                                            o.outputs[0].logprobs)])
                                    for o in (fresh, cached)))


def _step(runner, entries):
    """Run one step of `entries` on the runner; the logits f32[S, V] the sampler saw."""
    seen = {}
    sample = runner_module.sample_jit

    def record(logits, batch, **kwargs):
        seen["logits"] = np.asarray(logits)
        return sample(logits, batch, **kwargs)

    runner_module.sample_jit = record
    try:
        runner.execute_model(SchedulerOutput(tuple(entries), sum(e.num_tokens for e in entries), (), ()))
    finally:
        runner_module.sample_jit = sample
    return seen["logits"]


def _request(slot, tokens, start, samples=True):
    """A request fed `tokens` at `start`, on its own run of 5 pages (up to 80 tokens)."""
    pages = tuple(range(1 + 5 * slot, 1 + 5 * slot + (start + len(tokens) + 15) // 16))
    return ScheduledRequest(f"r{slot}", tuple(tokens), start, pages, samples, SamplingParams(temperature=0.0), 50)


@needs_native
@pytest.mark.parametrize("chunks", [[3, 47], [47, 3], [8, 42], [1, 49], [34, 16], [5, 20, 25]])
def test_chunked_prompts_and_buckets_are_bitwise_equal(llm, chunks):
    """A 50-token prompt fed whole and in chunks (steps of T = 1 .. 64), then decoded alone and beside
    others (S = 1, 4, 16): the same logits at every step, to the bit."""
    runner = llm.llm_engine.runner
    prompt = list(range(100, 150))
    whole = _step(runner, [_request(20, prompt, 0)])[0]
    pos = 0
    for size in chunks[:-1]:
        _step(runner, [_request(21, prompt[pos:pos + size], pos, samples=False)])
        pos += size
    np.testing.assert_array_equal(_step(runner, [_request(21, prompt[pos:], pos)])[0], whole)
    alone = _step(runner, [_request(20, [77], 50)])[0]
    for slot in (21,):  # the chunked request decodes beside decodes and a prefill chunk of others
        company = [_request(30 + i, [5 + i], 0) for i in range(6)]
        np.testing.assert_array_equal(_step(runner, [*company[:3], _request(slot, [77], 50), *company[3:]])[3], alone)


@needs_native
def test_native_attention_without_query_tiles_is_row_invariant():
    rng = np.random.default_rng(0)
    kvh, pages, ps, d = 2, 32, 16, 64
    k_pool = jnp.asarray(rng.standard_normal((kvh, pages, ps, d)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((kvh, pages, ps, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((16, 4, d)), jnp.float32)
    table = jnp.asarray(np.arange(1, 1 + 4 * 8).reshape(4, 8) % pages, jnp.int32)

    def attend(q_lens, kv_lens, invariant):
        cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * (4 - len(q_lens))]).astype(np.int32)
        kv = np.array(list(kv_lens) + [0] * (4 - len(kv_lens)), np.int32)
        return np.asarray(ragged_paged_attention(q, k_pool, v_pool, jnp.asarray(kv), table, jnp.asarray(cu),
                                                 jnp.int32(len(q_lens)), sm_scale=0.125, backend="cpu",
                                                 batch_invariant=invariant))

    # sequence 0's 12 queries in one chunk against the same queries alone (one a call)
    chunk = attend([12], [60], True)
    for i in range(12):
        single = np.asarray(ragged_paged_attention(
            q[i:i + 1], k_pool, v_pool, jnp.asarray([49 + i, 0, 0, 0], jnp.int32), table,
            jnp.asarray([0, 1, 1, 1, 1], jnp.int32), jnp.int32(1), sm_scale=0.125, backend="cpu",
            batch_invariant=True))
        np.testing.assert_array_equal(chunk[i], single[0])
    np.testing.assert_allclose(attend([12], [60], False), chunk, rtol=2e-5, atol=2e-6)  # same math, other order


def test_the_pallas_tiling_is_one_for_every_batch():
    """The GPU kernel's reduction order per query follows its tile config (query rows of a tile, keys a block, KV
    splits): batch-invariant mode fixes it for every (T, S), one call a step, no splits."""
    plans = {plan_kernel_calls(t, s, 4, 16, 128, 8, head_dim=128, itemsize=2, num_splits=1,
                               **batch_invariant_tiling(16))
             for t, s in [(1, 1), (4, 4), (16, 4), (64, 16), (512, 256), (8192, 256)]}
    assert {len(plan) for plan in plans} == {1}
    configs = {plan[0].cfg for plan in plans}
    assert len(configs) == 1
    cfg = configs.pop()
    assert (cfg.block_q, cfg.pages_per_block, cfg.num_splits) == (1, 8, 1)
    # the default plans differ with the batch (decode and prefill calls, split-KV for few tiles)
    assert len({plan_kernel_calls(t, s, 4, 16, 128, 8, head_dim=128, itemsize=2)
                for t, s in [(1, 1), (64, 16), (8192, 256)]}) == 3


@needs_native
def test_norms_and_dots_are_row_invariant_at_every_row_count():
    """One decoder layer on the batch-invariant product: each of 64 rows equals the row computed alone (XLA:CPU's
    own reduction and rsqrt change with the row count: the mode's reason for `Matmul.row_sums`)."""
    config = llama.LlamaConfig(vocab_size=260, num_hidden_layers=1, **HD64)
    params = init_params(config, jax.random.PRNGKey(0))
    p = jax.tree.map(lambda x: x[0], params["layers"])
    p = dict(p, wqkv=fuse_qkv(config, p.pop("wq"), p.pop("wk"), p.pop("wv")),
             w_gate_up=fuse_gate_up(p.pop("w_gate"), p.pop("w_up")))
    h = jnp.asarray(np.random.default_rng(0).standard_normal((64, 128)), jnp.float32)
    matmul = batch_invariant_matmul()

    def layer(h):
        cos, sin = llama.rope_tables(config, jnp.arange(h.shape[0], dtype=jnp.int32))
        return llama.decoder_layer(config, p, h, jnp.ones_like(cos[0]), jnp.zeros_like(sin[0]),
                                   lambda q, k, v: (q, None), matmul)[0]

    def compiled(rows):
        return jax.jit(layer).lower(h[:rows]).compile(compiler_options=CPU_SMALL_STEP_OPTIONS)

    one = compiled(1)
    alone = np.stack([np.asarray(one(h[j:j + 1]))[0] for j in range(64)])
    for rows in (3, 17, 64):
        np.testing.assert_array_equal(np.asarray(compiled(rows)(h[:rows])), alone[:rows])


@needs_native
def test_unpacked_drafts_logits_are_row_invariant():
    """Unpacked drafts' logits (`draft_logits`, "native"): each row the same to the bit at every row count, the head
    (a vocabulary no multiple of 64) and final norm on the native kernels as in the step (XLA's dots, without the
    mode, differ in about a third of the values here)."""
    config = llama.LlamaConfig(vocab_size=260, num_hidden_layers=1, tie_word_embeddings=False, **HD64)
    params = init_params(config, jax.random.PRNGKey(0))
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((24, 128)), jnp.float32)

    def logits(rows: np.ndarray) -> np.ndarray:
        return np.asarray(step_program.draft_logits(config, params, hidden, rows, batch_invariant="native"))

    alone = np.stack([logits(np.array([j], np.int32))[0] for j in range(24)])
    for rows in (3, 17, 24):
        np.testing.assert_array_equal(logits(np.arange(rows, dtype=np.int32)), alone[:rows])

def test_bad_settings_are_refused(hd64_checkpoint):
    with pytest.raises(ValueError, match="must be a bool"):
        EngineArgs(batch_invariant=1)
    with pytest.raises(ValueError, match="int8"):
        EngineArgs(batch_invariant=True, quantization="int8")
    with pytest.raises(ValueError, match="int8"):
        RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=16, num_pages=10,
                     quantization="int8", batch_invariant=True)
    if jax.default_backend() == "cpu":  # XLA's dots would run the weight products
        with pytest.raises(ValueError, match="float32 weights"):
            LLM(model=str(hd64_checkpoint), **{**ARGS, "dtype": "bfloat16"})


def test_cli_flag():
    from server.__main__ import build_parser, engine_args

    assert engine_args(build_parser().parse_args(["--batch-invariant"])).batch_invariant is True
    assert engine_args(build_parser().parse_args([])).batch_invariant is False


def test_the_gpu_gets_the_kernel_the_cpu_a_refusal(caplog):
    from jaxpaged.worker.runner_config import check_batch_invariant

    check_batch_invariant(True, "cpu")  # packed weights: fine, silently
    with pytest.raises(ValueError, match="XLA's own dots"):
        check_batch_invariant(False, "cpu")
    with caplog.at_level("INFO"):
        check_batch_invariant(False, "gpu")
    assert "weight dots, the LM head and the norms' sums on the fixed-tile Pallas GEMM" in caplog.text
    with pytest.raises(ValueError, match="quantization='fp8'.*serve the checkpoint unquantized"):
        check_batch_invariant(False, "gpu", quantization="fp8")
    with pytest.raises(ValueError, match="one device"):
        check_batch_invariant(False, "gpu", sharded=True)
    with caplog.at_level("WARNING"):
        check_batch_invariant(False, "tpu")
    assert "not batch-invariant there" in caplog.text
    with pytest.raises(ValueError, match="fuse_projections=True"):  # the unfused q/k/v, gate/up are XLA's einsums
        RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=16, num_pages=10,
                     fuse_projections=False, batch_invariant=True)
    with pytest.raises(ValueError, match="fuse_projections=True"):  # refused before the model loads
        EngineArgs(fuse_projections=False, batch_invariant=True)


# ----------------------------------------------------------------------------- on the GPU: the fixed-tile GEMM

GPU_MODEL = llama.LlamaConfig(vocab_size=200, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                              tie_word_embeddings=True)
_KERNEL_NAME = re.compile(r'name = "(batch_invariant_matmul_\w+)"')


@pytest.mark.parametrize("tied", [True, False], ids=["tied head", "own head"])
def test_the_gpu_step_runs_every_weight_dot_on_the_kernel(tied):
    """The step lowered for CUDA from this CPU (bfloat16 weights, the Pallas attention): with batch_invariant=True
    the one traced layer's four weight dots (wqkv, wo, w_gate_up, w_down) and the LM head (a tied one's [V, E]
    embedding too) are the fixed-tile GEMM's custom calls, the norms' sums (the layer's two, the final one) its
    16-wide product, and no dot_general is left; without it, none; lowered for the CPU, none either (XLA's dots)."""
    config = dataclasses.replace(GPU_MODEL, tie_word_embeddings=tied)
    params = init_params(config, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    counts = {}
    for invariant in (True, False):
        runner_config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=16,
                                     num_pages=32, attention_backend="pallas", min_token_bucket=1,
                                     batch_invariant=invariant)
        runner = runner_module.ModelRunner(config, params, runner_config)
        gpu_params = to_weight_layout(config, params, runner.layout)  # as a GPU runner holds them (head not untied)
        step = runner.prepare([ScheduledRequest("a", (11,), 40, (3, 7, 9), True, SamplingParams(), 41)])
        with cuda_compile.gpu_target():
            text = runner.lower(step, params=gpu_params, platforms=("cuda",)).as_text()
        names = _KERNEL_NAME.findall(text)
        counts[invariant] = {name: names.count(name) for name in set(names)}
        if invariant:
            assert "stablehlo.dot_general" not in text
    assert counts == {True: {"batch_invariant_matmul_m64_n64_k64": 5, "batch_invariant_matmul_m64_n16_k32": 3},
                      False: {}}
    cpu_runner = runner_module.ModelRunner(config, params, dataclasses.replace(
        runner_config, attention_backend="xla", batch_invariant=True))
    cpu_text = cpu_runner.lower(step, params=gpu_params).as_text()
    assert "batch_invariant_matmul" not in cpu_text and "stablehlo.dot_general" in cpu_text



@pytest.mark.parametrize("program", ["prompt_logprobs_step", "draft_logits"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied head", "own head"])
def test_the_gpu_head_outside_the_step_runs_on_the_kernel(tied, program):
    """Prompt log-probs and unpacked drafts' logits as a GPU runner in the mode computes them (`invariant_head`
    "gemm"), lowered for CUDA from this CPU: the head (a tied one's [V, E] embedding too) is the fixed-tile GEMM's
    custom call, the final norm's sum its 16-wide product, no dot_general left; without the mode, XLA's dot."""
    config = dataclasses.replace(GPU_MODEL, tie_word_embeddings=tied)
    params = init_params(config, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    runner = runner_module.ModelRunner(config, params, RunnerConfig(
        max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=16, num_pages=32,
        attention_backend="pallas", min_token_bucket=1, batch_invariant=True))
    assert runner.invariant_head == "gemm"
    gpu_params = to_weight_layout(config, params, runner.layout)
    hidden, rows = jnp.zeros((8, config.hidden_size), jnp.bfloat16), np.zeros(8, np.int32)  # targets / rows
    texts = {}
    for mode in ("gemm", None):
        with cuda_compile.gpu_target():
            texts[mode] = getattr(step_program, program).trace(config, gpu_params, hidden, rows,
                                                               batch_invariant=mode).lower(
                lowering_platforms=("cuda",)).as_text()
    names = _KERNEL_NAME.findall(texts["gemm"])
    assert {name: names.count(name) for name in set(names)} == {
        "batch_invariant_matmul_m64_n64_k64": 1, "batch_invariant_matmul_m64_n16_k32": 1}
    assert "stablehlo.dot_general" not in texts["gemm"]
    assert "batch_invariant_matmul" not in texts[None] and "stablehlo.dot_general" in texts[None]

def test_off_cuda_the_invariant_matmul_is_xlas_dots():
    """Where a step is not lowered for CUDA (here the CPU), `gpu_invariant_matmul`'s products and sums are XLA's
    ops: float32 results equal to jnp's (the tied head's transposed product too)."""
    from jaxpaged.worker.invariant_dots import gpu_invariant_matmul

    rng = np.random.default_rng(4)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((5, 48), (48, 24)))
    matmul = gpu_invariant_matmul()
    got, got_t = jax.jit(matmul.fn)(x, w), jax.jit(matmul.fn_t)(x, w.T)
    want = jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32)
    assert got.dtype == got_t.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want))
    sums = jax.jit(matmul.row_sums)(x.reshape(5, 2, 24))
    np.testing.assert_allclose(np.asarray(sums)[..., 0], np.asarray(x, np.float32).reshape(5, 2, 24).sum(-1),
                               rtol=1e-6, atol=1e-6)

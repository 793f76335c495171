"""The step programs: pure functions of (params, KV pool, step input) that one jitted call runs per step.

`paged_forward` is the forward over the donated, page-indexed KV pool, returning the logits of each sequence's
last fed token and the updated pool; `fused_step` runs the sampler in the same program (and fills the tokens of a
step in flight on the device); `prompt_logprobs_step` scores prompt tokens. Shapes: jaxpaged/worker/step_input.py.

The fused sampler (`RunnerConfig.fuse_sampler`; on with a GPU by default): one jitted program per step,
`fused_step`, gathers the placeholder tokens, runs the forward, samples every row (in_step.sample_in_step:
grammar bitmask, logit_bias, penalties, greedy and candidate sampling, the sampled ids' raw log-probs) and
counts the accepted packed drafts, so a step is one executable call. The sampler's inputs are then built
before the dispatch: the grammar bitmask is filled first (execute_model), and in `dispatch` the rows are
known at once (penalties count the token in flight on the device); a step with a constrained row under
async scheduling, or with a fault injector, takes the fused program's logits and samples in separate
programs as before. What only some steps need stays in separate programs, run only then: the sampler's
exact fallbacks (bisection, full-vocabulary noise), the top log-probs (a vocabulary top-k: a sort on
XLA:GPU), unpacked drafts and prompt log-probs. Two fused programs per (T, S, P) bucket, the host picking
as the separate sampler does: greedy-only batches (argmax) and batches with random rows (the candidate
pass); no lax.cond (XLA:GPU reads a conditional's predicate back to the host unless the branches fit a
command buffer, which would stall async scheduling; XLA:CPU pays for untaken branches). Absent optional
sampler arrays (penalty counts, prompt mask, grammar bitmask) are device-resident neutral ones.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpaged.models.llama import (
    LlamaConfig,
    Params,
    decoder_layer,
    embed_tokens,
    layer_constants,
    lm_logits,
    rope_frequencies,
    rope_tables,
)
from jaxpaged.models.weight_dots import Matmul, PackedWeight, with_live_rows
from jaxpaged.sample import in_step, sampler
from jaxpaged.sample.sampling_batch import SamplingBatch
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.spec_decode.verify import accept_drafts, merge_redrafts
from jaxpaged.worker import parallel
from jaxpaged.worker.host_memory import HugePageArena, cpu_array_over
from jaxpaged.worker.in_flight import fill_in_flight, outputs_in_flight, steps_moved_back
from jaxpaged.worker.invariant_dots import gpu_invariant_matmul
from jaxpaged.worker.runner_config import INT8_DOTS, AttentionConfig
from jaxpaged.worker.step_input import HostLayout, KVPool, StepInput, pad_sampled_tokens, unpack_host_inputs
from pallas_kernels import cpu_matmul, cpu_rope, cpu_sampler, ragged_paged_attention, write_kv_inner


def batch_invariant_matmul() -> Matmul:
    """The weight dots and norms of batch-invariant mode on the CPU: the native matmul at every row count (its
    rows each sum over K in one order at any M), the norms' sums through it (`cpu_matmul.row_sums_cpu`)."""
    return Matmul(functools.partial(cpu_matmul.matmul_cpu, any_rows=True),
                  functools.partial(cpu_matmul.supports, any_rows=True), cpu_matmul.row_sums_cpu)


def head_matmul(batch_invariant: str | None) -> Matmul | None:
    """The LM head's and final norm's dots outside the step (`ModelRunner.invariant_head`), as the step runs them:
    "native" the native CPU kernels, "gemm" the fixed-tile GEMM where lowered for CUDA, None XLA's."""
    if batch_invariant == "native":
        return batch_invariant_matmul()
    return gpu_invariant_matmul() if batch_invariant == "gemm" else None


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("batch_invariant",))
def draft_logits(config: LlamaConfig, params: Params, hidden: jax.Array, rows: jax.Array, *,
                 batch_invariant: str | None = None) -> jax.Array:
    """hidden [T, E] (paged_forward's), rows i32[X] -> logits f32[X, V] at those fed tokens: unpacked drafts'
    second pass over the LM head (spec_decode/verify.py's `DraftRows`); batch_invariant: `head_matmul`'s."""
    return lm_logits(config, params, hidden[rows], head_matmul(batch_invariant))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("batch_invariant",))
def prompt_logprobs_step(config: LlamaConfig, params: Params, hidden: jax.Array, targets: jax.Array, *,
                         batch_invariant: str | None = None):
    """hidden [T, E] (paged_forward's), targets i32[T] -> the targets' log-probs f32[T], ranks i32[T],
    top ids i32[T, K] and top log-probs f32[T, K] (K = MAX_LOGPROBS) under the raw distribution.
    batch_invariant (static; `ModelRunner.invariant_head`): the head and norm as the step's (`head_matmul`), so a
    token's values do not depend on T; "native" takes the log-sum-exp per row natively (cpu_sampler.row_stats_cpu),
    "gemm" (a GPU) XLA's row reduction, as the sampler's."""
    logits = lm_logits(config, params, hidden, head_matmul(batch_invariant))  # [T, V]
    if batch_invariant == "native":
        logprobs = logits - cpu_sampler.row_stats_cpu(logits, logits)[1][:, None]
    else:
        logprobs = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]  # [T]
    ranks = jnp.sum(logprobs > target[:, None], axis=-1, dtype=jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return target, ranks, top_ids.astype(jnp.int32), top_logprobs


def _attend_paged(q, k, v, k_pool, v_pool, step: StepInput, layer, window, scales=None, *, sm_scale: float,
                  attention: AttentionConfig):
    """Write this step's k/v [T, K, D] into the pool, then attend q [T, H, D] -> (o, k_pool, v_pool).

    The pool may hold another dtype than the model's (kv_cache_dtype): k/v and q
    are cast to it, the output back to q's dtype; an fp8 pool (scales: this layer's (k_scale, v_scale) f32 [K])
    is written quantized and read with the scales, q kept in the model's dtype (f32 where that is bf16 on
    CPU, as a float pool's would be). window: this layer's sliding window (int32 scalar, 0 = none), or None
    when no layer of the model has one."""
    k_scale, v_scale = (None, None) if scales is None else scales
    kp, vp = write_kv_inner(k_pool, v_pool, k, v, step.slot_mapping, layer=layer, k_scale=k_scale, v_scale=v_scale)
    q_dtype = kp.dtype if scales is None else _fp8_query_dtype(q.dtype)
    o = ragged_paged_attention(q.astype(q_dtype), kp, vp, step.kv_lens, step.page_table, step.cu_q_lens,
                               step.num_seqs, sm_scale=sm_scale, layer=layer, backend=attention.backend,
                               max_num_partial_prefills=attention.max_num_partial_prefills, sliding_window=window,
                               batch_invariant=attention.batch_invariant, k_scale=k_scale, v_scale=v_scale)
    return o.astype(q.dtype), kp, vp


def _fp8_query_dtype(model_dtype):
    """The queries' dtype over an fp8 pool: the model's, except bf16 on CPU, which gets f32 (for the reason a
    float pool does there: runner_config.resolve_kv_cache_dtype; and the native CPU kernel reads f32 queries)."""
    if jnp.dtype(model_dtype) == jnp.bfloat16 and jax.default_backend() == "cpu":
        return jnp.float32
    return model_dtype


def paged_forward(config: LlamaConfig, attention: AttentionConfig, params: Params, kv: KVPool,
                  step: StepInput, mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, KVPool]:
    """Logits f32[S, V] at each sequence's last fed token, the final hidden states [T, E] of every
    fed token (before the final norm; `prompt_logprobs_step` turns rows of it into prompt
    log-probabilities, no second forward), and the updated pool.

    params["layers"] is either stacked ({name: [L, ...]}, scanned: one layer compiled; packed weights, a
    stack each, are read at the layer's index in place) or a list of L per-layer dicts (a Python loop of L
    calls of one traced layer: XLA inlines them, so L layers compiled, but no weight is sliced out of a
    stack, which XLA:GPU may copy before each gemm), with fused projections or not
    (jaxpaged/worker/weight_layout.py). With a mesh, attention runs per tensor-parallel shard
    (local heads, local pool slice).
    """
    attend_paged = functools.partial(_attend_paged, sm_scale=config.attn_scale, attention=attention)
    if mesh is not None:
        attend_paged = parallel.shard_attention(attend_paged, mesh)
    # decode-sized weight dots on CPU (cpu_matmul.supports); not with a mesh: the call has no sharding rule
    use_native = attention.native_matmul and mesh is None
    matmul = Matmul(cpu_matmul.matmul_cpu, cpu_matmul.supports) if use_native else None
    if use_native and attention.batch_invariant:  # every row count on the native call, the norms' sums too
        matmul = batch_invariant_matmul()
    elif attention.batch_invariant:  # a GPU's: the fixed-tile Pallas GEMM where the step is lowered for CUDA
        matmul = gpu_invariant_matmul()
    consts = layer_constants(config)  # per layer: window [L], row of the RoPE tables [L]
    if kv.k_scale is not None:  # an fp8 pool: its scales [L, K], each layer's scanned or picked with it
        consts = dict(consts, k_scale=kv.k_scale, v_scale=kv.v_scale)
    if use_native and cpu_rope.load_cpu_rope():  # one call: XLA:CPU would redo the cosines in every layer
        cos_table, sin_table = cpu_rope.rope_tables_cpu(step.positions, rope_frequencies(config))  # [U, T, D]
    else:
        cos_table, sin_table = rope_tables(config, step.positions)

    def layer_fn(carry, xs, step, cos_table, sin_table):
        h, k_pool, v_pool = carry
        layer_params, layer, c = xs
        cos, sin = cos_table[c["rope"]], sin_table[c["rope"]]  # [T, D]
        window = c["window"] if config.has_sliding_window else None

        def attend(q, k, v):  # q [T, H, D], k/v [T, K, D]: write first, then attend
            # an fp8 pool's scales f32 [K] each, this layer's (none with a mesh: shard_attention takes 8 inputs)
            scales = ((c["k_scale"], c["v_scale"]),) if "k_scale" in c else ()
            o, kp, vp = attend_paged(q, k, v, k_pool, v_pool, step, layer, window, *scales)
            return o, (kp, vp)

        h, (k_pool, v_pool) = decoder_layer(config, layer_params, h, cos, sin, attend, matmul)
        return h, k_pool, v_pool

    carry = (embed_tokens(params, step.token_ids, config), kv.k, kv.v)  # h [T, E], the pool
    # packed layer weights compute the step's real tokens only (padding comes last: cu_q_lens[-1] of T)
    params = dict(params, layers=with_live_rows(params["layers"], step.cu_q_lens[-1]))
    h, k, v = _over_layers(layer_fn, params["layers"], consts, carry, (step, cos_table, sin_table))
    logits = lm_logits(config, params, h[step.logits_indices], matmul)  # [S, V]
    return logits, h, KVPool(k, v, kv.k_scale, kv.v_scale)


def _over_layers(layer_fn, layers, consts: dict, carry, args: tuple):
    """`layer_fn(carry, (layer_params, layer, consts[layer]), *args)` over every layer: a Python loop over
    per-layer weights (a list) or a scan over stacked ones (a dict of [L, ...])."""
    if isinstance(layers, Sequence):
        # One traced layer called L times: XLA inlines the calls (the program is the unrolled one), but
        # Python traces and lowers one layer, not L, per step shape, which shortens start-up
        traced_layer = jax.jit(layer_fn)
        for layer, layer_params in enumerate(layers):
            c = jax.tree.map(lambda x, i=layer: x[i], consts)
            carry = traced_layer(carry, (layer_params, jnp.int32(layer), c), *args)
        return carry
    # Packed weights (the native CPU matmul's blocks, stacked) stay out of the scanned xs: each layer's
    # product reads its layer of the whole stack in place, where a scanned slice would be copied out
    packed = {n: w for n, w in layers.items() if isinstance(w, PackedWeight)}
    sliced = {n: w for n, w in layers.items() if n not in packed}

    def body(carry, xs):
        layer_params, layer, c = xs
        layer_params = {**layer_params, **{n: w.at_layer(layer) for n, w in packed.items()}}
        return layer_fn(carry, (layer_params, layer, c), *args), None

    layer_ids = jnp.arange(consts["window"].shape[0], dtype=jnp.int32)  # [L]
    carry, _ = jax.lax.scan(body, carry, (sliced, layer_ids, consts))
    return carry


def fused_step(config: LlamaConfig, attention: AttentionConfig, random: bool, params: Params, kv: KVPool,
               step: StepInput, sampling: SamplingBatch) -> tuple[FusedSample, jax.Array, KVPool]:
    """One step in one program: placeholder tokens gathered from the previous step's (async scheduling; positions
    moved back by its rejected drafts, drafts proposed on the device fed: `fill_in_flight`; key steps too:
    `steps_moved_back`; penalty counts given the tokens in flight: `outputs_in_flight`),
    `paged_forward`, the sampler's common part (`in_step.sample_in_step`: bitmask, bias, penalties, argmax,
    or the candidate pass when `random` (static: some row samples at random), the sampled ids' raw
    log-probs) and the acceptance of packed drafts. Returns ((sample, num_accepted, next_tokens): `FusedSample`),
    the hidden states [T, E] and the updated pool (donated)."""
    step = fill_in_flight(step, sampling.previous_tokens, sampling.previous_rejected, sampling.sources,
                          sampling.shifts, kv.k.shape[3], sampling.redraft)
    token_ids = step.token_ids  # i32[T]
    logits, hidden, kv = paged_forward(config, attention, params, kv, step)  # f32[S, V], [T, E]
    last = step.logits_indices  # i32[S]
    # rows of a request fed the previous step's token as a placeholder: the host's penalty counts lack it, the drafts
    # it accepted and the drafts fed before the row
    fed = outputs_in_flight(token_ids, last, sampling.count_from, sampling.shifts, sampling.previous_accepted)
    batch = dataclasses.replace(sampling, steps=steps_moved_back(sampling.steps, last, sampling.shifts,
                                                                 sampling.previous_rejected))
    sample = in_step.sample_in_step(logits, batch, fed, random=random, native=attention.native_matmul)
    draft_ids = merge_redrafts(sampling.draft_ids, sampling.redraft)  # i32[S, k]
    num_accepted = accept_drafts(sample.token_ids, sampling.draft_rows, draft_ids)  # i32[S]
    next_tokens = pad_sampled_tokens(sample.token_ids, sampling.previous_tokens.shape[0])
    return (sample, num_accepted, next_tokens), hidden, kv


def packed_fused_step(config: LlamaConfig, attention: AttentionConfig, random: bool, layout: HostLayout,
                      params: Params, kv: KVPool, buffer: jax.Array, others: list) -> tuple[FusedSample, jax.Array,
                                                                                           KVPool]:
    """`fused_step` over (step, sampling) as `pack_host_inputs` packed them (layout static): the program the runner
    calls, its host arrays one transfer."""
    step, sampling = unpack_host_inputs(layout, buffer, others)
    return fused_step(config, attention, random, params, kv, step, sampling)


# A fused step's sampling results, on device (held by `PendingStep`, or read at once by a synchronous step):
# the sampler's unfinished output (before its rare fallbacks: `in_step.finish_in_step`); i32[S] slot m's accepted
# drafts, valid when no fallback changed a token; i32[R] the sampled ids zero-padded, the next step's previous_tokens
FusedSample = tuple[sampler.SamplerOutput, jax.Array, jax.Array]


def _pack_for_cpu_matmul(w: jax.Array, shape: tuple[int, ...], arena: HugePageArena,
                         quantization: str | None = None) -> PackedWeight | None:
    """A weight dot's 2-D view w [K, N] (stacked layers: [L, K, N]) as the native CPU matmul's contiguous
    column blocks [N / 64, K, 64] ([L, N / 64, K, 64]; one stream per block: one row of x reads them ~1.4x
    faster than [K, N], docs/kernels.md), written by the host into `arena` (born on huge pages:
    host_memory); None where it can't take w. quantization "int8" or "w8a8": the blocks hold `quantize_int8`'s int8
    values, its scales (per column and run of 32 rows) blocked alike beside them, [(L,) N / 64, K / 32, 64];
    quantised a layer at a time, so the host's temporaries stay a few times one layer's weight."""
    if not cpu_matmul.blockable(w):
        return None
    host = np.asarray(w)  # [(L,) K, N]: a view of w's CPU buffer
    *lead, k, n = host.shape
    dtype = host.dtype if quantization is None else np.int8
    blocks = arena.empty((*lead, n // cpu_matmul.BLOCK_COLS, k, cpu_matmul.BLOCK_COLS), dtype)
    if quantization is None:
        np.copyto(blocks, cpu_matmul.block_weight(host))
        return PackedWeight(cpu_array_over(blocks), tuple(shape), cpu_matmul.matmul_cpu)
    runs = -(-k // cpu_matmul.GROUP_SIZE)
    scale = np.empty((*lead, n // cpu_matmul.BLOCK_COLS, runs, cpu_matmul.BLOCK_COLS), np.float32)
    for layer in np.ndindex(*lead):  # () once for one layer's w
        q, s = cpu_matmul.quantize_int8(host[layer])  # int8 [K, N], f32 [K / 32, N]
        np.copyto(blocks[layer], cpu_matmul.block_weight(q))
        np.copyto(scale[layer], cpu_matmul.block_weight(s))
    return PackedWeight(cpu_array_over(blocks), tuple(shape), INT8_DOTS[quantization], scale=jnp.asarray(scale))

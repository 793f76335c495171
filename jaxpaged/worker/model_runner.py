"""Model runner: scheduler output -> padded step input -> one jitted paged forward -> sampled tokens.

`ModelRunner.execute_model(scheduler_output)` is the engine's one call per step: it
packs the scheduled requests (`prepare`), runs the forward (`execute`), calls the
`fault_injector(entries, logits) -> logits` test hook if one is set, samples every
row that samples (the per-request sampler state rides on each `ScheduledRequest`:
seed, num_output_tokens, banned ids, prompt/output ids) and returns a host-side
`ModelRunnerOutput`.

Async scheduling (the engine's overlapped loop) splits that call in three:
`dispatch(scheduler_output, previous)` packs the step, fills its placeholder tokens
from the previous step's sampled tokens ON THE DEVICE (`pad_sampled_tokens`, then
`merge_sampled_tokens`'s gather; no host round trip) and dispatches the forward; `dispatch_sample(pending)`
dispatches the sampler once the host has handled the previous step's outputs (so
penalties and grammar masks see its tokens); `pending.result()` brings the sampled
tokens to the host. Same programs, same results as `execute_model`. Speculative decoding: a dispatched
step may verify drafts, and the next one be packed before their outcome is known, as if all were accepted:
`PendingStep.carry` gives, per row, the token fed next (the sample at the first rejected draft, or the
bonus token) and the drafts rejected, by which `fill_in_flight` moves that request's positions, slots and
KV length back on the device.

The fused sampler (`RunnerConfig.fuse_sampler`; on with a GPU by default): one jitted program per step,
`fused_step`, gathers the placeholder tokens, runs the forward, samples every row (sampler.sample_in_step:
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

The step is a pure function of (params, KV pool, step input) returning the
logits of each sequence's last fed token and the updated pool (donated, so it
is written in place). Token count T, sequence slots S and page-table width P
are padded to a small set of (T, S, P) buckets, all compiled at warm-up; the
bucket rules live in one place, `RunnerConfig` (its docstring and properties).
Logits come from L rows: S (each sequence's last fed token), or T for a speculative
verification in a `RunnerConfig.verify_buckets` shape whose drafts do not fit in S
(its drafts' logits then come from the step's own LM head, not a second pass).

KV pool (stacked over layers, scanned with the params):
    k, v: [L, K, N, page_size, D]   N pages, page 0 the null page

With a mesh (tensor parallelism, see jaxpaged/worker/parallel.py) the params and the
pool are sharded over it, attention runs per shard under shard_map, and the
logits come back replicated.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import operator
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpaged.worker import parallel
from jaxpaged.sample import sampler
from jaxpaged.worker.kept_rows import KeptRows
from jaxpaged.worker.host_memory import HugePageArena, advise_huge_pages, advise_zeroed_huge_pages, cpu_array_over
from jaxpaged.worker.weight_layout import check_weight_layout, resolve_weight_layout, to_weight_layout

from jaxpaged.models.llama import (LlamaConfig, Matmul, PackedWeight, Params, WeightLayout, decoder_layer,
                                   embed_tokens, layer_constants, lm_logits, pack_weights, rope_frequencies,
                                   rope_tables, untie_lm_head, with_live_rows)
from jaxpaged.sample.sampler import (RowInfo, SamplerOutput, SamplingBatch, make_sampling_batch, num_top_logprobs_for,
                              sample_deferred, sample_jit)
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxpaged.core.scheduler import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from jaxpaged.spec_decode.ngram import ngram_drafts
from pallas_kernels import ragged_paged_attention, write_kv_inner
from pallas_kernels import cpu_attention, cpu_build, cpu_matmul, cpu_rope, cpu_sampler
from pallas_kernels.cpu_attention import load_cpu_attention

logger = logging.getLogger(__name__)

_MAX_COMPILE_THREADS = 8  # warm-up compiles its programs in parallel on up to this many threads (half the cores)
_WARMUP_BARRIER_SECONDS = 1800.0  # multi-host: how long a process waits for the others to finish warming up
ATTENTION_BACKENDS = ("auto", "reference", "xla", "cpu", "pallas")
FUSE_SAMPLER = ("auto", "on", "off")  # RunnerConfig.fuse_sampler: the sampler inside the step program
KV_CACHE_DTYPES = {"auto": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: choose one of {tuple(KV_CACHE_DTYPES)}")


def check_fuse_sampler(fuse_sampler: str) -> None:
    if fuse_sampler not in FUSE_SAMPLER:
        raise ValueError(f"fuse_sampler={fuse_sampler!r}: choose one of {FUSE_SAMPLER}")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype, platform: str) -> np.dtype:
    """The KV pool's dtype. "auto" is the model's, except bf16 on CPU, which gets f32.

    XLA:CPU has no bf16 scatter: it converts the whole pool to f32 and back around
    each layer's KV write, so a decode step costs two passes over the pool per layer
    (over 100x an f32 pool's step: docs/benchmarks.md, "the KV cache dtype"). The CPU attention
    path computes in f32 anyway; the price is half as many pages for the same bytes.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype != "auto":
        return np.dtype(KV_CACHE_DTYPES[kv_cache_dtype])
    if np.dtype(model_dtype) == np.dtype(jnp.bfloat16) and platform == "cpu":
        return np.dtype(np.float32)
    return np.dtype(model_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    k: jax.Array  # [L, K, N, page_size, D]
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """One padded step. Padding tokens write to the null page and are not attended."""

    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]  page * page_size + offset
    page_table: jax.Array  # i32[S, P]  padded with the null page 0
    kv_lens: jax.Array  # i32[S]  tokens in the cache after this step
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[]
    logits_indices: jax.Array  # i32[L]  each sequence's last fed token, then draft positions (L = S, or T: see
    # RunnerConfig.verify_buckets); padding rows read token 0


# XLA:CPU library fusions for dots (YNNPACK, a dot with its elementwise neighbours). jaxlib 0.10.2's
# default already sends each dot and reduction to YNNPACK one by one; this setting fused the step's
# dots with their neighbours and was the fastest set measured (docs/benchmarks.md, "XLA:CPU options").
# 512-bit vectors where the CPU has them (XLA:CPU prefers 256): a one-row decode's matrix-vector products
# are XLA's own reductions, not library calls, and ran ~10% faster (batch-1 step 17.4 -> 15.6 ms with
# per-layer weights, SmolLM2 f32, AVX-512 machine; no change at batch 32 or in prefill; docs/benchmarks.md).
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
                        "xla_cpu_prefer_vector_width": "512"}
# Steps of at most CPU_SMALL_STEP_TOKENS tokens (a few decodes, a speculative verification) compile without
# YNNPACK: XLA's own dots ran a 2-16-row matmul stack 5-30% faster than YNNPACK's, which wins from ~32 rows
# on (docs/benchmarks.md, "XLA:CPU options per step shape").
CPU_SMALL_STEP_TOKENS = 16
CPU_SMALL_STEP_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_prefer_vector_width": "512"}
# Speculative decoding without the fused sampler: a verification step of at most this many tokens (T bucket)
# whose drafts do not fit in its S logits rows takes T rows, all from its own LM head, instead of a second
# LM-head pass over the draft positions (`draft_logits`). Above it the T-row head would cost more than that
# pass (a long prefill chunk beside the drafts); each such bucket is one more program at warm-up.
VERIFY_LOGITS_MAX_TOKENS = 64


@functools.cache
def cpu_compiler_options(platform: str | None = None, num_tokens: int | None = None) -> dict[str, str]:
    """XLA options the runner compiles a step of `num_tokens` tokens (T; None: any) with: on CPU,
    CPU_SMALL_STEP_OPTIONS up to CPU_SMALL_STEP_TOKENS, else CPU_COMPILER_OPTIONS, when this jaxlib accepts
    them (checked once on a tiny program; else none, with a warning); none on other platforms."""
    if (platform or jax.default_backend()) != "cpu":
        return {}
    options = CPU_SMALL_STEP_OPTIONS if num_tokens is not None and num_tokens <= CPU_SMALL_STEP_TOKENS else \
        CPU_COMPILER_OPTIONS
    return dict(options) if _xla_cpu_accepts(tuple(sorted(options.items()))) else {}


@functools.cache
def _xla_cpu_accepts(options: tuple[tuple[str, str], ...]) -> bool:
    """Whether this jaxlib compiles a tiny program with `options` (once per option set, not per step shape)."""
    try:
        x = np.ones((2, 2), np.float32)
        jax.jit(lambda a: a @ a, compiler_options=dict(options)).lower(x).compile()
    except Exception as err:  # an XLA that does not know the option
        logger.warning("XLA:CPU does not take %s (%s); compiling with its defaults", dict(options), err)
        return False
    return True


# XLA:GPU command buffers (CUDA graphs): the kinds of work XLA records into graphs that replay with one
# launch (`xla_gpu_enable_command_buffer`). "xla": XLA's own default set; "off": every kernel launched one
# by one (the baseline that shows the launch overhead); "full": also while loops and conditionals, so a
# step's layer loop and attention's branches sit inside graphs too. RunnerConfig.command_buffers picks one;
# scripts/bench_engine_gpu.py times the batch-1 forward under each.
GPU_COMMAND_BUFFERS: dict[str, str | None] = {
    "xla": None, "off": "", "full": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}
DEFAULT_GPU_COMMAND_BUFFERS = "full"  # "auto"; unmeasured on a GPU so far (docs/benchmarks.md, issue 15)


def command_buffer_options(command_buffers: str) -> dict[str, str]:
    """The XLA:GPU option of a GPU_COMMAND_BUFFERS choice ("auto": DEFAULT_GPU_COMMAND_BUFFERS)."""
    value = GPU_COMMAND_BUFFERS[DEFAULT_GPU_COMMAND_BUFFERS if command_buffers == "auto" else command_buffers]
    return {} if value is None else {"xla_gpu_enable_command_buffer": value}


@functools.cache
def gpu_compiler_options(command_buffers: str = "auto", platform: str | None = None) -> dict[str, str]:
    """XLA options the runner compiles its step with on GPU: the command-buffer choice, checked once on a
    tiny program (an XLA that refuses it gets its defaults, with a warning); none on other platforms."""
    if (platform or jax.default_backend()) != "gpu":
        return {}
    options = command_buffer_options(command_buffers)
    try:
        x = np.ones((2, 2), np.float32)
        jax.jit(lambda a: a @ a, compiler_options=options).lower(x).compile()
    except Exception as err:  # an XLA that does not know the option or the value
        logger.warning("XLA:GPU does not take %s (%s); compiling with its defaults", options, err)
        return {}
    return options


@dataclasses.dataclass(frozen=True)
class ModelRunnerOutput:
    """What one step sampled, on the host: row r belongs to req_ids[r] (the entries that sample, in order).

    K = MAX_LOGPROBS when some row of the step asks for logprobs, else 0 (the sampler skips its top-k
    pass): the raw distribution's top ids and log-probs, most likely first.
    """

    req_ids: tuple[str, ...]
    sampled_token_ids: np.ndarray  # i32[R]
    logprobs: np.ndarray  # f32[R]; of sampled_token_ids under the raw model distribution
    top_token_ids: np.ndarray  # i32[R, K]
    top_logprobs: np.ndarray  # f32[R, K]
    finite: np.ndarray  # bool[R]; False: the row's logits held a NaN/inf, its token is garbage
    # the prompt tokens this step predicted, for the requests that asked (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[str, PromptLogprobs] = dataclasses.field(default_factory=dict)
    # Speculative decoding: for each request that fed drafts, the rows of its emitted tokens, in order (the
    # arrays above then hold more than R rows: the draft positions' samples follow the R rows), and how many
    # of its drafts were accepted. Other requests emit their one row.
    spec_token_rows: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    num_accepted_drafts: dict[str, int] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def req_id_to_index(self) -> dict[str, int]:
        return {rid: r for r, rid in enumerate(self.req_ids)}

    @functools.cached_property
    def row_values(self) -> tuple[list[int], list[float], list[bool]]:
        """(sampled_token_ids, logprobs, finite) as Python lists: the engine reads them row by row."""
        return self.sampled_token_ids.tolist(), self.logprobs.tolist(), self.finite.tolist()

    def token_rows(self, request_id: str) -> tuple[int, ...]:
        """The rows of the tokens `request_id` emits this step, in order (more than one only when it
        verified drafts: its accepted drafts, then the token sampled after them)."""
        rows = self.spec_token_rows.get(request_id)
        return rows if rows is not None else (self.req_id_to_index[request_id],)

    @classmethod
    def from_sampler(cls, entries: Sequence[ScheduledRequest], sampled: SamplerOutput,
                     prompt_logprobs: dict[str, PromptLogprobs] | None = None,
                     drafts: VerifiedDrafts | None = None) -> ModelRunnerOutput:
        rows = np.array([i for i, e in enumerate(entries) if e.samples], np.int64)
        arrays = [np.asarray(a)[rows] for a in (sampled.token_ids, sampled.logprobs, sampled.top_token_ids,
                                                 sampled.top_logprobs, sampled.finite)]
        req_ids = tuple(entries[i].request_id for i in rows)
        if drafts is None:
            return cls(req_ids, *arrays, prompt_logprobs or {})
        x = drafts.sampled  # its rows follow the R rows
        arrays = [np.concatenate([a, np.asarray(b)]) for a, b in zip(
            arrays, (x.token_ids, x.logprobs, x.top_token_ids, x.top_logprobs, x.finite))]
        index = {rid: r for r, rid in enumerate(req_ids)}
        ids = drafts.layout.request_ids
        token_rows = {rid: drafts.token_rows(m, len(rows), index[rid]) for m, rid in enumerate(ids)}
        accepted = {rid: int(drafts.num_accepted[m]) for m, rid in enumerate(ids)}
        return cls(req_ids, *arrays, prompt_logprobs or {}, token_rows, accepted)


@dataclasses.dataclass(frozen=True)
class DraftRows:
    """Where one step verifies its drafts: the draft positions of the M' entries that fed drafts, on a grid
    of M slots (a `draft_seq_buckets` size) x k positions (num_speculative_tokens).

    packed: the drafts fit in the step's padding logits rows (L - len(entries) of them: L = S, or T for a
    `verify_buckets` shape, which `prepare` picks when they do not fit in S; with the fused sampler `prepare`
    picks an S bucket with room for them, up to max_num_seqs rows): the forward's own LM head
    computes their logits (step.logits_indices points those rows at the draft positions) and they are sampled
    with the entries' rows, in one call. Otherwise `draft_logits` computes them from the forward's hidden
    states, M * k rows: a second pass over the LM head's weights (batch 1 on CPU, k = 7: the 8-token step's
    forward 25.9 ms, then 4.7 ms for that pass, its sampler call and their sync).
    """

    packed: bool
    request_ids: tuple[str, ...]  # the entries that fed drafts, in step order (slots 0..M'-1)
    num_drafts: tuple[int, ...]  # d of each
    sample_rows: np.ndarray  # i32[M, k]: the sampler row of each draft position (padding: row 0)
    draft_ids: np.ndarray  # i32[M, k]; -1 for no draft (never accepted)
    token_index: np.ndarray  # i32[N]: the fed token whose logits each draft row takes (N rows, in row order)
    rows: tuple[RowInfo, ...]  # the N draft rows' sampler state
    # i32[M, k] on the device: draft_ids with the slots the device proposed again (`redraft_in_flight`), the drafts
    # fed and verified; None: draft_ids are
    redrafted: jax.Array | None = None

    @property
    def verified_ids(self) -> np.ndarray | jax.Array:
        """i32[M, k]: the drafts the step feeds and verifies."""
        return self.draft_ids if self.redrafted is None else self.redrafted


@dataclasses.dataclass(frozen=True)
class VerifiedDrafts:
    """One step's draft verification: the draft rows' samples and the accepted drafts of each slot."""

    layout: DraftRows
    sampled: SamplerOutput  # holds the draft rows (at layout.sample_rows); numpy after `to_host`
    num_accepted: np.ndarray  # i32[M]: leading draft positions whose sample equals the draft

    def to_host(self) -> VerifiedDrafts:
        sampled, num_accepted = jax.device_get((self.sampled, self.num_accepted))
        return dataclasses.replace(self, sampled=sampled, num_accepted=num_accepted)

    def token_rows(self, m: int, first_row: int, main_row: int) -> tuple[int, ...]:
        """Slot m's emitted rows, `sampled`'s numbered from `first_row` on: its a accepted drafts' rows, then
        the row of the first rejected position, or `main_row` (the bonus token) when all d were accepted."""
        a, rows = int(self.num_accepted[m]), self.layout.sample_rows[m]
        last = (first_row + int(rows[a]),) if a < self.layout.num_drafts[m] else (main_row,)
        return tuple(first_row + int(r) for r in rows[:a]) + last


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """One request's prompt log-probabilities from one step (a chunk of its prompt), on the host.

    Row j is prompt token `first_index + j` given the tokens before it (token 0 has none).
    """

    first_index: int
    token_logprobs: np.ndarray  # f32[M]; of the prompt token under the raw model distribution
    ranks: np.ndarray  # i32[M]; 1 + how many tokens are more likely
    top_token_ids: np.ndarray  # i32[M, K]
    top_logprobs: np.ndarray  # f32[M, K]


def prompt_logprob_spans(entries: Sequence[ScheduledRequest]) -> dict[str, tuple[int, int, int, ScheduledRequest]]:
    """For each entry asking for prompt logprobs whose chunk predicts prompt tokens:
    (row offset of its first fed token in the step, first predicted prompt index, count, entry).

    The token fed at position q predicts token q + 1; only q + 1 < num_prompt_tokens are prompt."""
    spans, offset = {}, 0
    for entry in entries:
        if entry.sampling_params.prompt_logprobs is not None:
            count = min(entry.start_position + entry.num_tokens, entry.num_prompt_tokens - 1) - entry.start_position
            if count > 0:
                spans[entry.request_id] = (offset, entry.start_position + 1, count, entry)
        offset += entry.num_tokens
    return spans


@functools.partial(jax.jit, static_argnums=(0,))
def prompt_logprobs_step(config: LlamaConfig, params: Params, hidden: jax.Array, targets: jax.Array):
    """hidden [T, E] (paged_forward's), targets i32[T] -> the targets' log-probs f32[T], ranks i32[T],
    top ids i32[T, K] and top log-probs f32[T, K] (K = MAX_LOGPROBS) under the raw distribution."""
    logprobs = jax.nn.log_softmax(lm_logits(config, params, hidden), axis=-1)  # [T, V]
    target = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]  # [T]
    ranks = jnp.sum(logprobs > target[:, None], axis=-1, dtype=jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return target, ranks, top_ids.astype(jnp.int32), top_logprobs


@dataclasses.dataclass(eq=False)
class PendingStep:
    """A step dispatched by `ModelRunner.dispatch` (async scheduling); its device work may still run.

    Sampler row r is entry r (rows past the entries are padding); `rows` maps the entries that sample."""

    entries: tuple[ScheduledRequest, ...]
    step: StepInput  # host arrays, but token_ids: on the device when placeholders were filled
    logits: jax.Array | None  # f32[S, V]; dropped once the sampler is dispatched
    hidden: jax.Array | None  # [T, E]; idem
    finish_sample: Callable[[], SamplerOutput] | None = None  # set by dispatch_sample (sampler.sample_deferred)
    fused: FusedStep | None = None  # the fused sampler's device results (ModelRunner._dispatch_fused)
    batch: SamplingBatch | None = None  # the fused step's host batch (its fallbacks read it)
    num_top_logprobs: int = 0  # the fused step's (its finish adds the top log-probs when > 0)
    sampled: SamplerOutput | None = None  # finish_sample's result, once called (`sampler_output`)
    prompt_spans: dict | None = None  # prompt_logprob_spans(entries) when some entry asks
    prompt_arrays: tuple | None = None  # prompt_logprobs_step's device outputs over the spans
    layout: DraftRows | None = None  # speculative decoding: where the step verifies its drafts
    redraft: Redraft | None = None  # ... those the device proposed again (`redraft_in_flight`)
    drafts: VerifiedDrafts | None = None  # their verification, on device (set once the sampler's output is)
    carried: tuple[jax.Array, jax.Array, jax.Array] | None = None  # `carry`'s result, once called
    shifts: np.ndarray | None = None  # i32[T]: `_shift_rows`, when a verification was in flight at dispatch
    rejected: jax.Array | None = None  # i32[R]: its drafts rejected per row (its `carry`), with shifts

    @functools.cached_property
    def rows(self) -> dict[str, int]:
        return {e.request_id: i for i, e in enumerate(self.entries) if e.samples}

    def sampler_output(self) -> SamplerOutput:
        """The sampler's device output, its fallbacks dispatched (reads the sampler's flags: the host waits
        for the step's forward here, and only here, when some row samples at random)."""
        if self.sampled is None:
            if self.finish_sample is None:
                raise RuntimeError("the step's sampler was never dispatched (ModelRunner.dispatch_sample)")
            self.sampled, self.finish_sample = self.finish_sample(), None
            if self.layout is not None and self.drafts is None:  # packed drafts: counted on the final tokens
                self.drafts = verify_packed(self.layout, self.sampled, self.fused)
        return self.sampled

    def result(self) -> ModelRunnerOutput:
        """The step's sampled tokens on the host (waits for the device)."""
        sampled = self.sampler_output()
        prompt = {}
        if self.prompt_spans:
            out = jax.device_get(self.prompt_arrays)
            prompt = {rid: PromptLogprobs(first, *(a[offset:offset + count] for a in out))
                      for rid, (offset, first, count, _) in self.prompt_spans.items()}
        drafts = None if self.drafts is None else self.drafts.to_host()
        return ModelRunnerOutput.from_sampler(self.entries, jax.device_get(sampled), prompt, drafts)

    def key_steps(self, batch: SamplingBatch, token_index: np.ndarray) -> SamplingBatch:
        """The host `batch` of this step's sampler rows at fed tokens token_index i32[N], their key steps moved
        back as the device moved its own (`steps_moved_back`). Greedy rows read no key: a batch without random
        rows is returned as is; else this reads the drafts rejected in flight (waits for that step's sampler)."""
        if self.shifts is None or not has_random_rows(batch):
            return batch
        steps = steps_moved_back(np.asarray(batch.steps), token_index, self.shifts, np.asarray(self.rejected))
        return dataclasses.replace(batch, steps=steps)

    def carry(self, size: int) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """(i32[size], i32[size] or None, i32[size, k] or None): what the next step, dispatched before this one's
        tokens reach the host, takes from this one per sampler row: the token it feeds (`next_tokens`; for a row
        that verified drafts, the token sampled at its first rejected draft, or the bonus token), the drafts
        rejected, by which that row's positions (and key steps) were counted too far, and the drafts accepted
        (-1 past them), which its penalty counts lack (both None when no row verified any)."""
        if self.layout is None:
            return self.next_tokens(size), None, None
        if self.carried is None:
            sampled, drafts = self.sampler_output(), self.drafts
            entry_rows = np.full(len(drafts.layout.sample_rows), size, np.int32)  # i32[M]; padding slots: dropped
            index = {e.request_id: i for i, e in enumerate(self.entries)}
            entry_rows[:len(drafts.layout.request_ids)] = [index[rid] for rid in drafts.layout.request_ids]
            num_drafts = np.zeros(len(entry_rows), np.int32)
            num_drafts[:len(drafts.layout.num_drafts)] = drafts.layout.num_drafts
            self.carried = carry_tokens(sampled.token_ids, drafts.sampled.token_ids, size, entry_rows,
                                        drafts.layout.sample_rows, drafts.num_accepted, num_drafts,
                                        drafts.layout.verified_ids)
        return self.carried

    def next_tokens(self, size: int) -> jax.Array:
        """i32[size]: the step's sampled tokens, zero-padded (the next fused step's previous_tokens): the
        program's own copy unless a fallback (or a separate sampler) produced them."""
        sampled = self.sampler_output()
        if self.fused is not None and sampled.token_ids is self.fused.sample.out.token_ids:
            return self.fused.next_tokens
        return pad_sampled_tokens(sampled.token_ids, size)


@jax.jit
def merge_sampled_tokens(token_ids: jax.Array, sampled: jax.Array, sources: jax.Array) -> jax.Array:
    """i32[T]: token_ids i32[T] with each position t where sources[t] >= 0 replaced by sampled[sources[t]],
    sampled i32[R] being the previous step's sampled tokens (a gather on the device; `dispatch` pads them to
    the largest S bucket, `pad_sampled_tokens`, so one program serves each T)."""
    return jnp.where(sources >= 0, sampled[jnp.maximum(sources, 0)], token_ids)


@functools.partial(jax.jit, static_argnums=(2,))
def carry_tokens(token_ids: jax.Array, draft_token_ids: jax.Array, size: int, entry_rows: jax.Array,
                 sample_rows: jax.Array, num_accepted: jax.Array, num_drafts: jax.Array,
                 draft_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`PendingStep.carry` on the device. token_ids i32[N]: a step's sampled tokens, row r entry r's;
    draft_token_ids i32[N']: the tokens its draft rows sampled (token_ids itself when packed); per slot m of
    M: entry_rows i32[M] (size: a padding slot), sample_rows i32[M, k] (into draft_token_ids), num_accepted
    (i32[>= M]: the fused step counts S slots), num_drafts i32[M] and draft_ids i32[M, k] (the drafts verified).
    Returns (tokens i32[size]: token_ids zero-padded, each slot's entry row replaced by the sample at its first
    rejected draft (the bonus token's row kept when all were accepted); rejected i32[size]: each slot's entry row
    d - a, 0 elsewhere; accepted i32[size, k]: each slot's entry row its a accepted drafts, then -1; -1 elsewhere)."""
    k, num_accepted = sample_rows.shape[1], num_accepted[:sample_rows.shape[0]]  # the fused step's has S >= M
    at = jnp.take_along_axis(sample_rows, jnp.minimum(num_accepted, k - 1)[:, None], axis=1)[:, 0]  # i32[M]
    main = token_ids[jnp.minimum(entry_rows, token_ids.shape[0] - 1)]  # i32[M]
    token = jnp.where(num_accepted < num_drafts, draft_token_ids[at], main)
    n = min(size, token_ids.shape[0])
    tokens = jnp.zeros((size,), jnp.int32).at[:n].set(token_ids[:n]).at[entry_rows].set(token, mode="drop")
    rejected = jnp.zeros((size,), jnp.int32).at[entry_rows].set(num_drafts - num_accepted, mode="drop")
    kept = jnp.where(jnp.arange(k)[None] < num_accepted[:, None], draft_ids, -1)  # i32[M, k]
    accepted = jnp.full((size, k), -1, jnp.int32).at[entry_rows].set(kept, mode="drop")
    return tokens, rejected, accepted


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Redraft:
    """A step's drafts proposed again on the device (`redraft_in_flight`), on X slots (the largest
    `RunnerConfig.draft_seq_buckets` size, whatever the step's M: one shape for every program that takes them)."""

    drafts: jax.Array  # i32[X, k]: slot m's drafts where `changed` (-1: none, never accepted)
    changed: jax.Array  # bool[X]: whether slot m's drafts are new (its guess of the step in flight was wrong)
    first: jax.Array  # i32[X]: the step's token index of slot m's fed token (its drafts follow it)

    @classmethod
    def none(cls, num_slots: int, k: int) -> Redraft:
        return cls(np.full((num_slots, k), -1, np.int32), np.zeros(num_slots, bool), np.zeros(num_slots, np.int32))


@functools.partial(jax.jit, static_argnums=(11, 12))
def redraft_in_flight(draft_ids: jax.Array, history: jax.Array, known: jax.Array, num_previous: jax.Array,
                      rows: jax.Array, guess: jax.Array, tokens: jax.Array, rejected: jax.Array, first: jax.Array,
                      previous: Redraft, previous_slots: jax.Array, num_slots: int,
                      lookup: tuple[int, int]) -> tuple[jax.Array, Redraft]:
    """Drafts proposed on a guess of the step in flight (async scheduling, `NgramProposer.propose_past`), proposed
    again from its real outcome where the guess was wrong: the n-gram lookup on the device (`ngram_drafts`). Per
    slot m of M: draft_ids i32[M, k] (the host's; their count d is kept), history i32[M, H] (the known tokens,
    known i32[M] of them, then the num_previous i32[M] drafts the step in flight verifies, as the host proposed
    them), rows i32[M] (the slot's row in that step, -1: kept as they are), guess i32[M, 2] (its drafts accepted and
    token emitted, guessed; (-1, -1): always proposed again), tokens and rejected i32[R] (`PendingStep.carry`),
    first i32[M] (the slot's fed token's index in the step), previous: the step in flight's own Redraft (its drafts
    where the device proposed them again) and previous_slots i32[M] (the slot's there; out of range: none).
    Returns (draft_ids i32[M, k], the Redraft on num_slots slots)."""
    M, k = draft_ids.shape
    row = jnp.maximum(rows, 0)
    accepted, token = num_previous - rejected[row], tokens[row]  # i32[M] each: the real outcome
    changed = (rows >= 0) & ((accepted != guess[:, 0]) | (token != guess[:, 1]))  # bool[M]
    X, slot = previous.drafts.shape[0], jnp.minimum(previous_slots, previous.drafts.shape[0] - 1)
    fed_again = (previous_slots < X) & previous.changed[slot]  # bool[M]: the drafts in flight are the device's
    j = jnp.arange(previous.drafts.shape[1])  # the drafts in flight: at known + j
    at = jnp.where(fed_again[:, None] & (j[None] < num_previous[:, None]), known[:, None] + j[None], history.shape[1])
    history = history.at[jnp.arange(M)[:, None], at].set(previous.drafts[slot], mode="drop")
    sequence = history.at[jnp.arange(M), known + accepted].set(token)  # i32[M, H]: known + accepted + token
    drafts = ngram_drafts(sequence, known + accepted + 1, k, *lookup)  # i32[M, k]
    drafts = jnp.where(jnp.arange(k)[None] < jnp.sum(draft_ids >= 0, axis=1)[:, None], drafts, -1)
    draft_ids = jnp.where(changed[:, None], drafts, draft_ids)
    redraft = Redraft(jnp.full((num_slots, k), -1, jnp.int32).at[:M].set(draft_ids),
                      jnp.zeros((num_slots,), bool).at[:M].set(changed),
                      jnp.zeros((num_slots,), jnp.int32).at[:M].set(first))
    return draft_ids, redraft


def merge_redrafts(draft_ids: jax.Array, redraft: Redraft) -> jax.Array:
    """draft_ids i32[N, k] (slot m's drafts at row m) with the slots the Redraft changed replaced."""
    n, draft_ids = min(draft_ids.shape[0], redraft.drafts.shape[0]), jnp.asarray(draft_ids)
    return draft_ids.at[:n].set(jnp.where(redraft.changed[:n, None], redraft.drafts[:n], draft_ids[:n]))


def fill_in_flight(step: StepInput, tokens: jax.Array, rejected: jax.Array, sources: jax.Array,
                   shifts: jax.Array, page_size: int, redraft: Redraft | None = None) -> StepInput:
    """The step with what the previous step (still in flight when it was packed) decided, on the device:
    each placeholder token (sources i32[T] >= 0) becomes tokens[sources]; each token of a sequence that follows
    a verification in flight (shifts i32[T] >= 0: that sequence's row there) moves back by rejected[shifts]
    positions (the host packed it as if every draft were accepted): positions, slots (from the page table)
    and the sequence's kv_lens; the drafts proposed again (`redraft`) are fed in place of the host's.
    tokens, rejected: i32[R] (`PendingStep.carry`)."""
    redraft = Redraft.none(1, 1) if redraft is None else redraft
    token_ids, positions, slots, kv_lens = _fill_in_flight(step.token_ids, step.positions, step.slot_mapping,
                                                           step.page_table, step.kv_lens, step.cu_q_lens, tokens,
                                                           rejected, sources, shifts, redraft, page_size)
    return dataclasses.replace(step, token_ids=token_ids, positions=positions, slot_mapping=slots, kv_lens=kv_lens)


def _fill_in_flight(token_ids, positions, slot_mapping, page_table, kv_lens, cu_q_lens, tokens, rejected, sources,
                    shifts, redraft: Redraft, page_size: int):
    """`fill_in_flight` on the StepInput fields it changes (T tokens, S sequences, P pages a sequence)."""
    token_ids = jnp.where(sources >= 0, tokens[jnp.maximum(sources, 0)], token_ids)  # i32[T]
    at = redraft.first[:, None] + 1 + jnp.arange(redraft.drafts.shape[1])[None]  # i32[X, k]: slot m's draft j
    write = redraft.changed[:, None] & (redraft.drafts >= 0)
    token_ids = token_ids.at[jnp.where(write, at, token_ids.shape[0])].set(redraft.drafts, mode="drop")
    shift = jnp.where(shifts >= 0, rejected[jnp.maximum(shifts, 0)], 0)  # i32[T]
    positions = positions - shift
    T, S = token_ids.shape[0], kv_lens.shape[0]
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, jnp.arange(T), side="right") - 1, 0, S - 1)  # i32[T]
    pages = page_table[seq, jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)]  # i32[T]
    slots = jnp.where(shifts >= 0, pages * page_size + positions % page_size, slot_mapping)
    first, fed = cu_q_lens[:-1], cu_q_lens[1:] > cu_q_lens[:-1]  # i32[S], bool[S]
    kv_lens = kv_lens - jnp.where(fed, shift[jnp.clip(first, 0, T - 1)], 0)
    return token_ids, positions, slots, kv_lens


fill_in_flight_jit = jax.jit(_fill_in_flight, static_argnums=(11,))  # the unfused runner's (the fused step inlines it)


def steps_moved_back(steps, token_index, shifts, rejected):
    """u32[N]: the key steps `steps` u32[N] of the sampler rows at fed tokens token_index i32[N], each moved back
    by the drafts that the verification in flight when the step was packed rejected from its sequence (shifts
    i32[T]: `_shift_rows`; rejected i32[R]: `PendingStep.carry`). The host counted those drafts as outputs, in
    a row's key (`sampling_row`: step num_output_tokens + j) as in its positions (`fill_in_flight`). jax arrays
    in the fused step, numpy on the host; a padding row never moves below step 0."""
    xp = np if isinstance(steps, np.ndarray) else jnp
    row = shifts[token_index]  # i32[N]: the row of rejected each sampler row moves back by, else -1
    back = xp.where(row >= 0, rejected[xp.maximum(row, 0)], 0).astype(xp.uint32)
    return steps - xp.minimum(back, steps)


def outputs_in_flight(token_ids: jax.Array, token_index: jax.Array, count_from: jax.Array, shifts: jax.Array,
                      accepted: jax.Array) -> jax.Array:
    """i32[N, 2k + 1]: the output tokens that the host's penalty counts of each sampler row lack, -1 past them
    (`sampler.sample_in_step` counts them; in the fused step, dispatched before the step in flight is handled):
    the tokens its request fed this step from count_from i32[N] (`_count_from`: a placeholder's index; T: none)
    through the row's own token token_index i32[N] (token_ids i32[T], as fed: the placeholder, the token in
    flight, and the drafts before the row, as the device proposed them), and the drafts the verification in
    flight accepted for it (accepted i32[R, k], `PendingStep.carry`; its row there: shifts i32[T] at the row's
    token, -1: none)."""
    k, T = accepted.shape[1], token_ids.shape[0]
    at = token_index[:, None] - jnp.arange(k + 1)[None]  # i32[N, k + 1]: the row's fed token and the k before it
    fed = jnp.where(at >= count_from[:, None], token_ids[jnp.clip(at, 0, T - 1)], -1)
    row = jnp.where(count_from <= token_index, shifts[token_index], -1)  # i32[N]; padding rows count nothing
    before = jnp.where(row[:, None] >= 0, accepted[jnp.maximum(row, 0)], -1)  # i32[N, k]
    return jnp.concatenate([fed, before], axis=1)


def _count_from(step: StepInput, sources: np.ndarray, num_rows: int) -> np.ndarray:
    """i32[L]: for the first num_rows logits rows of `step` (the entries', then packed draft rows), the first fed token
    that `outputs_in_flight` counts as an output of the row's request: its sequence's first token where that is a
    placeholder (sources i32[T] >= 0: `_placeholder_sources`; the host's lists lack it and all fed after it: the
    fused step is dispatched before the step in flight is handled); T (none) elsewhere, and on padding rows."""
    T = len(step.token_ids)
    token_index = step.logits_indices[:num_rows]
    first = step.cu_q_lens[np.searchsorted(step.cu_q_lens, token_index, side="right") - 1]  # i32[num_rows]
    count_from = np.full(len(step.logits_indices), T, np.int32)
    count_from[:num_rows] = np.where(sources[first] >= 0, first, T)
    return count_from


def _shift_rows(entries: Sequence[ScheduledRequest], step: StepInput,
                previous: PendingStep | None) -> np.ndarray | None:
    """i32[T]: for every token of an entry whose request verified drafts in `previous` (so its positions assume
    them all accepted), that request's sampler row in `previous`; -1 elsewhere. None when there are none."""
    if previous is None or previous.layout is None:
        return None
    verified = set(previous.layout.request_ids)
    shifts = np.full(len(step.token_ids), -1, np.int32)
    for i, entry in enumerate(entries):
        if entry.request_id in verified and entry.placeholder:
            shifts[step.cu_q_lens[i]:step.cu_q_lens[i + 1]] = previous.rows[entry.request_id]
    return shifts if (shifts >= 0).any() else None


def _placeholder_sources(entries: Sequence[ScheduledRequest], step: StepInput,
                         previous: PendingStep | None) -> np.ndarray:
    """i32[T]: the previous step's sampler row of each placeholder token, else -1."""
    if previous is None:
        raise RuntimeError("placeholder tokens need the previous step, dispatched with its sampler")
    sources = np.full(len(step.token_ids), -1, np.int32)
    fed = [i for i, entry in enumerate(entries) if entry.placeholder]  # a placeholder is its entry's one token
    rows = [previous.rows.get(entries[i].request_id) for i in fed]
    if None in rows:
        raise RuntimeError(f"request {entries[fed[rows.index(None)]].request_id!r} feeds a placeholder but sampled "
                           "nothing in the previous step")
    sources[step.cu_q_lens[fed]] = rows
    if not np.array_equal(sources >= 0, step.token_ids == PLACEHOLDER_TOKEN_ID):
        raise RuntimeError("placeholder tokens outside the placeholder entries' single token")
    return sources


def _prompt_targets(spans: dict, num_tokens: int) -> np.ndarray:
    """i32[T]: the prompt token each fed position of the spans predicts (0 elsewhere)."""
    targets = np.zeros(num_tokens, np.int32)
    for offset, first, count, entry in spans.values():
        targets[offset:offset + count] = entry.prompt_token_ids[first:first + count]
    return targets


FaultInjector = Callable[[Sequence[ScheduledRequest], jax.Array], jax.Array]
GrammarBitmask = np.ndarray | Callable[[], np.ndarray | None]  # see ModelRunner.execute_model


def sampling_row(entry: ScheduledRequest, position: int | None = None, before: Sequence[int] = (),
                 drafts: Sequence[int] | None = None) -> RowInfo:
    """The sampler's row for one scheduled request (a grammar mask or other per-row input joins here).

    With drafts (speculative decoding) each fed position j in 0..d samples the output token that would
    follow the first j drafts: keyed as that output (step num_output_tokens + j), its penalties counting
    the drafts before it. position None: the entry's last fed token (j = d). Async scheduling (`_in_flight_history`):
    before, the outputs of the step in flight that the entry's lists lack; drafts, the drafts fed as the device
    fed them (-1: none; default the entry's), () where the device counts them (`outputs_in_flight`)."""
    j = len(entry.spec_token_ids) if position is None else position
    drafts = entry.spec_token_ids if drafts is None else drafts
    history = entry.output_token_ids  # the request's own list, by reference, unless more is counted
    if entry.sampling_params.uses_penalties and (before or drafts[:j]):
        history = list(history) + list(before) + [t for t in drafts[:j] if t >= 0]
    return RowInfo(params=entry.sampling_params, seed=entry.seed, step=entry.num_output_tokens + j,
                   prompt_token_ids=entry.prompt_token_ids, output_token_ids=history,
                   banned_token_ids=banned_at(entry, j))


def banned_at(entry: ScheduledRequest, j: int) -> tuple[int, ...]:
    """The banned ids of the entry's row at fed position j in 0..d (`sampling_row`): its own, or those of the output
    after its first j drafts."""
    return entry.banned_token_ids if j == 0 else entry.spec_banned_token_ids[j - 1]


_PADDING_ROW = RowInfo(params=SamplingParams(temperature=0.0), seed=0)  # a draft slot nobody fed: never accepted


def _draft_rows(entries: Sequence[ScheduledRequest], packed: bool, M: int, k: int,
                history: dict[str, tuple] | None = None) -> tuple[RowInfo, ...]:
    """The draft rows of `DraftRows` for its slots' entries: each one's d rows in turn, packed, or slot m's at rows
    m * k + j of M * k (padding: `_PADDING_ROW`). history: {request id: (before, drafts)} of `sampling_row` for
    the requests whose penalty counts are not their entry's outputs and drafts (`_in_flight_history`)."""
    rows, history = [], history or {}
    for m, e in enumerate(entries):
        if not packed:
            rows += [_PADDING_ROW] * (m * k - len(rows))
        rows += [sampling_row(e, j, *history.get(e.request_id, ())) for j in range(len(e.spec_token_ids))]
    return tuple(rows) if packed else tuple(rows + [_PADDING_ROW] * (M * k - len(rows)))


def _in_flight_history(entries: Sequence[ScheduledRequest], layout: DraftRows | None,
                       outcome: Callable[[], dict[str, tuple[int, ...]]] | None) -> dict[str, tuple]:
    """Async scheduling: `sampling_row`'s (before, drafts) for the rows of each request with penalties fed a
    placeholder and drafts, whose penalty counts are not its entry's outputs and drafts. outcome: None when the
    fused step counts on the device what its lists lack (`outputs_in_flight`): (before, drafts) = ((), ()); else
    a callable giving {request id: the outputs of the step in flight its lists lack} (empty once that step is
    handled), its drafts those fed, as the device proposed them (a host copy: may wait for `redraft_in_flight`)."""
    penalised = [e for e in entries if e.placeholder and e.spec_token_ids and e.sampling_params.uses_penalties]
    if not penalised:
        return {}
    if outcome is None:
        return {e.request_id: ((), ()) for e in penalised}
    before, fed = outcome(), dict(zip(layout.request_ids, np.asarray(layout.verified_ids)))
    return {e.request_id: (before.get(e.request_id, ()), tuple(int(t) for t in fed[e.request_id])) for e in penalised}


def _with_history(entries: Sequence[ScheduledRequest], layout: DraftRows | None, history: dict) -> DraftRows | None:
    """The layout with the draft rows of the requests in `history` (`_in_flight_history`) made again."""
    if layout is None or not history:
        return layout
    by_id = {e.request_id: e for e in entries}
    rows = _draft_rows([by_id[rid] for rid in layout.request_ids], layout.packed, len(layout.draft_ids),
                       layout.draft_ids.shape[1], history)
    return dataclasses.replace(layout, rows=rows)


def _outcome_in_flight(previous: PendingStep, carried: tuple, entries: Sequence[ScheduledRequest]
                       ) -> dict[str, tuple[int, ...]]:
    """{request id: its accepted drafts and token} of the step in flight (`previous`, carried: its `carry`) for the
    entries fed a placeholder (waits for that step's sampler)."""
    tokens, _, accepted = jax.device_get(carried)
    outcome = {}
    for e in entries:
        if e.placeholder:
            row = previous.rows[e.request_id]
            drafts = () if accepted is None else tuple(int(t) for t in accepted[row] if t >= 0)
            outcome[e.request_id] = drafts + (int(tokens[row]),)
    return outcome


@functools.partial(jax.jit, static_argnums=(0,))
def draft_logits(config: LlamaConfig, params: Params, hidden: jax.Array, rows: jax.Array) -> jax.Array:
    """hidden [T, E] (paged_forward's), rows i32[X] -> logits f32[X, V] at those fed tokens."""
    return lm_logits(config, params, hidden[rows])


@jax.jit
def accept_drafts(sampled: jax.Array, sample_rows: jax.Array, draft_ids: jax.Array) -> jax.Array:
    """sampled i32[N] (a sampler call's tokens), sample_rows i32[M, k] (the row of each draft position),
    draft_ids i32[M, k] (-1: no draft) -> i32[M], the accepted drafts of each slot: the leading positions
    whose sample is the draft. Rejection sampling of a point-mass draft (see jaxpaged/spec_decode/ngram.py)."""
    match = (sampled[sample_rows] == draft_ids).astype(jnp.int32)  # i32[M, k]
    return jnp.sum(jnp.cumprod(match, axis=1), axis=1)


def verify_packed(layout: DraftRows, sampled: SamplerOutput, fused: FusedStep | None = None) -> VerifiedDrafts:
    """The drafts verified on the final samples of their rows (`sampled` holds them at layout.sample_rows): a
    fused step's own count, unless a sampler fallback changed a token, else `accept_drafts` on the device."""
    if fused is not None and sampled.token_ids is fused.sample.out.token_ids:
        return VerifiedDrafts(layout, sampled, fused.num_accepted)
    return VerifiedDrafts(layout, sampled, accept_drafts(sampled.token_ids, layout.sample_rows, layout.verified_ids))


def _pad_bitmask(bitmask: np.ndarray | None, S: int, num_rows: int) -> np.ndarray | None:
    """The first num_rows rows of a grammar bitmask as the sampler's i32[S, W] (padding rows allow all)."""
    if bitmask is None:
        return None
    padded = np.full((S, bitmask.shape[1]), -1, np.int32)
    padded[:num_rows] = bitmask[:num_rows]
    return padded


def _check_bitmask(bitmask: np.ndarray | None, entries: Sequence[ScheduledRequest]) -> np.ndarray | None:
    """The engine's grammar bitmask, checked: i32[len(entries) + D, W], D the step's drafts (execute_model)."""
    rows = len(entries) + sum(len(e.spec_token_ids) for e in entries)
    if bitmask is not None and (bitmask.ndim != 2 or bitmask.shape[0] != rows):
        raise ValueError(f"grammar_bitmask has shape {bitmask.shape}; expected ({rows}, W): a row per entry, "
                         "then one per draft")
    return bitmask


def _draft_bitmask(layout: DraftRows, bitmask: np.ndarray | None) -> np.ndarray | None:
    """i32[M * k, W]: the grammar bitmask of unpacked draft rows (the engine's last D rows hold the drafts'
    masks, in step order), padding rows allowing all; None without a bitmask."""
    if bitmask is None:
        return None
    rows = np.concatenate([layout.sample_rows[m, :d] for m, d in enumerate(layout.num_drafts)])
    out = np.full((len(layout.rows), bitmask.shape[1]), -1, np.int32)
    out[rows] = bitmask[len(bitmask) - len(rows):]
    return out


def _geometric_buckets(lo: int, hi: int, ratio: int) -> tuple[int, ...]:
    """lo, lo*ratio, ... below hi, then hi itself."""
    buckets, b = [], lo
    while b < hi:
        buckets.append(b)
        b *= ratio
    return tuple(buckets) + (hi,)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static kernel settings of the jitted step: attention's (see ragged_paged_attention), and whether its
    weight dots take the native CPU matmul (pallas_kernels/cpu_matmul.py) and, in the fused step, the
    sampler's candidates the native top-k (pallas_kernels/cpu_sampler.py; the same result as XLA's)."""
    backend: str
    max_num_partial_prefills: int | None = None  # most sequences fed > 1 token in a step (RunnerConfig's)
    native_matmul: bool = False


def resolve_attention_backend(attention_backend: str) -> str:
    """The attention backend an "auto" choice runs on JAX's default backend: the Pallas kernel on GPU, the
    native CPU kernel where it builds, else the XLA path."""
    if attention_backend != "auto":
        return attention_backend
    if jax.default_backend() == "gpu":
        return "pallas"
    return "cpu" if load_cpu_attention() else "xla"


def build_native_kernels(attention_backend: str) -> threading.Thread | None:
    """On a CPU backend, start building the native kernels a runner with `attention_backend` may call, in the
    background and in the order a start first asks for them (cpu_build.build_in_background): the step's matmul,
    attention and RoPE tables (unless the backend is another one), then the sampler's. A cold start's C++
    compiles (~3-4 s each on 2 cores) then overlap the model's loading instead of queueing on the main thread.
    Returns the build thread (None elsewhere)."""
    if jax.default_backend() != "cpu":
        return None
    step = (cpu_matmul, cpu_attention, cpu_rope) if attention_backend in ("auto", "cpu") else ()
    return cpu_build.build_in_background([module.SOURCE for module in (*step, cpu_sampler)])


def uses_native_matmul(backend: str) -> bool:
    """Whether a step with attention `backend` takes the native CPU matmul for its weight dots: it goes with
    the native attention (both are the CPU's C++ build)."""
    return backend == "cpu" and jax.default_backend() == "cpu" and cpu_matmul.load_cpu_matmul()


# Quantisation of the weight dots (vLLM's `quantization` argument), both with the weights as int8 and a float32 scale
# per output column and run of 32 rows (pallas_kernels/cpu_matmul.py: quantize_int8), on the native CPU matmul:
# "int8": weight-only, every product float32 (matmul_cpu); "w8a8": each dot's x quantised too, per row and run of 32
# values, integer dots times both scales (matmul_w8a8; llama.cpp's Q8_0 dots): ~1.7-2.1x int8's speed from 8 rows
# where AVX-512 VNNI runs them; elsewhere the same results ~10-20% slower than int8; at some quality
# (docs/benchmarks.md, "W8A8")
QUANTIZATIONS = ("int8", "w8a8")
INT8_DOTS = {"int8": cpu_matmul.matmul_cpu, "w8a8": cpu_matmul.matmul_w8a8}  # each's product over the int8 blocks


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: choose one of {QUANTIZATIONS} or None (the checkpoint's "
                         "weights as loaded)")


def packs_weights(attention_backend: str, dtype, sharded: bool = False) -> bool:
    """Whether a runner holds the weight dots' weights packed as the native CPU matmul's blocks (float32
    weights on one device; `ModelRunner`, `_pack_for_cpu_matmul`). The weight layout follows it: a layer scan
    reads packed weights in place (`resolve_weight_layout`)."""
    return not sharded and np.dtype(dtype) == np.float32 and \
        uses_native_matmul(resolve_attention_backend(attention_backend))


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """The runner's limits and the bucket rules of its step shapes (T tokens, S sequence slots, P pages).

    Buckets, each list ending at its limit:
      token_buckets  T: min_token_bucket, x2, ... up to max_num_batched_tokens (matmul work grows with T),
                        and from mid_token_buckets_from on also each bucket x1.5 (less padding, more programs)
      seq_buckets    S: min_seq_bucket, x4, ... up to max_num_seqs (the CPU attention path's work: S * P)
      page_buckets   P: one width, max_pages_per_seq (Pallas and blocked XLA loop over live pages only);
                        the reference backend gathers whole rows: min_page_bucket, x2, ... up to that width
      decode_seq_buckets: S buckets that are no T bucket also serve as T (T = S: a decode-only call)
    An S bucket of 1 (min_seq_bucket=1, CPU: one request's LM head on one row) serves only T = 1, one
    decode; one sequence fed more tokens takes the next S bucket, so S = 1 adds no shape ((1, 1) replaces (1, 4)).
    `buckets` lists every (T, S, P) shape compiled at warm-up; `bucket_for(tokens, seqs, pages)` picks
    the smallest that fits (always one of `buckets`). A step's logits rows L are its S slots, or its T
    tokens for a speculative verification in a `verify_buckets` shape (compiled too when the runner packs
    drafts that way: `ModelRunner.packs_drafts_in_tokens`).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    num_pages: int
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # see resolve_kv_cache_dtype
    min_token_bucket: int = 16
    min_seq_bucket: int = 4
    min_page_bucket: int = 8
    # T buckets halfway between doublings (48, 96, 192, ...) from this T on; None: doublings only. On CPU a padded
    # token cost about what a real one did (SmolLM2, 32-256 rows: ~0.8 ms each), and a serving mix of decodes
    # and short prefills filled its 64- and 128-token steps only 63-76% (docs/benchmarks.md, "Session 15").
    # Since session 29 the packed weights' dots skip padding rows (`with_live_rows`); the rest still pays.
    mid_token_buckets_from: int | None = None
    # Most requests fed more than one token in a step; None: no cap. The scheduler enforces it (the engine
    # builds its SchedulerConfig from this config); attention sizes its prefill tiles for it and trusts it.
    max_num_partial_prefills: int | None = None
    # Speculative decoding: drafts verified per request and step (SpeculativeConfig's k); 0: off
    num_speculative_tokens: int = 0
    # ... and (prompt_lookup_min, prompt_lookup_max) of its n-gram lookup, for drafts proposed on a guess of the step
    # in flight (async scheduling) to be proposed again on the device where it proves wrong (`redraft_in_flight`);
    # None: they are verified as they are
    prompt_lookup: tuple[int, int] | None = None
    # The step's weight layout (jaxpaged/worker/weight_layout.py): "auto" (per-layer arrays on GPU, and on CPU where
    # the weights are not packed; the stacked scan compiles faster), "stacked" or "per_layer"; fuse_projections:
    # q/k/v and gate/up as one gemm each.
    weight_layout: str = "auto"
    fuse_projections: bool = True
    # XLA:GPU command buffers over the step: "auto" or a GPU_COMMAND_BUFFERS key (ignored off GPU)
    command_buffers: str = "auto"
    # The sampler inside the step's jitted program (`fused_step`): "auto" (on with a GPU backend; off on CPU,
    # where it measured slower: docs/benchmarks.md, "The fused sampler"), "on" or "off". One device only.
    fuse_sampler: str = "auto"
    # Quantisation of the weight dots (QUANTIZATIONS: int8 weight-only, w8a8 with x too) or None. It needs the native
    # CPU matmul's packed weights (`packs_weights`: float32 on one device), which the ModelRunner checks.
    quantization: str | None = None

    def __post_init__(self):
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: choose one of {ATTENTION_BACKENDS}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.page_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"page_size (block_size)={self.page_size}: choose 8, 16, 32, 64 or 128")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.mid_token_buckets_from is not None and self.mid_token_buckets_from < 2:
            raise ValueError(f"mid_token_buckets_from={self.mid_token_buckets_from} must be >= 2 or None")
        if self.max_num_partial_prefills is not None and self.max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills={self.max_num_partial_prefills} must be >= 1 or None")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r} must be an integer >= 0")
        if self.prompt_lookup is not None and not (
                isinstance(self.prompt_lookup, tuple) and len(self.prompt_lookup) == 2 and
                all(isinstance(n, int) and not isinstance(n, bool) for n in self.prompt_lookup) and
                1 <= self.prompt_lookup[0] <= self.prompt_lookup[1]):
            raise ValueError(f"prompt_lookup={self.prompt_lookup!r}: must be None or (min, max) with 1 <= min <= max")
        check_weight_layout(self.weight_layout)
        if self.command_buffers not in ("auto", *GPU_COMMAND_BUFFERS):
            raise ValueError(f"command_buffers={self.command_buffers!r}: choose one of "
                             f"{('auto', *GPU_COMMAND_BUFFERS)}")
        check_fuse_sampler(self.fuse_sampler)
        check_quantization(self.quantization)

    def sampler_fused(self, platform: str | None = None) -> bool:
        """Whether the step program samples too (fuse_sampler; "auto": on a GPU backend only)."""
        if self.fuse_sampler != "auto":
            return self.fuse_sampler == "on"
        return (platform or jax.default_backend()) == "gpu"

    @property
    def backend(self) -> str:
        return resolve_attention_backend(self.attention_backend)

    def kv_dtype(self, model_dtype) -> np.dtype:
        """The pool's dtype for a model of `model_dtype` on the default backend."""
        return resolve_kv_cache_dtype(self.kv_cache_dtype, model_dtype, jax.default_backend())

    def layout(self, platform: str | None = None, packed: bool = False) -> WeightLayout:
        """The step's weight layout on `platform` (default: JAX's default backend) when the runner packs its
        weights (`packs_weights`) or not."""
        return resolve_weight_layout(self.weight_layout, self.fuse_projections, platform or jax.default_backend(),
                                     packed=packed)

    def compiler_options(self, platform: str | None = None, num_tokens: int | None = None) -> dict[str, str]:
        """XLA options of a step of num_tokens (T bucket; None: any): XLA:CPU's dot settings for that size
        on CPU (see cpu_compiler_options), command buffers on GPU."""
        return {**cpu_compiler_options(platform, num_tokens), **gpu_compiler_options(self.command_buffers, platform)}

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.backend, self.max_num_partial_prefills, uses_native_matmul(self.backend))

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        doublings = _geometric_buckets(min(self.min_token_bucket, self.max_num_batched_tokens),
                                       self.max_num_batched_tokens, 2)
        if self.mid_token_buckets_from is None:
            return doublings
        mids = (b * 3 // 2 for b in doublings if b >= self.mid_token_buckets_from)
        return tuple(sorted(set(doublings) | {m for m in mids if m < self.max_num_batched_tokens}))

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        return _geometric_buckets(min(self.min_seq_bucket, self.max_num_seqs), self.max_num_seqs, 4)

    @property
    def page_buckets(self) -> tuple[int, ...]:
        # The Pallas kernel and the blocked XLA path loop only over live pages, so
        # one width suffices; the reference gathers whole rows, so it gets narrow
        # tables for short contexts.
        if self.backend != "reference":
            return (self.max_pages_per_seq,)
        return _geometric_buckets(min(self.min_page_bucket, self.max_pages_per_seq), self.max_pages_per_seq, 2)

    @property
    def decode_seq_buckets(self) -> tuple[int, ...]:
        """S buckets that are no T bucket (on GPU: 4, below the smallest T bucket 16).

        A step of at most s tokens over s slots runs at T = s: attention then tiles it as
        one decode-like call (T <= S), where T = 16 > S = 4 would add a prefill call.
        """
        return tuple(s for s in self.seq_buckets
                     if s not in self.token_buckets and s <= self.max_num_batched_tokens)

    @property
    def buckets(self) -> tuple[tuple[int, int, int], ...]:
        """Every (T, S, P) step shape `bucket_for` can return.

        S bucket s serves num_seqs in (previous S bucket, s]; as num_seqs <= num_tokens,
        it pairs with a T bucket t only if that range starts below t. Decode S buckets
        also pair with T = s.
        """
        lower = dict(zip(self.seq_buckets, (0,) + self.seq_buckets[:-1]))
        shapes = [(t, s) for t in self.token_buckets for s in self.seq_buckets
                  if lower[s] < t and (s > 1 or t == 1 or len(self.seq_buckets) == 1)]
        shapes += [(s, s) for s in self.decode_seq_buckets]
        return tuple((t, s, p) for t, s in sorted(shapes) for p in self.page_buckets)

    @property
    def verify_buckets(self) -> tuple[tuple[int, int, int], ...]:
        """Speculative decoding: the (T, S, P) buckets with S < T <= VERIFY_LOGITS_MAX_TOKENS, whose
        verification steps may take T logits rows (L = T, a row for every fed token: room for each entry's row
        and all its drafts') when the drafts do not fit in S; () when speculation is off."""
        if not self.num_speculative_tokens:
            return ()
        return tuple((t, s, p) for t, s, p in self.buckets if s < t <= VERIFY_LOGITS_MAX_TOKENS)

    @property
    def draft_seq_buckets(self) -> tuple[int, ...]:
        """Speculative decoding: slot counts M of a step's draft verification (M x num_speculative_tokens
        rows): 1, x4, ... up to the most requests fed several tokens a step (each feeds >= 2); () when off."""
        if not self.num_speculative_tokens:
            return ()
        return _geometric_buckets(1, max(1, min(self.max_num_partial_prefills or self.max_num_seqs,
                                                self.max_num_seqs, self.max_num_batched_tokens // 2)), 4)

    @property
    def history_buckets(self) -> tuple[int, ...]:
        """Speculative decoding with `prompt_lookup`: the widths H of the token histories `redraft_in_flight` takes
        (a sequence and the drafts in flight, and the token after them): 256, x4, ... up to max_model_len + 1."""
        if not self.num_speculative_tokens or self.prompt_lookup is None:
            return ()
        return _geometric_buckets(min(256, self.max_model_len + 1), self.max_model_len + 1, 4)

    @property
    def draft_shapes(self) -> tuple[tuple[int, int], ...]:
        """Every (T, M) a draft verification runs at: M slots need a T bucket of >= 2 tokens a slot."""
        lower = dict(zip(self.draft_seq_buckets, (0,) + self.draft_seq_buckets[:-1]))
        return tuple((t, m) for t in self.token_buckets for m in self.draft_seq_buckets if 2 * (lower[m] + 1) <= t)

    def bucket_for(self, num_tokens: int, num_seqs: int, num_pages: int) -> tuple[int, int, int]:
        t = next(b for b in self.token_buckets if b >= num_tokens)
        s = next(b for b in self.seq_buckets if b >= num_seqs)
        if s == 1 and t > 1 and len(self.seq_buckets) > 1:  # S = 1 serves one decode only (see buckets)
            s = self.seq_buckets[1]
        p = next(b for b in self.page_buckets if b >= num_pages)
        if num_tokens <= s < t:  # s is then a decode S bucket
            t = s
        return t, s, p


def _attend_paged(q, k, v, k_pool, v_pool, step: StepInput, layer, window, *, sm_scale: float,
                  attention: AttentionConfig):
    """Write this step's k/v [T, K, D] into the pool, then attend q [T, H, D] -> (o, k_pool, v_pool).

    The pool may hold another dtype than the model's (kv_cache_dtype): k/v and q
    are cast to it, the output back to q's dtype. window: this layer's sliding window (int32 scalar,
    0 = none), or None when no layer of the model has one."""
    kp, vp = write_kv_inner(k_pool, v_pool, k, v, step.slot_mapping, layer=layer)
    o = ragged_paged_attention(q.astype(kp.dtype), kp, vp, step.kv_lens, step.page_table, step.cu_q_lens,
                               step.num_seqs, sm_scale=sm_scale, layer=layer, backend=attention.backend,
                               max_num_partial_prefills=attention.max_num_partial_prefills, sliding_window=window)
    return o.astype(q.dtype), kp, vp


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
    consts = layer_constants(config)  # per layer: window [L], row of the RoPE tables [L]
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
            o, kp, vp = attend_paged(q, k, v, k_pool, v_pool, step, layer, window)
            return o, (kp, vp)

        h, (k_pool, v_pool) = decoder_layer(config, layer_params, h, cos, sin, attend, matmul)
        return h, k_pool, v_pool

    carry = (embed_tokens(params, step.token_ids, config), kv.k, kv.v)  # h [T, E], the pool
    # packed layer weights compute the step's real tokens only (padding comes last: cu_q_lens[-1] of T)
    params = dict(params, layers=with_live_rows(params["layers"], step.cu_q_lens[-1]))
    if isinstance(params["layers"], Sequence):
        # One traced layer called L times: XLA inlines the calls (the program is the unrolled one), but
        # Python traces and lowers one layer, not L, per step shape (docs/benchmarks.md, "Start-up")
        traced_layer = jax.jit(layer_fn)
        for layer, layer_params in enumerate(params["layers"]):
            c = jax.tree.map(lambda x, i=layer: x[i], consts)
            carry = traced_layer(carry, (layer_params, jnp.int32(layer), c), step, cos_table, sin_table)
    else:
        # Packed weights (the native CPU matmul's blocks, stacked) stay out of the scanned xs: each layer's
        # product reads its layer of the whole stack in place, where a scanned slice would be copied out
        packed = {n: w for n, w in params["layers"].items() if isinstance(w, PackedWeight)}
        sliced = {n: w for n, w in params["layers"].items() if n not in packed}

        def body(carry, xs):
            layer_params, layer, c = xs
            layer_params = {**layer_params, **{n: w.at_layer(layer) for n, w in packed.items()}}
            return layer_fn(carry, (layer_params, layer, c), step, cos_table, sin_table), None

        layers = jnp.arange(config.num_hidden_layers, dtype=jnp.int32)
        carry, _ = jax.lax.scan(body, carry, (sliced, layers, consts))
    h, k, v = carry
    logits = lm_logits(config, params, h[step.logits_indices], matmul)  # [S, V]
    return logits, h, KVPool(k, v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepSampling:
    """The sampler's inputs of a fused step (`fused_step`): S rows, T tokens, R = max_num_seqs, k drafts a row.

    Every field is present in every step (absent optional sampler arrays are `sampler.neutral_arrays`), so
    two programs per (T, S, P) bucket serve every batch: greedy-only, and with random rows."""

    batch: SamplingBatch  # S rows, every optional array present (sampler.with_neutral_arrays)
    previous_tokens: jax.Array  # i32[R]: the previous step's sampled tokens (async scheduling), zero-padded
    sources: np.ndarray  # i32[T]: the row of previous_tokens each placeholder position takes, else -1
    previous_rejected: jax.Array  # i32[R]: the previous step's rejected drafts per row (`PendingStep.carry`)
    shifts: np.ndarray  # i32[T]: the row of previous_rejected each position moves back by, else -1 (fill_in_flight)
    previous_accepted: jax.Array  # i32[R, k]: the previous step's accepted drafts per row, -1 past them (its carry)
    count_from: np.ndarray  # i32[S]: each row's first fed token its penalty counts lack (`_count_from`; T: none)
    draft_rows: np.ndarray  # i32[S, k]: speculative decoding (packed drafts): slot m's draft rows (else 0)
    draft_ids: np.ndarray  # i32[S, k]: slot m's drafts, -1 for none (never accepted)
    redraft: Redraft  # the drafts the device proposes again (async scheduling; `Redraft.none` otherwise)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedStep:
    """A fused step's sampling results, on device."""

    sample: sampler.StepSample  # the sampler's output before its rare fallbacks (`sampler.finish_in_step`)
    num_accepted: jax.Array  # i32[S]: slot m's accepted drafts, valid when no fallback changed a token
    next_tokens: jax.Array  # i32[R]: sample.out.token_ids zero-padded, the next step's previous_tokens


def fused_step(config: LlamaConfig, attention: AttentionConfig, random: bool, params: Params, kv: KVPool,
               step: StepInput, sampling: StepSampling) -> tuple[FusedStep, jax.Array, KVPool]:
    """One step in one program: placeholder tokens gathered from the previous step's (async scheduling; positions
    moved back by its rejected drafts, drafts proposed again fed: `fill_in_flight`; key steps too:
    `steps_moved_back`; penalty counts given the tokens in flight: `outputs_in_flight`),
    `paged_forward`, the sampler's common part (`sampler.sample_in_step`: bitmask, bias, penalties, argmax,
    or the candidate pass when `random` (static: some row samples at random), the sampled ids' raw
    log-probs) and the acceptance of packed drafts. Returns the FusedStep, the hidden states [T, E] and
    the updated pool (donated)."""
    step = fill_in_flight(step, sampling.previous_tokens, sampling.previous_rejected, sampling.sources,
                          sampling.shifts, kv.k.shape[3], sampling.redraft)
    token_ids = step.token_ids  # i32[T]
    logits, hidden, kv = paged_forward(config, attention, params, kv, step)  # f32[S, V], [T, E]
    last = step.logits_indices  # i32[S]
    # rows of a request fed the previous step's token as a placeholder: the host's penalty counts lack it, the drafts
    # it accepted and the drafts fed before the row
    fed = outputs_in_flight(token_ids, last, sampling.count_from, sampling.shifts, sampling.previous_accepted)
    batch = dataclasses.replace(sampling.batch, steps=steps_moved_back(sampling.batch.steps, last, sampling.shifts,
                                                                       sampling.previous_rejected))
    sample = sampler.sample_in_step(logits, batch, fed, random=random, native=attention.native_matmul)
    draft_ids = merge_redrafts(sampling.draft_ids, sampling.redraft)  # i32[S, k]
    num_accepted = accept_drafts(sample.out.token_ids, sampling.draft_rows, draft_ids)  # i32[S]
    next_tokens = pad_sampled_tokens(sample.out.token_ids, sampling.previous_tokens.shape[0])
    return FusedStep(sample, num_accepted, next_tokens), hidden, kv


def has_random_rows(batch: SamplingBatch) -> bool:
    """Whether some row of a host batch samples at random (the fused step's static choice of program)."""
    return bool(np.any(np.asarray(batch.temperature) >= sampler.GREEDY_TEMPERATURE_EPS))


@functools.partial(jax.jit, static_argnums=(1,))
def pad_sampled_tokens(token_ids: jax.Array, size: int) -> jax.Array:
    """i32[size]: token_ids i32[S] (S <= size) followed by zeros (a fused step's previous_tokens)."""
    return jnp.zeros((size,), jnp.int32).at[:token_ids.shape[0]].set(token_ids)


def allocate_kv_pool(config: LlamaConfig, num_pages: int, page_size: int, dtype,
                     mesh: Mesh | None = None) -> KVPool:
    """Zeroed pool; with a mesh, sharded on K (each device allocates only its heads)."""
    shape = (config.num_hidden_layers, config.num_key_value_heads, num_pages, page_size, config.head_dim)
    if mesh is None:
        return KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    sharding = parallel.kv_pool_sharding(mesh)
    return KVPool(parallel.zeros_sharded(shape, dtype, sharding), parallel.zeros_sharded(shape, dtype, sharding))


def kv_bytes_per_page(config: LlamaConfig, page_size: int, dtype) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * page_size * config.head_dim * \
        np.dtype(dtype).itemsize


def empty_step(t: int, s: int, p: int, num_logits: int | None = None) -> StepInput:
    """An all-padding step of shape (T, S, P) with L = num_logits logits rows (default S): warm-up, and the
    receive buffer of followers."""
    return StepInput(np.zeros(t, np.int32), np.zeros(t, np.int32), np.zeros(t, np.int32),
                     np.zeros((s, p), np.int32), np.zeros(s, np.int32), np.zeros(s + 1, np.int32),
                     np.int32(0), np.zeros(s if num_logits is None else num_logits, np.int32))


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


class ModelRunner:
    """Owns the params and the KV pool; turns scheduler outputs into logits.

    With a mesh the params are placed onto `param_shardings(config, mesh)` and the
    step is jitted with explicit in/out shardings (logits replicated). When JAX runs
    several processes, process 0 broadcasts each step to the others (`follow`).
    """

    def __init__(self, model_config: LlamaConfig, params: Params, config: RunnerConfig,
                 mesh: Mesh | None = None, fault_injector: FaultInjector | None = None,
                 consume_params: bool = False):
        # consume_params: the runner may delete `params`' arrays it holds in another form (the native CPU
        # matmul's blocks): the caller then uses `runner.params` (the engine's own weights: one copy)
        # fault_injector: a test hook, fault_injector(entries, logits) -> logits, called by execute_model
        # after the forward and before sampling; it may raise (fails the step) or corrupt rows
        # (see docs/security.md)
        self.fault_injector = fault_injector
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        if mesh is not None:
            parallel.check_tensor_parallel(model_config, mesh.shape[parallel.TP])
        # params in the checkpoint layout are converted here (the engine converts before sizing the pool)
        # the native CPU matmul's column blocks (f32, one device): they decide the layout, then get packed below
        packed = packs_weights(config.attention_backend, params["embed"].dtype, sharded=mesh is not None)
        if config.quantization is not None and not packed:
            raise ValueError(f"quantization={config.quantization!r} runs on the native CPU matmul, which holds "
                             "float32 weights on one device: use dtype='float32', one device (no tensor "
                             "parallelism), the CPU backend with attention_backend 'auto' or 'cpu', and a C++ "
                             f"compiler (g++); here: dtype {np.dtype(params['embed'].dtype).name}, backend "
                             f"{jax.default_backend()}/{config.backend}, "
                             f"{'a mesh' if mesh is not None else 'one device'}")
        self.layout = config.layout(packed=packed)
        params = to_weight_layout(model_config, params, self.layout, mesh)
        self.dtype = params["embed"].dtype
        self.kv_dtype = config.kv_dtype(self.dtype)
        self.kv = allocate_kv_pool(model_config, config.num_pages, config.page_size, self.kv_dtype, mesh)
        self._followers_released = False
        self._huge_pages: threading.Thread | None = None  # advising the weights (CPU, one device)
        self._compiled: dict[tuple[int, int, int, int], jax.stages.Compiled] = {}  # (T, S, P, L) -> step; warmup()
        options = config.compiler_options()
        self._init_fused_sampler(options)
        # the scheduled requests' sampler constants and page tables, kept across their steps (`_sampling_batch`,
        # `prepare`; kept_rows)
        self._row_constants = sampler.RowConstants(model_config.vocab_size, 2 * config.max_num_seqs)
        self._page_tables = KeptRows(2 * config.max_num_seqs, config.max_pages_per_seq, np.int32)
        # the verify buckets this runner gives T logits rows (compiled at warm-up), none where it does not pack
        self._verify_buckets = frozenset(config.verify_buckets if self.packs_drafts_in_tokens() else ())
        if mesh is None:
            # XLA:CPU: a tied LM head runs as its own [E, V] copy (llama.untie_lm_head)
            self.params = untie_lm_head(model_config, params) if jax.default_backend() == "cpu" else params
            if packed:
                arena = HugePageArena(sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(self.params)))
                self.params = pack_weights(self.params, functools.partial(_pack_for_cpu_matmul, arena=arena,
                                                                          quantization=config.quantization),
                                           consume=consume_params)
            # XLA:CPU's buffers on huge pages: each step streams the weights (donation keeps the pool's buffer).
            # The weight blocks are born there; the fresh pool's pages are dropped, to come back huge as it
            # fills; the rest (the embedding, norms) is collapsed, which copies it, on a thread of its own (the
            # kernel's work, outside the GIL) while warm-up traces; `warmup` waits for it.
            advise_zeroed_huge_pages(self.kv)
            self._huge_pages = threading.Thread(target=advise_huge_pages, args=(self.params,), daemon=True,
                                                name="jaxpaged-huge-pages")
            self._huge_pages.start()
            self._step = jax.jit(paged_forward, static_argnums=(0, 1), donate_argnums=(3,), compiler_options=options)
            return
        shardings = parallel.param_shardings(model_config, mesh, self.layout)
        self.params = parallel.shard_params(params, shardings)
        pool = parallel.kv_pool_sharding(mesh)
        rep = parallel.replicated(mesh)
        self._step = jax.jit(paged_forward, static_argnums=(0, 1, 5), donate_argnums=(3,), compiler_options=options,
                             in_shardings=(shardings, KVPool(pool, pool), rep),
                             out_shardings=(rep, rep, KVPool(pool, pool)))

    def _init_fused_sampler(self, options: dict[str, str]) -> None:
        """The fused step (config.fuse_sampler): its jit, and the device arrays every fused step reads."""
        if self.mesh is not None and self.config.fuse_sampler == "on":
            raise ValueError("fuse_sampler='on' needs one device: a tensor-parallel mesh samples on the host's "
                             "replicated logits ('auto' or 'off')")
        self.fuse_sampler = self.mesh is None and self.config.sampler_fused()
        self._fused_step = jax.jit(fused_step, static_argnums=(0, 1, 2), donate_argnums=(4,),
                                   compiler_options=options)
        # (T, S, P, random) -> fused step; warmup()
        self._compiled_fused: dict[tuple[int, int, int, bool], jax.stages.Compiled] = {}
        self._neutral = {}
        if self.fuse_sampler:  # what the absent optional sampler arrays read; ~5 bytes x S x V for each S bucket
            self._neutral = {s: sampler.neutral_arrays(s, self.model_config.vocab_size)
                             for s in self.config.seq_buckets}
        self._zeros_r = jnp.zeros((self.config.seq_buckets[-1],), jnp.int32)  # i32[R]: no tokens, no drafts rejected
        # a Redraft's slots (one shape for every step: `Redraft`)
        self._redraft_slots = self.config.draft_seq_buckets[-1] if self.config.num_speculative_tokens else 1
        # nothing anew, on the device (the arrays every step without redrafts takes: no transfer each step)
        self._no_redraft = jax.device_put(Redraft.none(self._redraft_slots, self.config.num_speculative_tokens))
        # i32[R, k]: no drafts accepted in flight
        self._no_accepted = jnp.full((self.config.seq_buckets[-1], self.config.num_speculative_tokens), -1, jnp.int32)

    @property
    def multi_process(self) -> bool:
        return self.mesh is not None and jax.process_count() > 1

    def _release(self, request_ids: Sequence[str]) -> None:
        """Forget the rows kept for these requests (finished)."""
        self._row_constants.release(request_ids)
        self._page_tables.release(request_ids)

    def prepare(self, entries: Sequence[ScheduledRequest]) -> StepInput:
        """Pack one step's scheduled requests into padded host arrays. With the fused sampler, a verification
        step takes an S bucket with a row for each draft too, where one has (its drafts are then sampled and
        verified in the step's program: no second pass over the LM head, no other sampler call)."""
        ps, n = self.config.page_size, len(entries)
        lens = np.fromiter((len(e.token_ids) for e in entries), np.int32, n)  # i32[n]: tokens fed per entry
        starts = np.fromiter((e.start_position for e in entries), np.int32, n)  # i32[n]
        num_pages = np.fromiter((len(e.page_ids) for e in entries), np.int32, n)  # i32[n]
        num_tokens = int(lens.sum())
        rows = n + sum(len(e.spec_token_ids) for e in entries)  # logits rows: the entries', drafts'
        num_slots = rows if self.fuse_sampler and rows <= self.config.max_num_seqs else n
        t_bucket, s_bucket, p_bucket = self.config.bucket_for(num_tokens, num_slots, int(num_pages.max()))
        token_ids = np.zeros(t_bucket, np.int32)
        positions = np.zeros(t_bucket, np.int32)
        slots = np.zeros(t_bucket, np.int32)  # padding: slot 0, in the null page
        page_table = np.zeros((s_bucket, p_bucket), np.int32)  # entry i's pages at [i, 0:num_pages[i]), then 0
        page_table[:n] = self._page_tables.rows([e.request_id for e in entries], [e.page_ids for e in entries],
                                                tuple, operator.eq, p_bucket)  # rows made again where pages changed
        kv_lens = np.zeros(s_bucket, np.int32)
        cu = np.zeros(s_bucket + 1, np.int32)
        last = np.zeros(self._logits_rows((t_bucket, s_bucket, p_bucket), rows), np.int32)  # i32[L]
        np.cumsum(lens, out=cu[1:n + 1])
        cu[n + 1:] = num_tokens
        # per fed token t: its entry, position and slot (page_table[entry, position // ps] * ps + position % ps)
        token_rows = np.repeat(np.arange(n, dtype=np.int32), lens)
        pos = np.arange(num_tokens, dtype=np.int32) + np.repeat(starts - cu[:n], lens)
        page_index = pos // ps  # i32[num_tokens]: each fed token's place in its entry's page table
        if num_tokens and (page_index >= num_pages[token_rows]).any():
            raise ValueError("a scheduled entry feeds a position past its page table")
        token_ids[:num_tokens] = np.fromiter(itertools.chain.from_iterable(e.token_ids for e in entries), np.int32,
                                             num_tokens)
        positions[:num_tokens] = pos
        slots[:num_tokens] = page_table[token_rows, page_index] * ps + pos % ps
        kv_lens[:n] = starts + lens
        last[:n] = cu[1:n + 1] - 1
        return StepInput(token_ids, positions, slots, page_table, kv_lens, cu, np.int32(len(entries)), last)

    def packs_drafts_in_tokens(self) -> bool:
        """Whether verification steps of `RunnerConfig.verify_buckets` shapes take T logits rows (warm-up
        compiles them): one device, sampler not fused (the fused program samples its S rows)."""
        return self.mesh is None and not self.fuse_sampler

    def _logits_rows(self, shape: tuple[int, int, int], rows: int) -> int:
        """L of a step of `shape` (T, S, P) that needs `rows` logits rows: T where S is too few and the
        shape is a verify bucket this runner packs, else S (the drafts then go to `draft_logits`)."""
        t, s, _ = shape
        return t if rows > s and shape in self._verify_buckets else s

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """One step: pack, forward, (fault hook), sample the rows that sample; host-side results.

        grammar_bitmask: i32[len(entries) + D, W] allowed tokens per scheduled request, then per draft position
        of the D drafts fed (structured outputs, llguidance's layout, W = ceil(V / 32); a request's draft
        position j, in step order: the token after its first j drafts), None when no request is constrained,
        or a callable returning either, called once the forward is dispatched (the host fills it while the
        device runs).
        Entries whose params ask for prompt_logprobs also get the log-probabilities of the prompt
        tokens this chunk predicts, from the same forward's hidden states (`prompt_logprobs_step`)."""
        entries = scheduler_output.scheduled_requests
        if any(e.placeholder for e in entries):
            raise ValueError("a step with placeholder tokens (async scheduling) runs through dispatch(), "
                             "which fills them from the previous step")
        self._release(scheduler_output.finished_request_ids)
        step = self.prepare(entries)
        layout = self._layout_drafts(entries, step) if any(e.spec_token_ids for e in entries) else None
        if self.fuse_sampler and self.fault_injector is None:
            return self._execute_fused(entries, step, layout, grammar_bitmask)
        logits, hidden = self._forward(step)  # f32[S, V], [T, E]; dispatched (asynchronous)
        if callable(grammar_bitmask):
            grammar_bitmask = grammar_bitmask()
        if self.fault_injector is not None:
            logits = self.fault_injector(entries, logits)
        grammar_bitmask = _check_bitmask(grammar_bitmask, entries)
        batch, top = self._sampling_batch(entries, step, layout, grammar_bitmask)
        sampled = sample_jit(logits, batch, num_top_logprobs=top)
        drafts = None if layout is None else self._verify_drafts(layout, sampled, hidden, top, grammar_bitmask)
        prompt = self._prompt_logprobs(entries, step, hidden)
        return ModelRunnerOutput.from_sampler(entries, jax.device_get(sampled), prompt,
                                              None if drafts is None else drafts.to_host())

    def _execute_fused(self, entries: Sequence[ScheduledRequest], step: StepInput, layout: DraftRows | None,
                       grammar_bitmask: GrammarBitmask | None) -> ModelRunnerOutput:
        """execute_model in one program (`fused_step`); the grammar bitmask, one of its inputs, is filled first.
        Only the rare sampler fallbacks, top log-probs, unpacked drafts and prompt log-probs run other programs."""
        if callable(grammar_bitmask):
            grammar_bitmask = grammar_bitmask()
        grammar_bitmask = _check_bitmask(grammar_bitmask, entries)
        batch, top = self._sampling_batch(entries, step, layout, grammar_bitmask)
        fused, hidden = self._run_fused(step, self._step_sampling(batch, step, layout=layout))
        sampled = sampler.finish_in_step(fused.sample, batch, top)()
        drafts = None
        if layout is not None and layout.packed:
            drafts = verify_packed(layout, sampled, fused)
        elif layout is not None:
            drafts = self._verify_drafts(layout, sampled, hidden, top, grammar_bitmask)
        prompt = self._prompt_logprobs(entries, step, hidden)
        return ModelRunnerOutput.from_sampler(entries, jax.device_get(sampled), prompt,
                                              None if drafts is None else drafts.to_host())

    def _sampling_batch(self, entries: Sequence[ScheduledRequest], step: StepInput, layout: DraftRows | None,
                        grammar_bitmask: np.ndarray | None,
                        history: dict[str, tuple] | None = None) -> tuple[SamplingBatch, int]:
        """The step's sampler rows (the entries', then packed draft rows) and its num_top_logprobs. The grammar
        bitmask (`_check_bitmask`'s) has its rows in that order: packed drafts follow the entries in step order.
        history: `_in_flight_history`'s, for the entries' rows (the layout's rows already have it)."""
        S, V, history = len(step.logits_indices), self.model_config.vocab_size, history or {}
        # the entries' rows from their kept constants (`sampling_row`'s RowInfo only where a row needs more)
        scalars, key_data = self._row_constants.gather([(e.request_id, e.sampling_params, e.seed) for e in entries])
        steps = [e.num_output_tokens + len(e.spec_token_ids) for e in entries]
        special = {i: sampling_row(e, None, *history.get(e.request_id, ())) for i, e in enumerate(entries)
                   if sampler.needs_row_info(e.sampling_params, banned_at(e, len(e.spec_token_ids)))}
        drafts = layout.rows if layout is not None and layout.packed else ()
        if drafts:
            more = sampler.row_constants(drafts, V)
            scalars, key_data, steps = (np.concatenate([a, b]) for a, b in zip((scalars, key_data, steps), more))
            special.update((len(entries) + j, row) for j, row in enumerate(drafts)
                           if sampler.needs_row_info(row.params, row.banned_token_ids))
        rows = len(entries) + len(drafts)
        batch = sampler.assemble_sampling_batch(scalars, key_data, steps, special, S, V,
                                                token_bitmask=_pad_bitmask(grammar_bitmask, S, rows))
        return batch, num_top_logprobs_for([e.sampling_params.logprobs for e in entries])  # 0 unless a row asks

    def _step_sampling(self, batch: SamplingBatch, step: StepInput, *, layout: DraftRows | None = None,
                       sources: np.ndarray | None = None, previous: jax.Array | None = None,
                       rejected: jax.Array | None = None, shifts: np.ndarray | None = None,
                       redraft: Redraft | None = None, accepted: jax.Array | None = None,
                       count_from: np.ndarray | None = None) -> StepSampling:
        """A fused step's sampler inputs (StepSampling) from its host batch; absent parts neutral."""
        S, k, V = batch.num_rows, self.config.num_speculative_tokens, self.model_config.vocab_size
        draft_rows, draft_ids = np.zeros((S, k), np.int32), np.full((S, k), -1, np.int32)
        if layout is not None and layout.packed:
            n = len(layout.request_ids)
            draft_rows[:n], draft_ids[:n] = layout.sample_rows[:n], layout.draft_ids[:n]
        if sources is None:
            sources = np.full(len(step.token_ids), -1, np.int32)
        previous = self._zeros_r if previous is None else previous
        rejected = self._zeros_r if rejected is None else rejected
        if shifts is None:
            shifts = np.full(len(step.token_ids), -1, np.int32)
        neutral = self._neutral.get(S) or sampler.neutral_arrays(S, V)  # made here only for `lower_fused`
        redraft = self._no_redraft if redraft is None else redraft
        accepted = self._no_accepted if accepted is None else accepted
        if count_from is None:
            count_from = np.full(S, len(step.token_ids), np.int32)
        return StepSampling(sampler.with_neutral_arrays(batch, neutral), previous, sources, rejected, shifts,
                            accepted, count_from, draft_rows, draft_ids, redraft)

    def _run_fused(self, step: StepInput, sampling: StepSampling) -> tuple[FusedStep, jax.Array]:
        """(FusedStep, hidden [T, E]) from the fused program `warmup` compiled for the step's shape and batch
        (greedy-only or not; else the jitted one, compiling on first use)."""
        random = has_random_rows(sampling.batch)
        compiled = self.compiled_fused_program(step, random)
        if compiled is not None:
            fused, hidden, self.kv = compiled(self.params, self.kv, step, sampling)
        else:
            fused, hidden, self.kv = self._fused_step(self.model_config, self.config.attention, random, self.params,
                                                      self.kv, step, sampling)
        return fused, hidden

    def _layout_drafts(self, entries: Sequence[ScheduledRequest], step: StepInput) -> DraftRows:
        """Place the step's draft rows (see DraftRows); when they fit in the padding logits slots, point
        step.logits_indices there (the forward then computes their logits with the entries')."""
        k = self.config.num_speculative_tokens
        offsets = np.cumsum([0] + [e.num_tokens for e in entries])[:-1]  # each entry's first fed token
        spec = [(int(offset), e) for offset, e in zip(offsets, entries) if e.spec_token_ids]
        M = next(b for b in self.config.draft_seq_buckets if b >= len(spec))
        first = len(entries)
        packed = first + sum(len(e.spec_token_ids) for _, e in spec) <= len(step.logits_indices)
        sample_rows = np.zeros((M, k), np.int32)
        draft_ids = np.full((M, k), -1, np.int32)
        token_index = []
        for m, (offset, e) in enumerate(spec):
            d = len(e.spec_token_ids)
            if not packed:  # row m * k + j of the M * k draft rows
                token_index += [0] * (m * k - len(token_index))
            sample_rows[m, :d] = (first if packed else 0) + len(token_index) + np.arange(d)
            draft_ids[m, :d] = e.spec_token_ids
            token_index += range(offset, offset + d)  # the fed token at position j predicts draft j
        if packed:
            step.logits_indices[first:first + len(token_index)] = token_index
        else:
            token_index += [0] * (M * k - len(token_index))
        entries = tuple(e for _, e in spec)
        return DraftRows(packed, tuple(e.request_id for e in entries), tuple(len(e.spec_token_ids) for e in entries),
                         sample_rows, draft_ids, np.asarray(token_index, np.int32), _draft_rows(entries, packed, M, k))

    def _verify_drafts(self, layout: DraftRows, sampled: SamplerOutput, hidden: jax.Array, top: int,
                       grammar_bitmask: np.ndarray | None = None, pending: PendingStep | None = None) -> VerifiedDrafts:
        """Sample the draft rows (already done when packed with the entries' rows) and count the accepted
        drafts of each slot, on device. pending: the dispatched step they belong to (async scheduling: its key
        steps may move back, `PendingStep.key_steps`)."""
        if not layout.packed:
            logits = draft_logits(self.model_config, self.params, hidden, layout.token_index)  # f32[M * k, V]
            batch = make_sampling_batch(list(layout.rows), len(layout.rows), logits.shape[1],
                                        token_bitmask=_draft_bitmask(layout, grammar_bitmask))
            if pending is not None:
                batch = pending.key_steps(batch, layout.token_index)
            sampled = sample_jit(logits, batch, num_top_logprobs=top)
        return verify_packed(layout, sampled)

    def _prompt_logprobs(self, entries: Sequence[ScheduledRequest], step: StepInput,
                         hidden: jax.Array) -> dict[str, PromptLogprobs]:
        """Prompt log-probs of the entries that ask, over this step's hidden states (empty if none ask)."""
        spans = prompt_logprob_spans(entries)
        if not spans:
            return {}
        targets = np.zeros(len(step.token_ids), np.int32)  # [T]: the token each fed position predicts
        for offset, first, count, entry in spans.values():
            targets[offset:offset + count] = entry.prompt_token_ids[first:first + count]
        out = jax.device_get(prompt_logprobs_step(self.model_config, self.params, hidden, targets))
        return {rid: PromptLogprobs(first, *(a[offset:offset + count] for a in out))
                for rid, (offset, first, count, _) in spans.items()}

    # ---- async scheduling: the step in three calls (module docstring) ----

    def dispatch(self, scheduler_output: SchedulerOutput, previous: PendingStep | None) -> PendingStep:
        """Pack the step, fill its placeholder tokens on the device from `previous` (the step dispatched just
        before, whose sampled tokens the host has not seen), dispatch the forward. Nothing waits.
        With the fused sampler the step's sampler is dispatched here too, in the same program."""
        if self.multi_process:
            raise RuntimeError("async scheduling needs the step's tokens on the host of every process: "
                               "multi-process runs take the synchronous loop")
        entries = scheduler_output.scheduled_requests
        self._release(scheduler_output.finished_request_ids)
        step = self.prepare(entries)
        layout = self._layout_drafts(entries, step) if any(e.spec_token_ids for e in entries) else None
        sources = _placeholder_sources(entries, step, previous) if any(e.placeholder for e in entries) else None
        shifts = None if sources is None else _shift_rows(entries, step, previous)

        def carry() -> tuple:
            """`PendingStep.carry` of previous: waits for its forward where it has random rows (their sampler
            flags), so this step takes it once the host work that needs none of it is done."""
            return (None, None, None) if sources is None else previous.carry(self.config.seq_buckets[-1])

        layout, redraft = self._redraft(entries, step, layout, previous, carry) if sources is not None else \
            (layout, None)
        if self.fuse_sampler:
            return self._dispatch_fused(entries, step, layout, sources, carry, shifts, redraft, previous)
        carried = carry()
        if shifts is not None or redraft is not None:  # positions moved back, drafts fed: a program per (T, S, P)
            filled = fill_in_flight_jit(
                step.token_ids, step.positions, step.slot_mapping, step.page_table, step.kv_lens, step.cu_q_lens,
                carried[0], self._zeros_r if carried[1] is None else carried[1], sources,
                np.full(len(step.token_ids), -1, np.int32) if shifts is None else shifts,
                redraft or self._no_redraft, self.config.page_size)
            step = dataclasses.replace(step, **dict(zip(("token_ids", "positions", "slot_mapping", "kv_lens"), filled)))
        elif sources is not None:  # previous' tokens padded to the largest S: one gather program per T bucket
            step = dataclasses.replace(step, token_ids=merge_sampled_tokens(step.token_ids, carried[0], sources))
        logits, hidden = self._forward(step)  # f32[S, V] (L rows), [T, E]; dispatched
        return PendingStep(entries, step, logits, hidden, layout=layout, redraft=redraft, shifts=shifts,
                           rejected=carried[1])

    def _redraft(self, entries: Sequence[ScheduledRequest], step: StepInput, layout: DraftRows | None,
                 previous: PendingStep, carry: Callable[[], tuple]) -> tuple[DraftRows | None, Redraft | None]:
        """With RunnerConfig.prompt_lookup: the drafts of `layout` proposed on a guess of `previous`' outcome (in
        flight; ScheduledRequest.spec_guess) proposed again on the device where the guess proves wrong
        (`redraft_in_flight`). Returns (the layout with the drafts it verifies, `redrafted`; the Redraft to feed), or
        (layout, None) when no slot guessed. carry: `previous.carry` (called only when some slot guessed)."""
        lookup = self.config.prompt_lookup
        if layout is None or lookup is None:
            return layout, None
        index = {e.request_id: i for i, e in enumerate(entries)}
        guessed = [(m, entries[index[rid]]) for m, rid in enumerate(layout.request_ids)
                   if entries[index[rid]].placeholder and entries[index[rid]].spec_guess is not None]
        if not guessed:
            return layout, None
        fed = {e.request_id: e.spec_token_ids for e in previous.entries}  # the drafts in flight
        known = [list(e.prompt_token_ids) + list(e.output_token_ids) for _, e in guessed]
        width = max(len(c) + len(fed.get(e.request_id, ())) + 1 for c, (_, e) in zip(known, guessed))
        M, H = len(layout.draft_ids), next(b for b in self.config.history_buckets if b >= width)
        history = np.zeros((M, H), np.int32)  # i32[M, H]: known tokens, then the drafts in flight
        lengths = np.zeros((3, M), np.int32)  # per slot: known tokens, drafts in flight, its fed token's index
        rows, guess = np.full(M, -1, np.int32), np.zeros((M, 2), np.int32)
        previous_slots = np.full(M, self._redraft_slots, np.int32)  # i32[M]: the slot in previous' Redraft
        slot_before = {} if previous.layout is None else {rid: m for m, rid in enumerate(previous.layout.request_ids)}
        for (m, e), tokens in zip(guessed, known):
            drafts = fed.get(e.request_id, ())
            history[m, :len(tokens)], history[m, len(tokens):len(tokens) + len(drafts)] = tokens, drafts
            lengths[:, m] = len(tokens), len(drafts), step.cu_q_lens[index[e.request_id]]
            rows[m], previous_slots[m] = previous.rows[e.request_id], slot_before.get(e.request_id, previous_slots[m])
            guess[m] = (len(e.spec_guess) - 1, e.spec_guess[-1]) if e.spec_guess else (-1, -1)  # (): always anew
        tokens, rejected, _ = carry()
        before = previous.redraft or self._no_redraft
        draft_ids, redraft = redraft_in_flight(layout.draft_ids, history, lengths[0], lengths[1], rows, guess, tokens,
                                               self._zeros_r if rejected is None else rejected, lengths[2], before,
                                               previous_slots, self._redraft_slots, lookup)
        return dataclasses.replace(layout, redrafted=draft_ids), redraft

    def _dispatch_fused(self, entries: Sequence[ScheduledRequest], step: StepInput, layout: DraftRows | None,
                        sources: np.ndarray | None, carry: Callable[[], tuple], shifts: np.ndarray | None,
                        redraft: Redraft | None = None, previous: PendingStep | None = None) -> PendingStep:
        """`dispatch` as one program, its sampler rows known now (penalties count the tokens in flight on the
        device: `outputs_in_flight`). A step with a constrained row (its grammar mask needs the previous step's
        token on the host) or a fault injector runs the program's forward only; `dispatch_sample` then samples
        separately. carry: `previous.carry`, called once the host's inputs are built: where the previous step has
        random rows it waits for that step's forward (its sampler flags), so the host work before it overlaps the
        device's."""
        if self.fault_injector is not None or any(
                e.samples and e.sampling_params.structured_outputs is not None for e in entries):
            tokens, rejected, _ = carry()
            logits, hidden = self._forward(step, sources, tokens, rejected, shifts, redraft)
            return PendingStep(entries, step, logits, hidden, layout=layout, redraft=redraft, shifts=shifts,
                               rejected=rejected)
        history = _in_flight_history(entries, layout, None)  # the device counts what the lists lack
        if history and layout is not None and layout.packed:
            layout = _with_history(entries, layout, history)
        batch, top = self._sampling_batch(entries, step, layout, None, history)
        num_rows = len(entries) + (len(layout.rows) if layout is not None and layout.packed else 0)
        count_from = None if sources is None else _count_from(step, sources, num_rows)
        carried = carry()  # the wait, if any, after the sampler's rows are built
        tokens, rejected, accepted = carried
        fused, hidden = self._run_fused(step, self._step_sampling(batch, step, layout=layout, sources=sources,
                                                                  previous=tokens, rejected=rejected, shifts=shifts,
                                                                  redraft=redraft, accepted=accepted,
                                                                  count_from=count_from))
        pending = PendingStep(entries, step, None, hidden, fused=fused, batch=batch, num_top_logprobs=top,
                              layout=layout, redraft=redraft, shifts=shifts, rejected=rejected)
        if layout is not None and not layout.packed:  # random or penalised rows after a verification in flight: wait
            outcome = None if sources is None else functools.partial(_outcome_in_flight, previous, carried, entries)
            pending.layout = layout = _with_history(entries, layout, _in_flight_history(entries, layout, outcome))
            pending.drafts = self._verify_drafts(layout, None, hidden, top, pending=pending)
        return pending

    def dispatch_sample(self, pending: PendingStep, grammar_bitmask: GrammarBitmask | None = None) -> None:
        """Dispatch the sampler (and prompt log-probs) of a dispatched step: execute_model's second half.
        A fused step sampled in its own program: only its fallbacks are left (run by `pending.result`)."""
        entries, layout = pending.entries, pending.layout
        if pending.fused is not None:
            pending.finish_sample = sampler.finish_in_step(pending.fused.sample, pending.batch,
                                                           pending.num_top_logprobs)
        else:
            logits = pending.logits
            if callable(grammar_bitmask):
                grammar_bitmask = grammar_bitmask()
            if self.fault_injector is not None:
                logits = self.fault_injector(entries, logits)
            grammar_bitmask = _check_bitmask(grammar_bitmask, entries)
            history = _in_flight_history(entries, layout, lambda: {})  # the step in flight handled: its outputs listed
            pending.layout = layout = _with_history(entries, layout, history)
            batch, top = self._sampling_batch(entries, pending.step, layout, grammar_bitmask, history)
            batch = pending.key_steps(batch, pending.step.logits_indices)
            pending.finish_sample = sample_deferred(logits, batch, num_top_logprobs=top)
            if layout is not None and not layout.packed:  # the draft rows' own pass, from the hidden states
                pending.drafts = self._verify_drafts(layout, None, pending.hidden, top, grammar_bitmask, pending)
        spans = prompt_logprob_spans(entries)
        if spans:
            pending.prompt_spans = spans
            pending.prompt_arrays = prompt_logprobs_step(self.model_config, self.params, pending.hidden,
                                                         _prompt_targets(spans, len(pending.step.token_ids)))
        pending.logits = pending.hidden = None  # the sampler has what it needs: let the device free them

    def execute(self, step: StepInput) -> jax.Array:
        """Run one step; returns logits f32[S, V] on device (rows past num_seqs are padding).

        In a multi-process run only process 0 calls this; it sends the step to the followers.
        """
        return self._forward(step)[0]

    def _forward(self, step: StepInput, sources: np.ndarray | None = None, previous: jax.Array | None = None,
                 rejected: jax.Array | None = None, shifts: np.ndarray | None = None,
                 redraft: Redraft | None = None) -> tuple[jax.Array, jax.Array]:
        """execute's (logits f32[S, V], hidden [T, E]) on device. With the fused sampler: the fused program
        (one per shape; its sampler on greedy padding rows, nearly free), placeholders filled from
        `previous` (i32[R]) at `sources` (i32[T]) as in `fused_step`."""
        if self.fuse_sampler:
            batch = make_sampling_batch([], len(step.logits_indices), self.model_config.vocab_size)
            fused, hidden = self._run_fused(step, self._step_sampling(batch, step, sources=sources, previous=previous,
                                                                      rejected=rejected, shifts=shifts,
                                                                      redraft=redraft))
            return fused.sample.logits, hidden
        if self.multi_process:
            parallel.broadcast_step(step, empty_step)
        return self._run(step)

    def follow(self) -> int:
        """Processes other than 0: run the steps process 0 broadcasts until it stops; returns the count."""
        steps = 0
        while (step := parallel.broadcast_step(None, empty_step)) is not None:
            self._run(step)
            steps += 1
        return steps

    def stop_followers(self) -> None:
        """Process 0: release the followers from `follow` (once; later calls do nothing)."""
        if self.multi_process and parallel.is_leader() and not self._followers_released:
            self._followers_released = True
            parallel.broadcast_step(None, empty_step)

    def lower(self, step: StepInput, params: Params | None = None,
              platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The jitted step lowered at `step`'s shapes (and `params`' layout, by default the runner's),
        to read its HLO or compile it with XLA options (`.compile(compiler_options={...})`). The
        compiled program takes (params, kv, step), donates kv and returns (logits, hidden, kv).
        platforms: lower for those instead of this machine's (e.g. ("cuda",) on a CPU: StableHLO only)."""
        args = (self.model_config, self.config.attention, self.params if params is None else params,
                self.kv, step) + (() if self.mesh is None else (self.mesh,))
        if platforms is None:
            return self._step.lower(*args)
        return self._step.trace(*args).lower(lowering_platforms=platforms)

    def lower_fused(self, step: StepInput, random: bool = True,
                    platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The fused step (`fused_step`: forward, sampler, draft acceptance) lowered at `step`'s shapes, its
        greedy-only program or (random) the one with random rows; the compiled program takes
        (params, kv, step, StepSampling) and returns (FusedStep, hidden, kv). platforms: as in `lower`."""
        args = (self.model_config, self.config.attention, random, self.params, self.kv, step,
                self.neutral_sampling(step))
        if platforms is None:
            return self._fused_step.lower(*args)
        return self._fused_step.trace(*args).lower(lowering_platforms=platforms)

    def neutral_sampling(self, step: StepInput) -> StepSampling:
        """A fused step's sampler inputs at `step`'s shape with greedy padding rows only (lowering, benches)."""
        batch = make_sampling_batch([], len(step.logits_indices), self.model_config.vocab_size)
        return self._step_sampling(batch, step)

    def compiled_fused_program(self, step: StepInput, random: bool) -> jax.stages.Compiled | None:
        """The fused program `warmup` compiled for `step`'s (T, S, P) shape, greedy-only or with random rows
        (None before warm-up or when the sampler is not fused)."""
        return self._compiled_fused.get((len(step.token_ids), *step.page_table.shape, random))

    def step_program(self, step: StepInput) -> jax.stages.Compiled | None:
        """The program a greedy step of `step`'s shape runs: the fused one (takes `neutral_sampling(step)` too)
        when the sampler is fused, else the forward."""
        return self.compiled_fused_program(step, False) if self.fuse_sampler else self.compiled_program(step)

    def compiled_program(self, step: StepInput) -> jax.stages.Compiled | None:
        """The program `warmup` compiled for `step`'s (T, S, P, L) shape (None before warm-up): to read its HLO
        or to call it as `execute` does, (params, kv, step) -> (logits, hidden, kv), kv donated."""
        return self._compiled.get((len(step.token_ids), *step.page_table.shape, len(step.logits_indices)))

    def forget_compiled(self) -> None:
        """Drop the warm programs (a later `warmup` compiles or loads them again)."""
        self._compiled.clear()
        self._compiled_fused.clear()

    def _run(self, step: StepInput) -> tuple[jax.Array, jax.Array]:
        """(logits, hidden) from the step's program compiled by `warmup` (else the jitted step, compiling
        on first use)."""
        compiled = self.compiled_program(step)
        if self.mesh is None:
            if compiled is not None:
                logits, hidden, self.kv = compiled(self.params, self.kv, step)
            else:
                logits, hidden, self.kv = self._step(self.model_config, self.config.attention, self.params,
                                                     self.kv, step)
            return logits, hidden
        rep = parallel.replicated(self.mesh)
        step = jax.tree.map(lambda x: parallel.put_global(x, rep), step)
        if compiled is not None:
            logits, hidden, self.kv = compiled(self.params, self.kv, step)
        else:
            logits, hidden, self.kv = self._step(self.model_config, self.config.attention, self.params, self.kv,
                                                 step, self.mesh)
        # replicated: this process's full copies, sampled locally
        return logits.addressable_data(0), hidden.addressable_data(0)

    def warmup(self, async_scheduling: bool = False) -> dict[str, float]:
        """Compile every (T, S, P) bucket and the sampler ahead of time, so serving never compiles.

        With the fused sampler each shape gets the fused step's two programs, greedy-only and with random rows
        (the forward alone is never compiled: steps that sample outside it use the greedy program's logits).
        async_scheduling: also the placeholder-token gathers (`lower_async`). Nothing runs: this thread traces
        and lowers every program, a pool of threads compiles them as they come (XLA compiles outside the GIL;
        a persistent-cache hit loads the program instead) and fills the jit caches (the sampler's parts and
        the others called through their jits) or `_compiled` (the step shapes, which `_run` calls directly).
        Returns the wall seconds of its phases: {"sampler": lowering the sampler's, prompt-logprob and draft
        programs, "async": lowering the gathers (with async_scheduling), "compile": the rest (lowering the
        step shapes, then waiting for the pool)}. Logs each step shape as it is handed to the pool, so a cold
        start shows its progress. Every process compiles the same programs.
        """
        start, buckets, phases = time.perf_counter(), self.config.buckets, {}
        # half the cores: XLA:CPU's compile of one program takes a second core (one thread: 34.4 s cold, two: 40.2)
        workers = max(1, min(len(buckets), (os.cpu_count() or 1) // 2, _MAX_COMPILE_THREADS))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxpaged-compile") as pool:
            futures = {}  # future -> (dict, key) its program goes to, None: a jit's cache holds it
            for i, (t, s, p) in enumerate(buckets, 1):
                logger.info("compiling step shape %d/%d: (T, S, P) = (%d, %d, %d)", i, len(buckets), t, s, p)
                options = self.config.compiler_options(num_tokens=t)
                for rows in self._warm_logits_rows((t, s, p)):
                    lowered = self.lower(empty_step(t, s, p, rows))
                    futures[pool.submit(lowered.compile, compiler_options=options)] = \
                        (self._compiled, (t, s, p, rows))
                for random in (False, True) if self.fuse_sampler else ():
                    lowered = self.lower_fused(empty_step(t, s, p), random)
                    futures[pool.submit(lowered.compile, compiler_options=options)] = \
                        (self._compiled_fused, (t, s, p, random))
            for phase, lower in (("sampler", self.lower_sampler), ("async", self.lower_async)):
                if phase == "async" and not async_scheduling:
                    continue
                phase_start = time.perf_counter()
                futures.update((pool.submit(lowered.compile), None) for lowered in lower())
                phases[phase] = time.perf_counter() - phase_start
            for future in concurrent.futures.as_completed(futures):
                program, target = future.result(), futures[future]
                if target is not None:
                    target[0][target[1]] = program
        phases["compile"] = time.perf_counter() - start - sum(phases.values())
        logger.info("compiled %d step shapes (T, S, P) and %d other programs in %.1f s on %d threads",
                    len(buckets), sum(target is None for target in futures.values()), time.perf_counter() - start,
                    workers)
        if self.multi_process:  # processes finish compiling at different times: meet, then run a step together
            parallel.barrier("jaxpaged-warmup", _WARMUP_BARRIER_SECONDS)
            jax.block_until_ready(self._run(empty_step(*buckets[0])))  # also sets up the cross-process collectives
        if self._huge_pages is not None:  # the weights' advice done, then again: pages it could not collapse
            self._huge_pages.join()  # (already huge: free; the pool's pages come in huge as it fills)
            advise_huge_pages(self.params)
        return phases

    def _warm_logits_rows(self, shape: tuple[int, int, int]) -> tuple[int, ...]:
        """The L values `warmup` compiles the forward of shape (T, S, P) with (none with the fused sampler)."""
        if self.fuse_sampler:
            return ()
        t, s, _ = shape
        return (s, t) if shape in self._verify_buckets else (s,)

    def lower_sampler(self) -> list[jax.stages.Lowered]:
        """The sampler's parts at every S bucket (sampler.lower_parts) and, on one device (the engine refuses
        prompt log-probs on a mesh), the prompt log-probs' and speculative decoding's programs: what `warmup`
        compiles besides the step shapes and async scheduling's gathers."""
        V = self.model_config.vocab_size
        lowered = [program for s in self.config.seq_buckets for program in sampler.lower_parts(s, V)]
        return lowered + (self.lower_prompt_logprobs() + self.lower_draft_verification() if self.mesh is None else [])

    def lower_prompt_logprobs(self) -> list[jax.stages.Lowered]:
        """prompt_logprobs_step at every T bucket (it runs only for requests that ask)."""
        return [prompt_logprobs_step.lower(self.model_config, self.params,
                                           jnp.zeros((t, self.model_config.hidden_size), self.dtype),
                                           np.zeros(t, np.int32))
                for t in sorted({t for t, _, _ in self.config.buckets})]

    def lower_draft_verification(self) -> list[jax.stages.Lowered]:
        """Speculative decoding: draft_logits at every (T, M) of `draft_shapes`, the sampler at every M x k rows
        and at the T rows of packed verify buckets, and accept_drafts for each (rows sampled, M) (none when
        speculation is off)."""
        k, V = self.config.num_speculative_tokens, self.model_config.vocab_size
        lowered = [draft_logits.lower(self.model_config, self.params,
                                      jnp.zeros((t, self.model_config.hidden_size), self.dtype),
                                      np.zeros(m * k, np.int32))
                   for t, m in self.config.draft_shapes]
        packed = {t for t, _, _ in self._verify_buckets}  # T logits rows of the packed verify buckets
        for rows in sorted(packed - set(self.config.seq_buckets)):
            lowered += sampler.lower_parts(rows, V)
        for m in self.config.draft_seq_buckets:
            lowered += sampler.lower_parts(m * k, V)
            lowered += [accept_drafts.lower(jnp.zeros(n, jnp.int32), np.zeros((m, k), np.int32),
                                            np.zeros((m, k), np.int32))
                        for n in {m * k, *self.config.seq_buckets, *packed}]  # draft rows alone, or with the entries'
        return lowered

    def lower_async(self) -> list[jax.stages.Lowered]:
        """Async scheduling's gathers: `pad_sampled_tokens` at every S bucket (a step's sampled tokens as the next
        step's, i32[largest S]) and, unless the step program gathers them itself (the fused sampler),
        `merge_sampled_tokens` at every T bucket."""
        R = self.config.seq_buckets[-1]
        lowered = [pad_sampled_tokens.lower(jnp.zeros((s,), jnp.int32), R) for s in self.config.seq_buckets]
        if not self.fuse_sampler:
            lowered += [merge_sampled_tokens.lower(np.zeros(t, np.int32), jnp.zeros(R, jnp.int32),
                                                   np.full(t, -1, np.int32))
                        for t in sorted({t for t, _, _ in self.config.buckets})]
        return lowered + self.lower_verification_in_flight()

    def lower_verification_in_flight(self) -> list[jax.stages.Lowered]:
        """Speculative decoding under async scheduling: `carry_tokens` for each (rows sampled, draft rows, M) a
        verification step has, and, unless the step program does it itself (the fused sampler),
        `fill_in_flight_jit` at every (T, S, P) bucket (none when speculation is off)."""
        k, R = self.config.num_speculative_tokens, self.config.seq_buckets[-1]
        if not k:
            return []
        i32 = functools.partial(np.zeros, dtype=np.int32)
        packed = {t for t, _, _ in self._verify_buckets} | set(self.config.seq_buckets)
        slots = self.config.draft_seq_buckets
        # (rows sampled, draft rows, M, acceptance counts): packed (the fused step counts its S rows' slots, S >= M:
        # each slot takes two rows), or not
        shapes = {(n, n, m, a) for n in packed for m in slots for a in ({m, n} if self.fuse_sampler else {m})
                  if a >= m} | \
            {(s, m * k, m, m) for s in self.config.seq_buckets for m in slots}
        lowered = [carry_tokens.lower(jnp.zeros(n, jnp.int32), jnp.zeros(d, jnp.int32), R, i32(m), i32((m, k)),
                                      jnp.zeros(a, jnp.int32), i32(m), i32((m, k))) for n, d, m, a in sorted(shapes)]
        if not self.fuse_sampler:
            zeros, none = jnp.zeros(R, jnp.int32), functools.partial(np.full, fill_value=-1, dtype=np.int32)
            lowered += [fill_in_flight_jit.lower(i32(t), i32(t), i32(t), i32((s, p)), i32(s), i32(s + 1), zeros,
                                                 zeros, none(t), none(t), self._no_redraft, self.config.page_size)
                        for t, s, p in self.config.buckets]
        # drafts proposed again (prompt_lookup): at every (M, H); the layout's draft_ids on the host, or a device's
        lookup, zeros = self.config.prompt_lookup, jnp.zeros(R, jnp.int32)
        lowered += [redraft_in_flight.lower(i32((m, k)), i32((m, h)), i32(m), i32(m), i32(m), i32((m, 2)), zeros,
                                            zeros, i32(m), self._no_redraft, i32(m), self._redraft_slots, lookup)
                    for m in slots for h in self.config.history_buckets]
        return lowered


class _Counted:
    """A device program that counts its calls (count_dispatches); other attributes are the program's."""

    def __init__(self, program, name: str, counts: collections.Counter):
        self._program, self._name, self._counts = program, name, counts

    def __call__(self, *args, **kwargs):
        self._counts[self._name] += 1
        return self._program(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._program, attr)


@contextlib.contextmanager
def count_dispatches(runner: ModelRunner):
    """Count the device programs launched while inside: yields a Counter {program: calls}, the step programs
    as "fused_step" / "paged_forward", the others by function name. Test and benchmark instrumentation: it
    wraps the runner's compiled and jitted step programs and every jitted function of this module and of
    jaxpaged.sample.sampler (called through their module globals), and restores them on exit."""
    counts: collections.Counter = collections.Counter()
    modules = (sys.modules[__name__], sampler)
    saved = [(m, name, f) for m in modules for name, f in vars(m).items() if hasattr(f, "_cache_size")]
    for module, name, f in saved:
        setattr(module, name, _Counted(f, name, counts))
    attrs = {"_step": runner._step, "_fused_step": runner._fused_step, "_compiled": runner._compiled,
             "_compiled_fused": runner._compiled_fused}
    runner._step = _Counted(runner._step, "paged_forward", counts)
    runner._fused_step = _Counted(runner._fused_step, "fused_step", counts)
    runner._compiled = {k: _Counted(p, "paged_forward", counts) for k, p in runner._compiled.items()}
    runner._compiled_fused = {k: _Counted(p, "fused_step", counts) for k, p in runner._compiled_fused.items()}
    try:
        yield counts
    finally:
        for module, name, f in saved:
            setattr(module, name, f)
        for attr, value in attrs.items():
            setattr(runner, attr, value)

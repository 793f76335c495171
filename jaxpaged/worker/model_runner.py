"""Model runner: scheduler output -> padded step input -> one jitted paged forward -> sampled tokens.

`ModelRunner.execute_model(scheduler_output)` is the engine's one call per step: it
packs the scheduled requests (`prepare`), runs the forward (`execute`), calls the
`fault_injector(entries, logits) -> logits` test hook if one is set, samples every
row that samples (the per-request sampler state rides on each `ScheduledRequest`:
seed, num_output_tokens, banned ids, prompt/output ids) and returns a host-side
`ModelRunnerOutput`.

Async scheduling (`dispatch`, jaxpaged/worker/dispatch.py) and the fused sampler (`fused_step`,
jaxpaged/worker/step_program.py) are described where they live.

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
    k_scale, v_scale: f32 [L, K]    an fp8 pool's scales (jaxpaged/worker/kv_scales.py), else None

With a mesh (tensor parallelism, see jaxpaged/worker/parallel.py) the params and the
pool are sharded over it, attention runs per shard under shard_map, and the
logits come back replicated.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpaged.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxpaged.models.fp8 import quantize_params
from jaxpaged.models.llama import LlamaConfig, Params, untie_lm_head
from jaxpaged.models.weight_dots import pack_weights
from jaxpaged.sample import in_step, sampling_batch
from jaxpaged.sample.sampler import SamplerOutput, num_top_logprobs_for, sample_jit
from jaxpaged.sample.sampling_batch import SamplingBatch, make_sampling_batch
from jaxpaged.spec_decode.verify import (
    DraftRows,
    Redraft,
    VerifiedDrafts,
    _check_bitmask,
    _draft_bitmask,
    _pad_bitmask,
    no_draft_slots,
    verify_packed,
)
from jaxpaged.worker import parallel
from jaxpaged.worker.compilation import StepCompilation
from jaxpaged.worker.dispatch import AsyncDispatch
from jaxpaged.worker.host_memory import HugePageArena, advise_huge_pages, advise_zeroed_huge_pages
from jaxpaged.worker.in_flight import PendingStep, _draft_rows, banned_at, sampling_row
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.worker.kv_scales import check_kv_scales
from jaxpaged.worker.live_weights import LiveWeights, RunnerSleep
from jaxpaged.worker.runner_config import INT8_DOTS, RunnerConfig, check_fp8_kv_support, fp8_gemm, packs_weights
from jaxpaged.worker.runner_output import (ModelRunnerOutput, PromptLogprobs, prompt_logprob_spans, prompt_targets,
                                          split_prompt_logprobs)
from jaxpaged.worker.step_input import (
    FaultInjector,
    GrammarBitmask,
    HostLayout,
    KVPool,
    StepInput,
    allocate_kv_pool,
    empty_step,
)
from jaxpaged.worker.step_program import (_pack_for_cpu_matmul, draft_logits, packed_fused_step, paged_forward,
                                          prompt_logprobs_step)
from jaxpaged.worker.weight_layout import to_weight_layout

logger = logging.getLogger(__name__)


class ModelRunner(AsyncDispatch, StepCompilation, LiveWeights, RunnerSleep):
    """Owns the params and the KV pool; turns scheduler outputs into logits.

    With a mesh the params are placed onto `param_shardings(config, mesh)` and the
    step is jitted with explicit in/out shardings (logits replicated). When JAX runs
    several processes, process 0 broadcasts each step to the others (`follow`).
    """

    def __init__(self, model_config: LlamaConfig, params: Params, config: RunnerConfig,
                 mesh: Mesh | None = None, fault_injector: FaultInjector | None = None,
                 consume_params: bool = False, kv_scales: tuple[np.ndarray, np.ndarray] | None = None):
        # consume_params: the runner may delete `params`' arrays it holds in another form (the native CPU
        # matmul's blocks): the caller then uses `runner.params` (the engine's own weights: one copy)
        # fault_injector: a test hook, fault_injector(entries, logits) -> logits, called by execute_model
        # after the forward and before sampling; it may raise (fails the step) or corrupt rows
        # (see docs/security.md)
        # kv_scales: an fp8 pool's (k_scale, v_scale) f32 [L, K] (kv_scales.resolve_kv_scales); required then
        self.fault_injector = fault_injector
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        if mesh is not None:
            parallel.check_tensor_parallel(model_config, mesh.shape[parallel.TP])
        # params in the checkpoint layout are converted here (the engine converts before sizing the pool)
        # the native CPU matmul's column blocks (f32, one device): they decide the layout, then get packed below
        packed = packs_weights(config.attention_backend, params["embed"].dtype, sharded=mesh is not None,
                               quantization=config.quantization)
        if config.quantization == "fp8" and mesh is not None:
            raise ValueError("quantization='fp8' is not supported with tensor parallelism yet (one device)")
        if config.quantization in INT8_DOTS and not packed:
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
        check_fp8_kv_support(self.kv_dtype, config.backend, sharded=mesh is not None)
        self.kv = allocate_kv_pool(model_config, config.num_pages, config.page_size, self.kv_dtype, mesh,
                                   check_kv_scales(model_config, self.kv_dtype, kv_scales))
        self._followers_released = False
        self._huge_pages: threading.Thread | None = None  # advising the weights (CPU, one device)
        self._compiled: dict[tuple[int, int, int, int], jax.stages.Compiled] = {}  # (T, S, P, L) -> step; warmup()
        options = config.compiler_options()
        self._init_fused_sampler(options)
        # the persistent batch: each scheduled request's page table and sampler constants, kept across its steps
        # and updated by the scheduler's diffs (`pack`, `_sampling_batch`; input_batch.py)
        self.input_batch = InputBatch(2 * config.max_num_seqs, config.max_pages_per_seq, model_config.vocab_size)
        # the verify buckets this runner gives T logits rows (compiled at warm-up), none where it does not pack
        self._verify_buckets = frozenset(config.verify_buckets if self.packs_drafts_in_tokens() else ())
        self._place_params(params, packed, consume_params, options)

    def _place_params(self, params: Params, packed: bool, consume_params: bool, options: dict[str, str]) -> None:
        """The runner's form of the weights (one device: untied LM head on CPU, packed blocks, huge pages; a mesh:
        sharded) and the jitted step over them."""
        if self.mesh is None:
            # XLA:CPU: a tied LM head runs as its own [E, V] copy (llama.untie_lm_head)
            self.params = untie_lm_head(self.model_config, params) if jax.default_backend() == "cpu" else params
            if self.config.quantization == "fp8":  # the engine quantises before sizing the pool; others' params here
                self.params = quantize_params(self.params, fp8_gemm(), consume=consume_params)
            if packed:
                arena = HugePageArena(sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(self.params)))
                self.params = pack_weights(self.params, functools.partial(_pack_for_cpu_matmul, arena=arena,
                                                                          quantization=self.config.quantization),
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
        shardings = parallel.param_shardings(self.model_config, self.mesh, self.layout)
        self.params = parallel.shard_params(params, shardings)
        pool = parallel.kv_pool_sharding(self.mesh)
        rep = parallel.replicated(self.mesh)
        self._step = jax.jit(paged_forward, static_argnums=(0, 1, 5), donate_argnums=(3,), compiler_options=options,
                             in_shardings=(shardings, KVPool(pool, pool), rep),
                             out_shardings=(rep, rep, KVPool(pool, pool)))

    def _init_fused_sampler(self, options: dict[str, str]) -> None:
        """The fused step (config.fuse_sampler): its jit, and the device arrays every fused step reads."""
        if self.mesh is not None and self.config.fuse_sampler == "on":
            raise ValueError("fuse_sampler='on' needs one device: a tensor-parallel mesh samples on the host's "
                             "replicated logits ('auto' or 'off')")
        self.fuse_sampler = self.mesh is None and self.config.sampler_fused()
        self._fused_step = jax.jit(packed_fused_step, static_argnums=(0, 1, 2, 3), donate_argnums=(5,),
                                   compiler_options=options)
        # (T, S, P, random) -> fused step, and the layout of its host arrays (`pack_host_inputs`); warmup()
        self._compiled_fused: dict[tuple[int, int, int, bool], jax.stages.Compiled] = {}
        self._fused_layouts: dict[tuple[int, int, int, bool], HostLayout] = {}
        self._neutral = {}
        if self.fuse_sampler:  # what the absent optional sampler arrays read; ~5 bytes x S x V for each S bucket
            self._neutral = {s: in_step.neutral_arrays(s, self.model_config.vocab_size)
                             for s in self.config.seq_buckets}
        self._zeros_r = jnp.zeros((self.config.seq_buckets[-1],), jnp.int32)  # i32[R]: no tokens, no drafts rejected
        # a Redraft's slots (one shape for every step: `Redraft`)
        self._redraft_slots = self.config.draft_seq_buckets[-1] if self.config.num_speculative_tokens else 1
        # nothing anew, on the device (the arrays every step without redrafts takes: no transfer each step)
        self._no_redraft = jax.device_put(Redraft.none(self._redraft_slots, self.config.num_speculative_tokens))
        # i32[R, k]: no drafts accepted in flight
        self._no_accepted = jnp.full((self.config.seq_buckets[-1], self.config.num_speculative_tokens), -1, jnp.int32)
        # no packed drafts ({S: (draft_rows, draft_ids) i32[S, k]}), no positions moved back ({T: i32[T] of -1})
        self._no_drafts, self._no_shifts = {}, {}
        if self.fuse_sampler:
            self._no_drafts = {s: jax.device_put(no_draft_slots(s, self.config.num_speculative_tokens))
                               for s in self.config.seq_buckets}
            self._no_shifts = {t: jnp.full(t, -1, jnp.int32) for t in {t for t, _, _ in self.config.buckets}}

    @property
    def multi_process(self) -> bool:
        return self.mesh is not None and jax.process_count() > 1

    def remove_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the persistent batch's rows of the requests the output names finished or preempted (every
        scheduler output reaches here, scheduled or empty: a row kept for them would go stale)."""
        self.input_batch.remove(scheduler_output.finished_request_ids)
        self.input_batch.remove(scheduler_output.preempted_request_ids)

    def prepare(self, entries: Sequence[ScheduledRequest]) -> StepInput:
        """Pack one step's scheduled requests into padded host arrays (`pack`, its rows dropped)."""
        return self.pack(entries)[0]

    def pack(self, entries: Sequence[ScheduledRequest]) -> tuple[StepInput, np.ndarray]:
        """(StepInput, rows intp[n]): one step's scheduled requests packed into padded host arrays, and each
        entry's row of the persistent batch (its diff applied), which the step's sampler rows are gathered from
        (`_sampling_batch`). With the fused sampler, a verification step takes an S bucket with a row for each
        draft too, where one has (its drafts are then sampled and verified in the step's program: no second
        pass over the LM head, no other sampler call)."""
        ps, n = self.config.page_size, len(entries)
        rows = self.input_batch.apply(entries)  # i{p}[n]: each entry's row, its page-table diff applied
        fed = [e.token_ids for e in entries]
        flat = np.fromiter(itertools.chain.from_iterable(fed), np.int32)  # i32[num_tokens]: the tokens fed, in order
        starts = np.fromiter([e.start_position for e in entries], np.int32, n)  # i32[n]
        num_tokens = len(flat)  # logits rows: the entries', then their drafts' (none where each fed one token)
        # i32[n]: tokens fed per entry (a decode step, the most common, feeds one each: no pass to count them)
        lens = np.ones(n, np.int32) if num_tokens == n else np.array([len(t) for t in fed], np.int32)
        num_pages = self.input_batch.num_pages[rows]  # i32[n]
        num_logits_rows = n if num_tokens == n else n + sum(len(e.spec_token_ids) for e in entries)
        num_slots = num_logits_rows if self.fuse_sampler and num_logits_rows <= self.config.max_num_seqs else n
        t_bucket, s_bucket, p_bucket = self.config.bucket_for(num_tokens, num_slots, int(num_pages.max()))
        token_ids = np.zeros(t_bucket, np.int32)
        positions = np.zeros(t_bucket, np.int32)
        slots = np.zeros(t_bucket, np.int32)  # padding: slot 0, in the null page
        page_table = np.zeros((s_bucket, p_bucket), np.int32)  # entry i's pages at [i, 0:num_pages[i]), then 0
        page_table[:n] = self.input_batch.page_table[rows, :p_bucket]
        kv_lens = np.zeros(s_bucket, np.int32)
        cu = np.zeros(s_bucket + 1, np.int32)
        last = np.zeros(self._logits_rows((t_bucket, s_bucket, p_bucket), num_logits_rows), np.int32)  # i32[L]
        np.cumsum(lens, out=cu[1:n + 1])
        cu[n + 1:] = num_tokens
        # per fed token t: its entry, position and slot (page_table[entry, position // ps] * ps + position % ps)
        token_rows = np.arange(n, dtype=np.int32)
        pos = starts  # one token an entry: at its start
        if num_tokens != n:
            token_rows = np.repeat(token_rows, lens)
            pos = np.arange(num_tokens, dtype=np.int32) + np.repeat(starts - cu[:n], lens)
        page_index = pos // ps  # i32[num_tokens]: each fed token's place in its entry's page table
        if num_tokens and (page_index >= num_pages[token_rows]).any():
            raise ValueError("a scheduled entry feeds a position past its page table")
        token_ids[:num_tokens] = flat
        positions[:num_tokens] = pos
        slots[:num_tokens] = page_table[token_rows, page_index] * ps + pos % ps
        kv_lens[:n] = starts + lens
        last[:n] = cu[1:n + 1] - 1
        return StepInput(token_ids, positions, slots, page_table, kv_lens, cu, np.int32(len(entries)), last), rows

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
        self.remove_requests(scheduler_output)
        step, rows = self.pack(entries)
        layout = self._layout_drafts(entries, step) if any(e.spec_token_ids for e in entries) else None
        if self.fuse_sampler and self.fault_injector is None:
            return self._execute_fused(entries, rows, step, layout, grammar_bitmask)
        logits, hidden = self._forward(step)  # f32[S, V], [T, E]; dispatched (asynchronous)
        if callable(grammar_bitmask):
            grammar_bitmask = grammar_bitmask()
        if self.fault_injector is not None:
            logits = self.fault_injector(entries, logits)
        grammar_bitmask = _check_bitmask(grammar_bitmask, entries)
        batch, top = self._sampling_batch(entries, rows, step, layout, grammar_bitmask)
        sampled = sample_jit(logits, batch, num_top_logprobs=top)
        drafts = None if layout is None else self._verify_drafts(layout, sampled, hidden, top, grammar_bitmask)
        prompt = self._prompt_logprobs(entries, step, hidden)
        return ModelRunnerOutput.from_sampler(entries, sampled, prompt,
                                              None if drafts is None else drafts.to_host())

    def _execute_fused(self, entries: Sequence[ScheduledRequest], rows: np.ndarray, step: StepInput,
                       layout: DraftRows | None, grammar_bitmask: GrammarBitmask | None) -> ModelRunnerOutput:
        """execute_model in one program (`fused_step`); the grammar bitmask, one of its inputs, is filled first.
        Only the rare sampler fallbacks, top log-probs, unpacked drafts and prompt log-probs run other programs."""
        if callable(grammar_bitmask):
            grammar_bitmask = grammar_bitmask()
        grammar_bitmask = _check_bitmask(grammar_bitmask, entries)
        batch, top = self._sampling_batch(entries, rows, step, layout, grammar_bitmask, fused=True)
        (sample, num_accepted, _), hidden = self._run_fused(step, self._step_sampling(batch, step, layout=layout))
        sampled = in_step.finish_in_step(sample, batch, top)()
        drafts = None
        if layout is not None and layout.packed:
            drafts = verify_packed(layout, sampled, sample, num_accepted)
        elif layout is not None:
            drafts = self._verify_drafts(layout, sampled, hidden, top, grammar_bitmask)
        prompt = self._prompt_logprobs(entries, step, hidden)
        return ModelRunnerOutput.from_sampler(entries, sampled, prompt,
                                              None if drafts is None else drafts.to_host())

    def _sampling_batch(self, entries: Sequence[ScheduledRequest], entry_rows: np.ndarray, step: StepInput,
                        layout: DraftRows | None, grammar_bitmask: np.ndarray | None,
                        history: dict[str, tuple] | None = None, fused: bool = False) -> tuple[SamplingBatch, int]:
        """The step's sampler rows (the entries', then packed draft rows) and its num_top_logprobs. entry_rows:
        the entries' rows of the persistent batch (`pack`'s). The grammar bitmask (`_check_bitmask`'s) has its
        rows in that order: packed drafts follow the entries in step order. history: `_in_flight_history`'s,
        for the entries' rows (the layout's rows already have it). fused: for the fused program (its logit bias None
        when no row has one: `_step_sampling` takes the device's neutral pair)."""
        S, V, history = len(step.logits_indices), self.model_config.vocab_size, history or {}
        # the entries' rows from their kept constants (`sampling_row`'s RowInfo only where a row needs more)
        kept = self.input_batch
        scalars, key_data = kept.scalars[entry_rows], kept.key_data[entry_rows]
        steps = [e.num_output_tokens for e in entries] if layout is None else \
            [e.num_output_tokens + len(e.spec_token_ids) for e in entries]
        special = {i: sampling_row(e, None, *history.get(e.request_id, ())) for i, e in
                   ((i, entries[i]) for i in kept.may_need_row_info(entries, entry_rows, drafts=layout is not None))
                   if sampling_batch.needs_row_info(e.sampling_params, banned_at(e, len(e.spec_token_ids)))}
        drafts = layout.rows if layout is not None and layout.packed else ()
        if drafts:
            more = sampling_batch.row_constants(drafts, V)
            scalars, key_data, steps = (np.concatenate([a, b]) for a, b in zip((scalars, key_data, steps), more))
            special.update((len(entries) + j, row) for j, row in enumerate(drafts)
                           if sampling_batch.needs_row_info(row.params, row.banned_token_ids))
        rows = len(entries) + len(drafts)
        batch = sampling_batch.assemble_sampling_batch(scalars, key_data, steps, special, S, V,
                                                       token_bitmask=_pad_bitmask(grammar_bitmask, S, rows),
                                                       neutral_bias=fused)
        return batch, num_top_logprobs_for(bool(kept.logprobs[entry_rows].any()))  # 0 unless a row asks

    def _step_sampling(self, batch: SamplingBatch, step: StepInput, *, layout: DraftRows | None = None,
                       sources: np.ndarray | None = None, previous: jax.Array | None = None,
                       rejected: jax.Array | None = None, shifts: np.ndarray | None = None,
                       redraft: Redraft | None = None, accepted: jax.Array | None = None,
                       count_from: np.ndarray | None = None) -> SamplingBatch:
        """A fused step's sampler inputs from its host batch: every optional array present, the fused step's own
        fields set (`SamplingBatch`); absent parts neutral."""
        S, V, T = batch.num_rows, self.model_config.vocab_size, len(step.token_ids)
        k = self.config.num_speculative_tokens
        # What most steps lack (packed drafts, positions moved back, a logit bias) is taken from arrays kept on the
        # device; where a step has them they are put there too, so each input is always of one kind (a numpy
        # array where a device array was would be another jit cache entry, i.e. a compile without warm-up).
        draft_rows, draft_ids = self._no_drafts.get(S) or jax.device_put(no_draft_slots(S, k))
        if layout is not None and layout.packed:
            draft_rows, draft_ids = jax.device_put(layout.slot_arrays(S))
        if sources is None:
            sources = np.full(T, -1, np.int32)
        previous = self._zeros_r if previous is None else previous
        rejected = self._zeros_r if rejected is None else rejected
        shifts = self._no_shifts.get(T) if shifts is None else jax.device_put(shifts)
        shifts = jnp.full(T, -1, jnp.int32) if shifts is None else shifts  # made here only for `lower_fused`
        bias = {}
        if batch.bias_ids is not None:  # some row has a logit bias or banned ids
            bias = dict(zip(("bias_ids", "bias_values"), jax.device_put((batch.bias_ids, batch.bias_values))))
        neutral = self._neutral.get(S) or in_step.neutral_arrays(S, V)  # made here only for `lower_fused`
        redraft = self._no_redraft if redraft is None else redraft
        accepted = self._no_accepted if accepted is None else accepted
        if count_from is None:
            count_from = np.full(S, T, np.int32)
        return in_step.with_neutral_arrays(batch, neutral, previous_tokens=previous, sources=sources,
                                           previous_rejected=rejected, shifts=shifts, previous_accepted=accepted,
                                           count_from=count_from, draft_rows=draft_rows, draft_ids=draft_ids,
                                           redraft=redraft, **bias)

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
            logits = draft_logits(self.model_config, self.params, hidden, layout.token_index,
                                  batch_invariant=self.invariant_head)  # f32[M * k, V]
            batch = make_sampling_batch(list(layout.rows), len(layout.rows), logits.shape[1],
                                        token_bitmask=_draft_bitmask(layout, grammar_bitmask))
            if pending is not None:
                batch = pending.key_steps(batch, layout.token_index)
            sampled = sample_jit(logits, batch, num_top_logprobs=top)
        return verify_packed(layout, sampled)

    @property
    def invariant_head(self) -> str | None:
        """How the LM head outside the step (prompt log-probs, unpacked drafts' logits: `step_program.head_matmul`)
        runs batch-invariant, as the step's weight dots do: "native" on the native CPU kernels, "gemm" elsewhere (a
        GPU's fixed-tile GEMM); None without the mode."""
        if not self.config.batch_invariant or self.mesh is not None:
            return None
        return "native" if self.config.attention.native_matmul else "gemm"

    def _prompt_logprobs(self, entries: Sequence[ScheduledRequest], step: StepInput,
                         hidden: jax.Array) -> dict[str, PromptLogprobs]:
        """Prompt log-probs of the entries that ask, over this step's hidden states (empty if none ask)."""
        spans = prompt_logprob_spans(entries)
        if not spans:
            return {}
        out = prompt_logprobs_step(self.model_config, self.params, hidden, prompt_targets(spans, len(step.token_ids)),
                                   batch_invariant=self.invariant_head)
        return split_prompt_logprobs(spans, jax.device_get(out))

    # ---- async scheduling: the step in three calls (module docstring) ----

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
            return fused[0].logits, hidden
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

"""LLMEngine: requests in, one continuous-batching step at a time, outputs back.

    request -> Scheduler.schedule() -> SchedulerOutput
            -> ModelRunner.execute_model() -> ModelRunnerOutput (sampled ids, logprobs; host side)
            -> detokenizer (text, stop strings) -> stop verdicts
            -> Scheduler.update_from_output (appends tokens; every stop ends there)
            -> RequestOutput, as SamplingParams.output_kind asks

Outputs follow vLLM's RequestOutputKind: CUMULATIVE (everything so far), DELTA (only
what is new: token ids, logprobs and text; a step costs O(new tokens)) or FINAL_ONLY
(one output at the end). The finish record is the scheduler Request's (status,
stop_reason); outputs read it from there.

Async scheduling (`EngineArgs.async_scheduling`, vLLM v1's): the engine keeps one step
in flight. `step()` schedules and dispatches step N+1 before step N's sampled tokens
reach the host (N+1's decode tokens are N's, gathered on the device), then handles N's
outputs (stop checks, detokenizing, outputs, metrics) while N+1 runs, then dispatches
N+1's sampler (which sees N's tokens: penalties and grammar masks need no fallback).
A request that stops or is aborted at N costs at most one wasted slot in N+1 (none for
a length stop); its pages are released once, when it finishes. Greedy and seeded
outputs equal the synchronous loop's token for token (a row's key counts the tokens
in flight). Only steps of at most `async_scheduling_max_tokens` tokens stay in flight
(on CPU a few: the host shares the step's cores); a larger one is handled before the
next is scheduled. Falls back to the synchronous loop: multi-process runs (followers
take each step's tokens from the host).

Speculative decoding with async scheduling: drafts follow a request's last token, which
is in flight. Requests without min_tokens bans or a grammar
(`_verifies_overlapped`; `EngineArgs.overlap_verification`, on with a GPU) verify
overlapped too: with step N in flight (a verification of d drafts, or a decode), step
N+1 is scheduled as if all d were accepted (the scheduler's `num_draft_placeholders`),
its drafts proposed on a guess of N's outcome (`NgramProposer.propose_past`: the same
lookup's continuation decides which drafts N accepts), and the device moves N+1's token,
positions and random rows' key steps to N's real outcome (`model_runner.fill_in_flight`,
`steps_moved_back`: seeded outputs stay those of the synchronous loop); when N's tokens reach
the host its rejected drafts are rolled back. Where the guess proves wrong, the device
proposes N+1's drafts again from N's real outcome (`model_runner.redraft_in_flight`; the
host keeps their twin, `_note_redrafts`); a request whose lookup finds nothing before its
token in flight but that copied lately reserves blank drafts the device fills; penalty
counts add the tokens in flight on the device (`outputs_in_flight`). Other requests
(grammar masks and min_tokens bans follow the tokens in flight on the host): a step
that verifies their drafts runs synchronously (scheduled after the
step in flight is handled, handled before the next is scheduled), and the others
stay overlapped; with a step in flight the engine guesses whether drafts would
follow the token in flight (`_drafts_likely`), and only then waits for that step and
proposes.

A request with n > 1 becomes n child requests (`<id>#<i>`, seeds seed + i) that
share the prompt's pages through prefix caching, aggregated back into one
RequestOutput (in DELTA mode it holds only the children that got new tokens).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpaged.worker import parallel
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.errors import InvalidRequestError
from jaxpaged.worker.model_runner import (GPU_COMMAND_BUFFERS, FaultInjector, ModelRunner, ModelRunnerOutput,
                                   PendingStep, PromptLogprobs, RunnerConfig, build_native_kernels, check_fuse_sampler,
                                   check_kv_cache_dtype, check_quantization, kv_bytes_per_page, packs_weights,
                                   resolve_kv_cache_dtype)
from jaxpaged.models.loader import DEFAULT_MODEL, LoadedModel, load_model
from jaxpaged.models.model_cache import default_model_cache_dir
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.core.request import Request, RequestStatus, StopVerdict
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.core.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from jaxpaged.spec_decode.ngram import (DraftLengthPolicy, NgramProposer, SpecDecodingStats, SpeculativeConfig,
                                  max_drafts_for)
from jaxpaged.sample.structured_outputs import GrammarMatcher, StructuredOutputManager
from jaxpaged.sample.structured_outputs import available as structured_outputs_available  # noqa: I001
from jaxpaged.engine.validation import validate_request
from jaxpaged.worker.weight_layout import check_weight_layout, resolve_weight_layout, to_weight_layout

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on CPU when no size is given
_CPU_DEFAULT_MAX_MODEL_LEN = 2048  # keeps the CPU warm-up (one compile per step shape) short
# On CPU async scheduling keeps only steps of at most this many tokens in flight: there the host's work for
# the next step runs beside the step's own threads on the same cores, which pays while a step is bound by
# reading the weights (a few rows) and costs once its matmuls are compute-bound (docs/benchmarks.md,
# "Session 16")
CPU_ASYNC_MAX_TOKENS = 8
# Speculative decoding on GPU: steps of up to this many tokens cost about the same (bf16 weights on an H200:
# ~200 FLOP a byte before the matmuls turn compute-bound), so drafts beside a request without drafts may fill a
# step up to it (SchedulerConfig.memory_bound_tokens; an estimate from the roofline, not yet measured). On CPU
# every row adds compute: 0.
GPU_MEMORY_BOUND_TOKENS = 128
# Overlapped verification: a request whose draft was accepted lately but whose lookup finds nothing before its token
# in flight reserves blank draft rows (BLANK_DRAFT_TOKEN, fed and proposed again on the device from that token on)
# for up to this many steps without a match; the host's lookup lags the device's by that token, so after a copy
# breaks the device finds the match again a step sooner (docs/benchmarks.md, "Session 37")
BLANK_DRAFT_STEPS = 3
BLANK_DRAFT_TOKEN = 0
# Speculation with async scheduling: after drafts proposed for a token in flight found no room in the step (a
# mixed batch's padding, the partial-prefill slots), the engine overlaps 2, 4, ... up to this many steps of the
# same batch before it waits for a token in flight to propose again (each wait costs the step's host time).
NO_ROOM_MAX_WAIT = 32


def default_compilation_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpaged", "xla")


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """vLLM's engine arguments, by the same names."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's context length (capped at 2048 on CPU)
    max_num_seqs: int | None = None  # default: 256 on GPU, 64 on CPU
    max_num_batched_tokens: int | None = None  # default: 8192 on GPU (vLLM's serving budget), 512 on CPU
    # requests fed a prefill chunk in one step; default 16 on GPU, 4 on CPU (bounds attention's prefill tiles)
    max_num_partial_prefills: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes for the KV pool
    num_pages: int | None = None  # KV pool size in pages (incl. the null page); overrides the above
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # the KV pool's dtype (see model_runner.resolve_kv_cache_dtype)
    # vLLM's `quantization`: the weight dots' weights as int8, a scale per column and 32 rows (model_runner.QUANTIZATIONS;
    # CPU, float32 weights on one device, the native matmul): "int8" (weight-only), "w8a8" (x quantised too) or None
    quantization: str | None = None
    # The step's weight layout (jaxpaged/worker/weight_layout.py): "auto" (per-layer arrays, read in place, where the
    # weights are not packed for the native CPU matmul, whose packed stack a scan reads in place; the stacked
    # scan compiles faster), "stacked" or "per_layer"; fuse_projections: q/k/v and gate/up one gemm each
    weight_layout: str = "auto"
    fuse_projections: bool = True
    # XLA:GPU command buffers (CUDA graphs) over the step: "auto", "xla", "off" or "full" (model_runner)
    command_buffers: str = "auto"
    # The sampler inside the step's jitted program, one executable call per step (model_runner.FUSE_SAMPLER):
    # "auto" (on with a GPU backend, off on CPU: docs/benchmarks.md, "The fused sampler"), "on" or "off"
    fuse_sampler: str = "auto"
    tensor_parallel_size: int = 1  # devices in the "tp" mesh (see jaxpaged/worker/parallel.py)
    distributed_coordinator: str | None = None  # multi-host: "host:port" of process 0
    num_processes: int = 1  # multi-host: processes in jax.distributed
    process_id: int = 0  # multi-host: this process (0 schedules, the others `follow`)
    chat_template: str | None = None
    generation_config: str | None = None  # path to a generation_config.json
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)
    # programs compiling faster than this are not persisted (JAX's default, 1 s, leaves most step shapes of a
    # small model out of the cache, so every start compiled them again); 0: persist every program
    compilation_cache_min_compile_secs: float = 0.0
    # a GGUF model's dequantised params and tokenizer, cached for the next start (None: no cache)
    model_cache_dir: str | None = dataclasses.field(default_factory=default_model_cache_dir)
    warmup: bool = True
    # vLLM's speculative_config: a SpeculativeConfig, or its dict / JSON text (converted here); None: off.
    # Only the n-gram (prompt lookup) method: {"method": "ngram", "num_speculative_tokens": k, ...}
    speculative_config: SpeculativeConfig | None = None

    # vLLM v1's async scheduling: dispatch step N+1 before step N's tokens reach the host (module docstring);
    # None: on (one process; with speculative decoding, steps that verify drafts run synchronously)
    async_scheduling: bool | None = None
    # Which steps async scheduling keeps in flight: those feeding at most this many tokens; a larger step is
    # handled before the next one is scheduled (the synchronous order). None: every step with a GPU; on CPU,
    # where the host's work shares the cores with the step's matmuls, CPU_ASYNC_MAX_TOKENS
    async_scheduling_max_tokens: int | None = None
    # Speculative decoding under async scheduling: greedy requests' verification steps overlap the next step
    # (module docstring). None: on with a GPU, where a synchronous step exposes the host's whole work (H200: a
    # verification step 7.3 ms against 4.4 ms overlapped); off on CPU, where the host time is a few % of a step:
    # SmolLM2 at batch 1 gained nothing from it (docs/benchmarks.md, "Session 36" and "Session 37")
    overlap_verification: bool | None = None

    def __post_init__(self):
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be a bool or None (auto)")
        if self.overlap_verification is not None and not isinstance(self.overlap_verification, bool):
            raise ValueError(f"overlap_verification={self.overlap_verification!r} must be a bool or None (auto)")
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            if not isinstance(spec, (dict, str)):
                raise ValueError(f"speculative_config must be a dict, its JSON text or a SpeculativeConfig, "
                                 f"got {type(spec).__name__}")
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(spec))  # frozen: set once
        if self.speculative_config is not None and (self.tensor_parallel_size > 1 or self.num_processes > 1):
            raise ValueError("speculative_config is not supported with tensor parallelism or several processes yet")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be a positive integer")
        _ = self.distributed  # validates the multi-host fields
        check_kv_cache_dtype(self.kv_cache_dtype)  # before the model loads
        check_quantization(self.quantization)
        if self.quantization is not None and (self.tensor_parallel_size > 1 or self.num_processes > 1):
            raise ValueError(f"quantization={self.quantization!r} is not supported with tensor parallelism or several "
                             "processes (it runs on the native CPU matmul, one device)")
        check_weight_layout(self.weight_layout)
        if self.command_buffers not in ("auto", *GPU_COMMAND_BUFFERS):
            raise ValueError(f"command_buffers={self.command_buffers!r}: choose one of "
                             f"{('auto', *GPU_COMMAND_BUFFERS)}")
        check_fuse_sampler(self.fuse_sampler)
        if self.fuse_sampler == "on" and (self.tensor_parallel_size > 1 or self.num_processes > 1):
            raise ValueError("fuse_sampler='on' is not supported with tensor parallelism or several processes: "
                             "leave it 'auto' (off there) or 'off'")
        if not isinstance(self.compilation_cache_min_compile_secs, (int, float)) or \
                not 0 <= self.compilation_cache_min_compile_secs < math.inf:
            raise ValueError(f"compilation_cache_min_compile_secs={self.compilation_cache_min_compile_secs!r} "
                             "must be a number >= 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_num_partial_prefills",
                     "kv_cache_memory", "num_pages", "async_scheduling_max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")

    @property
    def distributed(self) -> parallel.DistributedConfig:
        return parallel.DistributedConfig(self.distributed_coordinator, self.num_processes, self.process_id)


def _configure_compilation_cache(args: EngineArgs) -> None:
    """JAX's persistent compilation cache (process-wide JAX settings) from the engine's arguments."""
    if args.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", args.compilation_cache_min_compile_secs)


@dataclasses.dataclass
class _Child:
    """Engine-side state of one sample (one scheduler Request, which holds the finish record)."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None when params.detokenize is False
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0  # DELTA: output tokens already handed out
    matcher: GrammarMatcher | None = None  # structured outputs: where the output is in its grammar


@dataclasses.dataclass
class _InFlightStep:
    """Async scheduling: a dispatched step whose outputs the engine has not handled yet."""

    scheduler_output: SchedulerOutput
    pending: PendingStep
    requests: dict[str, Request | None]  # each entry's Request when scheduled (ids are reusable after an abort)
    dispatched_at: float  # time.perf_counter() when its forward was dispatched


@dataclasses.dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child]
    metrics: RequestMetrics
    # params.prompt_logprobs: entry per prompt token (index 0: None), filled from the first child's steps
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA: they went out with the first output


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None,
                 fault_injector: FaultInjector | None = None):
        # fault_injector: a test hook handed to the ModelRunner (runner.fault_injector), called every step
        # after the forward as fault_injector(entries, logits) -> logits (see docs/security.md)
        start = time.perf_counter()
        self.args = args
        _configure_compilation_cache(args)
        parallel.initialize_distributed(args.distributed)  # before any JAX computation
        build_native_kernels(args.attention_backend)  # a cold start's C++ builds, beside the loading below
        self.mesh = self._make_mesh()
        self.model = loaded or load_model(args.model, dtype=args.dtype, tokenizer=args.tokenizer,
                                          revision=args.revision, chat_template=args.chat_template,
                                          generation_config=args.generation_config, mesh=self.mesh,
                                          cache_dir=args.model_cache_dir)
        self.tokenizer = self.model.tokenizer
        # The step's weight layout, before the KV pool is sized from free memory: weights this engine
        # loaded are converted in place (one group of tensors at a time); a caller's `loaded` is left usable.
        layout = resolve_weight_layout(args.weight_layout, args.fuse_projections, jax.default_backend(),
                                       packed=self._packs_weights())
        self.model = dataclasses.replace(self.model, params=to_weight_layout(
            self.model.config, self.model.params, layout, self.mesh, consume=loaded is None))
        phases = {"load": time.perf_counter() - start}  # seconds per start-up phase, for the ready line
        self.overlap_verification = (jax.default_backend() == "gpu" if args.overlap_verification is None
                                     else args.overlap_verification)
        self.runner_config = self._runner_config()
        # async scheduling runs on one process (followers take each step's tokens from the host)
        requested = args.async_scheduling is not False
        self.async_scheduling = requested and args.num_processes == 1
        if requested and not self.async_scheduling:
            logger.info("async scheduling: off with num_processes=%d (the synchronous loop runs)", args.num_processes)
        self.async_max_tokens = args.async_scheduling_max_tokens  # the steps kept in flight (None: all)
        if self.async_max_tokens is None and jax.default_backend() == "cpu":
            self.async_max_tokens = CPU_ASYNC_MAX_TOKENS
        self._in_flight: _InFlightStep | None = None  # async scheduling: the step dispatched, not yet handled
        self._last_handled = 0.0  # time.perf_counter() when the last step's outputs were handled
        # speculation with async scheduling: after drafts found no room in a step, the batch (_batch_key) then, the
        # steps left that do not wait to propose again while it stays the same, and the no-room steps in a row
        self._no_room_batch, self._no_room_wait, self._no_room_streak = None, 0, 0
        self._deferred_error: BaseException | None = None  # async: a dispatch failure, raised by the next step()
        self.scheduler = Scheduler(SchedulerConfig(
            async_scheduling=self.async_scheduling,
            num_pages=self.runner_config.num_pages, page_size=args.block_size,
            max_num_seqs=self.runner_config.max_num_seqs,
            max_num_batched_tokens=self.runner_config.max_num_batched_tokens,
            max_model_len=self.runner_config.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
            max_num_partial_prefills=self.runner_config.max_num_partial_prefills,
            token_buckets=self.runner_config.token_buckets,
            memory_bound_tokens=GPU_MEMORY_BOUND_TOKENS if jax.default_backend() == "gpu" else 0,
            sliding_window=self.model.config.sliding_window if self.model.config.all_layers_windowed else None))
        mark = time.perf_counter()
        self.runner = ModelRunner(self.model.config, self.model.params, self.runner_config, self.mesh,
                                  fault_injector=fault_injector, consume_params=loaded is None)
        # the engine's model holds the runner's form of the weights (on CPU the native matmul's blocks): one copy
        self.model = dataclasses.replace(self.model, params=self.runner.params)
        phases["kv_pool"] = time.perf_counter() - mark
        # Structured outputs: grammars compile off this thread; a request waits for its grammar (vLLM's
        # WAITING_FOR_FSM) in _awaiting_grammar, outside the scheduler, while the others run.
        self.structured_outputs = None if self.tokenizer is None or not structured_outputs_available() else \
            StructuredOutputManager(self.tokenizer, self.model.config.vocab_size,
                                    self.model.generation_config.eos_token_ids)
        self._awaiting_grammar: dict[str, tuple[_Parent, concurrent.futures.Future]] = {}
        spec = args.speculative_config
        self.proposer = None if spec is None else NgramProposer(spec)  # speculative decoding (n-gram)
        self._device_lookup = None if spec is None else NgramProposer(spec)  # the host twin of redraft_in_flight's
        self.spec_decoding_stats = None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)
        self.draft_policy = None if spec is None or not spec.adaptive_draft_length else \
            DraftLengthPolicy(spec.num_speculative_tokens)  # which drafts pay for their rows
        self._rng = np.random.default_rng(args.seed)
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Child]] = {}
        if args.warmup:
            phases.update(self.warmup())
        self.startup_seconds = time.perf_counter() - start
        self.startup_phases = phases
        rc = self.runner_config
        quantized = "" if rc.quantization is None else f", weight dots {rc.quantization}"
        logger.info("jaxpaged ready in %.1f s (%s): %s (%s%s), KV pool %d pages x %d tokens = %d tokens (%s), "
                    "backend %s", self.startup_seconds, ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()),
                    self.model.source, self.model.dtype, quantized, rc.num_pages - 1, rc.page_size,
                    (rc.num_pages - 1) * rc.page_size, self.runner.kv_dtype, rc.backend)

    # ---- configuration ----------------------------------------------------

    def _make_mesh(self):
        """None for one device in one process; else the "tp" mesh over the global devices."""
        tp, procs = self.args.tensor_parallel_size, self.args.num_processes
        if tp == 1 and procs == 1:
            return None
        if procs > 1 and tp != jax.device_count():
            raise ValueError(f"with num_processes={procs}, tensor_parallel_size={tp} must equal the global "
                             f"device count {jax.device_count()} (every process serves a shard)")
        return parallel.make_mesh(tp)

    def _packs_weights(self) -> bool:
        """Whether the runner will hold the weight dots' weights packed (`model_runner.packs_weights`)."""
        return packs_weights(self.args.attention_backend, self.model.dtype, sharded=self.mesh is not None)

    def _runner_config(self) -> RunnerConfig:
        args, config = self.args, self.model.config
        on_gpu = jax.default_backend() == "gpu"
        max_model_len = args.max_model_len or (config.max_position_embeddings if on_gpu else
                                               min(config.max_position_embeddings, _CPU_DEFAULT_MAX_MODEL_LEN))
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length "
                             f"{config.max_position_embeddings}")
        max_num_seqs = args.max_num_seqs or (256 if on_gpu else 64)
        max_tokens = args.max_num_batched_tokens or max(8192 if on_gpu else 512, max_num_seqs)
        num_pages = args.num_pages or self._pages_from_memory(on_gpu)
        needed = math.ceil(max_model_len / args.block_size) + 1
        if num_pages < needed:
            raise ValueError(f"the KV pool ({num_pages} pages of {args.block_size} tokens) cannot hold one "
                             f"sequence of max_model_len={max_model_len}; give more memory or a smaller "
                             "max_model_len")
        return RunnerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                            max_model_len=max_model_len, page_size=args.block_size, num_pages=num_pages,
                            attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
                            quantization=args.quantization,
                            weight_layout=args.weight_layout, fuse_projections=args.fuse_projections,
                            command_buffers=args.command_buffers, fuse_sampler=args.fuse_sampler,
                            # CPU step time grows with padded tokens (all of it with XLA's dots, the non-dot part
                            # with packed weights): decode batches of 1-8 get their own shapes
                            min_token_bucket=16 if on_gpu else 1,
                            # and where XLA's dots compute every padding row, steps of decodes plus short
                            # prefills pad less (x1.5 buckets from 32 tokens on); packed weights' dots skip
                            # padding rows (`with_live_rows`), so there the doublings alone compile a third less
                            mid_token_buckets_from=None if on_gpu or self._packs_weights() else 32,
                            # and one request alone gets S = 1: its LM head is one row, not 4 (3 of them padding)
                            min_seq_bucket=4 if on_gpu else 1,
                            max_num_partial_prefills=min(args.max_num_partial_prefills or (16 if on_gpu else 4),
                                                         max_num_seqs),
                            num_speculative_tokens=0 if args.speculative_config is None else
                            args.speculative_config.num_speculative_tokens,
                            # drafts proposed on a wrong guess of a verification in flight: proposed again on the
                            # device (overlap_verification)
                            prompt_lookup=self._prompt_lookup())

    def _prompt_lookup(self) -> tuple[int, int] | None:
        """RunnerConfig.prompt_lookup: the n-gram bounds when verifications may overlap the next step (drafts then
        proposed on a wrong guess of their outcome are proposed again on the device), else None."""
        spec = self.args.speculative_config
        if spec is None or not self.overlap_verification:
            return None
        return spec.prompt_lookup_min, spec.prompt_lookup_max

    def _pages_from_memory(self, on_gpu: bool) -> int:
        # Each device holds 1/tp of every page (its KV heads); the budget is per device.
        kv_dtype = resolve_kv_cache_dtype(self.args.kv_cache_dtype, self.model.dtype, jax.default_backend())
        per_page = kv_bytes_per_page(self.model.config, self.args.block_size, kv_dtype) // \
            self.args.tensor_parallel_size
        budget = self.args.kv_cache_memory
        if budget is None and on_gpu:
            stats = jax.local_devices()[0].memory_stats() or {}
            limit = stats.get("bytes_limit", 0)
            budget = int(limit * self.args.gpu_memory_utilization) - stats.get("bytes_in_use", 0)
        if budget is None:
            budget = _CPU_KV_CACHE_BYTES
        return max(2, budget // per_page)

    def warmup(self) -> dict[str, float]:
        """Compile every step shape and every sampler shape now; none are compiled later.

        Returns the seconds spent on each (ModelRunner.warmup): {"compile": step shapes, "sampler": sampler
        shapes} (and "async": the placeholder-token gathers, with async scheduling)."""
        return self.runner.warmup(self.async_scheduling)

    # ---- requests ---------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int] | dict[str, Any],
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> None:
        """Tokenize, validate and queue a request.

        InvalidRequestError (a ValueError naming the parameter; nothing queued) if it can never be
        served: see jaxpaged/engine/validation.py and the scheduler's admission. ValueError for an id in use.
        """
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if params.prompt_logprobs is not None and self.mesh is not None:
            raise InvalidRequestError("prompt_logprobs is not supported with tensor parallelism yet "
                                      "(tensor_parallel_size > 1 or several processes)", "prompt_logprobs")
        text, token_ids = self._tokenize(prompt)
        eos = () if params.ignore_eos else self.model.generation_config.eos_token_ids
        validate_request(token_ids, params, vocab_size=self.vocab_size, eos_token_ids=eos)
        now = arrival_time or time.time()
        parent = _Parent(request_id, text, token_ids, params, [],
                         RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids)))
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(token_ids)
        parent.children = [self._make_child(parent, i, tuple(eos), now) for i in range(params.n)]
        grammar = self._compile_grammar(params)
        if grammar is not None and not grammar.done():  # it waits for its grammar; the others go on
            self._register(parent)
            self._awaiting_grammar[request_id] = (parent, grammar)
            return
        if grammar is not None:
            self._attach_matchers(parent, grammar.result())  # a GrammarError (ValueError): nothing queued
        self._queue(parent)
        self._register(parent)

    def _queue(self, parent: _Parent) -> None:
        for child in parent.children:  # admission checks on the first; children are identical
            try:
                self.scheduler.add_request(child.request)
            except ValueError:
                self.scheduler.abort_requests([c.request.request_id for c in parent.children])
                raise

    def _register(self, parent: _Parent) -> None:
        self._parents[parent.request_id] = parent
        for child in parent.children:
            self._child_to_parent[child.request.request_id] = (parent, child)

    def _make_child(self, parent: _Parent, index: int, eos: tuple[int, ...], now: float) -> _Child:
        """Sample `index` of a request: n > 1 gives child ids `<id>#<i>` and seeds seed + i."""
        params = parent.params
        child_params = params if params.n == 1 else dataclasses.replace(
            params, n=1, seed=None if params.seed is None else params.seed + index)
        seed = child_params.seed if child_params.seed is not None else int(self._rng.integers(0, 2**63))
        rid = parent.request_id if params.n == 1 else f"{parent.request_id}#{index}"
        request = Request(rid, list(parent.prompt_token_ids), child_params, eos_token_ids=eos, seed=seed,
                          arrival_time=now)
        detok = IncrementalDetokenizer(
            self.tokenizer, parent.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens) if params.detokenize else None
        return _Child(index, request, detok, [] if params.logprobs is not None else None)

    # ---- structured outputs -----------------------------------------------

    def _compile_grammar(self, params: SamplingParams) -> concurrent.futures.Future | None:
        if params.structured_outputs is None:
            return None
        if self.structured_outputs is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer and the llguidance package",
                                      "structured_outputs")
        return self.structured_outputs.compile(params.structured_outputs)

    def _attach_matchers(self, parent: _Parent, compiled) -> None:
        for child in parent.children:
            child.matcher = self.structured_outputs.matcher(compiled)

    def _admit_grammar_ready(self) -> list[RequestOutput]:
        """Queue the requests whose grammar compiled; fail (finish_reason "error") those whose did not."""
        failed = []
        for rid, (parent, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[rid]
            try:
                self._attach_matchers(parent, future.result())
                self._queue(parent)
            except (ValueError, concurrent.futures.CancelledError) as err:
                logger.warning("request %s failed before it ran: %s", rid, err)
                for child in parent.children:
                    child.request.finish(RequestStatus.FINISHED_ERROR)
                failed.append(self._make_output(parent, {c.index for c in parent.children}))
        return [o for o in failed if o is not None]

    def _wait_for_grammars(self, timeout: float = 0.01) -> None:
        """Nothing to run but requests awaiting their grammar: sleep until one is ready (or a moment)."""
        futures = [future for _, future in self._awaiting_grammar.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _grammar_bitmask(self, entries: Sequence[ScheduledRequest]) -> np.ndarray | None:
        """i32[len(entries) + D, W]: the allowed tokens of each constrained row (others all ones); None if none.
        Rows (ModelRunner.execute_model's layout): each entry's last fed token, then the D draft positions of
        the entries that fed drafts, in step order (position j samples the token after the first j drafts)."""
        rows, draft_row = [], len(entries)
        for i, entry in enumerate(entries):
            # .get: with async scheduling the step may hold a request that finished since it was scheduled
            pair = self._child_to_parent.get(entry.request_id) if entry.samples else None
            matcher = pair[1].matcher if pair is not None else None
            d = len(entry.spec_token_ids)
            if matcher is not None:  # the mask after its first j drafts: row draft_row + j, the last one's: row i
                rows.append((matcher, entry.spec_token_ids, [*range(draft_row, draft_row + d), i]))
            draft_row += d
        if not rows:
            return None
        bitmask = np.full((draft_row, self.structured_outputs.mask_width), -1, np.int32)
        self.structured_outputs.fill_bitmask_with_drafts(rows, bitmask)
        return bitmask[:, :self.structured_outputs.sampler_width]

    @staticmethod
    def _grammar_verdict(child: _Child, token_id: int):
        """Advance the child's grammar by its sampled token: (status, None) when that ends it, else None."""
        if child.matcher is None:
            return None
        if not child.matcher.accept(token_id):
            logger.warning("request %s: token %d broke its grammar (%s)", child.request.request_id, token_id,
                           child.matcher.error)
            return RequestStatus.FINISHED_ERROR, None
        return (RequestStatus.FINISHED_STOPPED, None) if child.matcher.is_terminated else None

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _as_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        return None, _as_ids(prompt)

    # ---- what front ends read (the server never reaches further in) ---------

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_model_len(self) -> int:
        return int(self.runner_config.max_model_len)

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json (temperature, top_p, ...)."""
        return dict(self.model.generation_config.defaults)

    def is_request_running(self, request_id: str) -> bool:
        """Whether any sample of the request is in the running batch (False once finished or unknown)."""
        parent = self._parents.get(request_id)
        return parent is not None and any(c.request.status is RequestStatus.RUNNING for c in parent.children)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (after a failed step whose KV writes are lost); False if pages
        are still held by requests, in which case nothing is reset."""
        return self.scheduler.pool.reset_prefix_cache()

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (all their samples) and free their pages at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            self._awaiting_grammar.pop(rid, None)
            self.scheduler.abort_requests([c.request.request_id for c in parent.children])
            for child in parent.children:
                self._child_to_parent.pop(child.request.request_id, None)

    def follow(self) -> int:
        """Multi-host, processes other than 0: run process 0's steps until it calls `shutdown`."""
        if parallel.is_leader():
            raise RuntimeError("follow() is for processes other than 0; process 0 schedules")
        return self.runner.follow()

    def shutdown(self) -> None:
        """Multi-host, process 0: release the followers (their `follow` returns)."""
        self.runner.stop_followers()

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ---- the step ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the outputs it produced (see SamplingParams.output_kind).

        With async scheduling these are the outputs of the step dispatched by the previous call (see
        `_step_async`). After a step raises, the caller aborts the requests that were running (their
        tokens are lost), as AsyncLLM does."""
        if self.async_scheduling:
            return self._step_async()
        start = time.perf_counter()
        failed = self._admit_grammar_ready() if self._awaiting_grammar else []
        if self.proposer is not None:
            self._propose_drafts()
        out = self.scheduler.schedule()
        if out.is_empty:
            if not failed:
                self._wait_for_grammars()
            return failed
        return self._run_sync(out, failed, start)

    def _run_sync(self, out: SchedulerOutput, outputs: list[RequestOutput], start: float) -> list[RequestOutput]:
        """Run a scheduled step and handle its outputs; return `outputs` (those this call made before) and its
        own. start: when the step's host work began (the draft policy's clock)."""
        now = time.time()
        for entry in out.scheduled_requests:
            parent, _ = self._child_to_parent[entry.request_id]
            parent.metrics.first_scheduled_time = parent.metrics.first_scheduled_time or now
        # the grammar bitmask is filled while the forward runs (the runner calls it after dispatching it)
        result = self.runner.execute_model(out, functools.partial(self._grammar_bitmask, out.scheduled_requests))
        for rid, chunk in result.prompt_logprobs.items():
            self._record_prompt_logprobs(*self._child_to_parent[rid], chunk)
        sampled, stops, touched = {}, {}, {}
        for rid in result.req_ids:
            parent, child = self._child_to_parent[rid]
            sampled[rid], stops[rid] = self._emit(child, result, result.token_rows(rid))
            touched.setdefault(parent.request_id, (parent, set()))[1].add(child.index)
        if self.spec_decoding_stats is not None:
            self._observe_drafts(out.scheduled_requests, result)
        self.scheduler.update_from_output(out, sampled, stops)
        outputs = outputs + self._outputs(touched)
        self._observe_step(out, start)
        return outputs

    def _observe_step(self, out: SchedulerOutput, start: float, timed: bool = True) -> None:
        """A step's outputs are handled: the adaptive draft policy times it (from `start`) if it fed only decodes
        and their drafts (and `timed`)."""
        self._last_handled = time.perf_counter()
        if self.draft_policy is not None and timed and all(e.num_tokens == 1 + len(e.spec_token_ids)
                                                           for e in out.scheduled_requests):
            self.draft_policy.observe_step(out.num_scheduled_tokens, self._last_handled - start)

    # ---- the overlapped step (async scheduling) ---------------------------

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and dispatch step N+1, then handle step N's outputs while it runs; return N's outputs.

        Order: schedule N+1 (N's tokens are placeholders) -> dispatch N+1's forward (placeholders gathered
        on the device from N's sampled tokens) -> N's tokens to the host, stop checks, detokenize, outputs
        -> dispatch N+1's sampler (after N's tokens are appended: penalties and grammar masks see them).
        A step feeding more than `async_max_tokens` tokens is then handled at once (its outputs join N's).
        A failure dispatching N+1 is raised by the next call, after N's outputs are returned.
        Speculative decoding: when every request in flight verifies overlapped (`_verifies_overlapped`), drafts
        are proposed past N's outcome, guessed (`_propose_past_in_flight`), and N+1 is dispatched as any other
        step. Otherwise, when drafts are likely (`_drafts_likely`), N is handled first and drafts are proposed;
        a step that verifies drafts some request cannot verify overlapped then runs synchronously (`_run_sync`)."""
        self._raise_deferred_error()
        start = time.perf_counter()
        failed = self._admit_grammar_ready() if self._awaiting_grammar else []
        previous, self._in_flight = self._in_flight, None
        try:
            proposed = overlapped = False
            if self.proposer is not None:
                in_flight = self._in_flight_decodes() if previous is not None else None
                if in_flight is not None and all(self._verifies_overlapped(r) for r in in_flight):
                    self._propose_past_in_flight(previous.scheduler_output, in_flight)  # nothing waits
                    overlapped = True
                elif previous is None or self._drafts_likely():
                    if previous is not None:  # drafts follow the token in flight: wait for it
                        failed, previous, start = failed + self._handle_in_flight(previous), None, time.perf_counter()
                    self._propose_drafts()
                    proposed = any(r.spec_token_ids for r in self.scheduler.running)
                else:  # no drafts this step (one proposed earlier for a request not scheduled since is dropped)
                    for request in self.scheduler.running:
                        request.spec_token_ids = []
            batch = self._batch_key() if proposed else None
            out = self.scheduler.schedule()
            drafted = [e.request_id for e in out.scheduled_requests if e.spec_token_ids]
            if drafted:
                self._no_room_streak = 0
                if not all(self._verifies_overlapped(self.scheduler.get_request(rid)) for rid in drafted):
                    return self._run_sync(out, failed, start)  # verified before the next is scheduled
            elif proposed and not overlapped:  # drafts found no room (the partial-prefill slots, a bucket's padding):
                self._no_room_streak += 1  # wait for a token in flight again only after 2, 4, ... steps, or once the
                # batch changes
                self._no_room_batch, self._no_room_wait = batch, min(2 ** self._no_room_streak, NO_ROOM_MAX_WAIT)
            if out.is_empty and previous is None:
                if not failed:
                    self._wait_for_grammars()
                return failed
            flight = None if out.is_empty else self._dispatch_async(out, previous)
            outputs = failed + (self._handle_in_flight(previous, out) if previous is not None else [])
            if flight is not None and self._dispatch_sampler_async(flight):
                if self.async_max_tokens is None or out.num_scheduled_tokens <= self.async_max_tokens:
                    self._in_flight = flight
                else:  # a step too large to overlap: handled now, so the next one schedules without placeholders
                    outputs += self._handle_now(flight)
        except BaseException:
            self._abandon_in_flight()
            raise
        return outputs

    def _dispatch_async(self, out: SchedulerOutput, previous: _InFlightStep | None) -> _InFlightStep | None:
        """Dispatch the step's forward; None (the error deferred to the next step()) if that fails."""
        now, requests = time.time(), {}
        for entry in out.scheduled_requests:
            metrics = self._child_to_parent[entry.request_id][0].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
            requests[entry.request_id] = self.scheduler.get_request(entry.request_id)
        try:
            pending = self.runner.dispatch(out, None if previous is None else previous.pending)
        except Exception as err:
            self._deferred_error = err
            return None
        return _InFlightStep(out, pending, requests, time.perf_counter())

    def _dispatch_sampler_async(self, flight: _InFlightStep) -> bool:
        """Dispatch the step's sampler; False (the error deferred to the next step()) if that fails."""
        entries = flight.scheduler_output.scheduled_requests
        try:
            self.runner.dispatch_sample(flight.pending, functools.partial(self._grammar_bitmask, entries))
        except Exception as err:
            self._deferred_error = err
            return False
        return True

    def _handle_now(self, flight: _InFlightStep) -> list[RequestOutput]:
        """`_handle_in_flight` for the step just dispatched; a failure is raised by the next step(), so the
        outputs already made this call (the previous step's) are still returned."""
        try:
            return self._handle_in_flight(flight)
        except Exception as err:
            self._deferred_error = err
            return []

    def _handle_in_flight(self, flight: _InFlightStep, following: SchedulerOutput | None = None) -> list[RequestOutput]:
        """Bring a dispatched step's tokens to the host and apply them, as `step` does, to the requests
        still live: the same Request objects it scheduled (one finished or aborted since is skipped, even
        if a new request took its id). `following`: the step dispatched after it, if any (`_note_redrafts`)."""
        result = flight.pending.result()
        live = {rid for rid, request in flight.requests.items()
                if request is not None and self.scheduler.get_request(rid) is request}
        for rid, chunk in result.prompt_logprobs.items():
            if rid in live:
                self._record_prompt_logprobs(*self._child_to_parent[rid], chunk)
        stops, touched, sampled, redrafted, wrong = {}, {}, {}, {}, set()
        for rid in result.req_ids:
            if rid not in live:
                continue
            parent, child = self._child_to_parent[rid]
            sampled[rid], stops[rid] = self._emit(child, result, result.token_rows(rid))
            touched.setdefault(parent.request_id, (parent, set()))[1].add(child.index)
            request = child.request  # the next step's drafts (in flight) were proposed on a guess of these tokens
            if request.spec_redrafts is not None:
                redrafted[rid] = request.spec_redrafts  # this step's drafts, as the device proposed them again
            if request.spec_guess is not None and tuple(sampled[rid]) != request.spec_guess:
                wrong.add(rid)
            request.spec_guess, request.spec_redrafts = None, None
        out = flight.scheduler_output
        entries = tuple(e for e in out.scheduled_requests if e.request_id in live)
        if self.spec_decoding_stats is not None:
            self._observe_drafts(entries, result, redrafted)
        self.scheduler.update_from_output(dataclasses.replace(out, scheduled_requests=entries), sampled, stops)
        if wrong and following is not None:
            self._note_redrafts(following, wrong)
        outputs = self._outputs(touched)
        # overlapped: the time between steps; not for a step whose requests all ended before it was handled (the
        # slot wasted after a stop, left in flight while the engine idled: its time spans the idle gap)
        self._observe_step(out, max(flight.dispatched_at, self._last_handled), timed=bool(entries))
        return outputs

    def _note_redrafts(self, following: SchedulerOutput, wrong: set[str]) -> None:
        """The drafts the device fed in `following` (in flight) for the requests in `wrong`, whose guess of the
        step just handled proved wrong: proposed again from its real outcome (`model_runner.redraft_in_flight`,
        this lookup on the device; -1 where it found none), kept in Request.spec_redrafts for the next guess and
        for the policy."""
        for entry in following.scheduled_requests:
            request = self.scheduler.get_request(entry.request_id)
            if entry.request_id in wrong and entry.spec_guess is not None and request is not None:
                d = len(entry.spec_token_ids)
                drafts = self._device_lookup.continuation(request.all_token_ids, d)
                request.spec_redrafts = drafts + [-1] * (d - len(drafts))
                if entry.spec_guess == () and not drafts:  # blank drafts that found nothing
                    request.spec_blanks_left -= 1

    def _outputs(self, touched: dict[str, tuple[_Parent, set[int]]]) -> list[RequestOutput]:
        """The outputs of the parents whose children got tokens this step (their token times recorded)."""
        now = time.time()
        outputs = []
        for parent, fresh in touched.values():
            _record_token_time(parent.metrics, now)
            output = self._make_output(parent, fresh)
            if output is not None:
                outputs.append(output)
        return outputs

    def _raise_deferred_error(self) -> None:
        if self._deferred_error is not None:
            err, self._deferred_error = self._deferred_error, None
            self._abandon_in_flight()
            raise err

    def _abandon_in_flight(self) -> None:
        """After a failed step: forget the step in flight. Its tokens are lost: running requests that wait
        for them stay unscheduled until the caller aborts them (as after a failed synchronous step); a
        preempted one just recomputes, so its placeholders are dropped, the token's and those of the drafts the
        step verified (else it would block the queue, or be resumed past its known tokens)."""
        self._in_flight = None
        for request in self.scheduler.waiting:
            request.num_output_placeholders = request.num_draft_placeholders = 0

    def _propose_drafts(self) -> None:
        """Speculative decoding: n-gram drafts for every decoding request (under a grammar, `_grammar_drafts`;
        none while more requests are enqueued than speculative_config.disable_by_batch_size)."""
        disabled = self._drafting_disabled()
        decoding = self.scheduler.decoding_requests()
        for request in decoding:
            request.spec_num_forced, request.spec_guess, request.spec_redrafts = 0, None, None  # nothing in flight
            room = max_drafts_for(request.num_tokens, request.num_output_tokens, request.max_tokens,
                                  request.max_model_len)
            if room < 1 or disabled:
                request.spec_token_ids = []
                continue
            matcher = self._child_to_parent[request.request_id][1].matcher
            request.spec_token_ids = self.proposer.propose(request.all_token_ids, room) if matcher is None else \
                self._grammar_drafts(request, matcher, room)
        if self.draft_policy is not None:
            self.draft_policy.trim(decoding)

    def _verifies_overlapped(self, request: Request) -> bool:
        """Whether the request's verification steps may overlap the next step (async scheduling, with
        EngineArgs.overlap_verification): its next step's tokens then depend on the outcome only through what the
        device moves (`fill_in_flight`: the token fed, the positions; `steps_moved_back`: a random row's key) or
        counts (`outputs_in_flight`: penalties). Rows without min_tokens bans or a grammar: a grammar's mask and
        min_tokens' bans follow the tokens in flight on the host."""
        return self.overlap_verification and request.num_output_tokens >= request.sampling_params.min_tokens and \
            self._child_to_parent[request.request_id][1].matcher is None

    def _in_flight_decodes(self) -> list[Request]:
        """Running requests whose next token (and drafts' outcome) is in flight: one step, fed their last token."""
        return [r for r in self.scheduler.running if r.num_output_placeholders == 1 and
                r.num_computed_tokens == r.num_tokens + r.num_draft_placeholders]

    def _propose_past_in_flight(self, in_flight: SchedulerOutput, waiting: Sequence[Request]) -> None:
        """Speculative decoding with a step in flight (`in_flight`) whose requests `waiting` for its tokens
        (`_in_flight_decodes`) all verify overlapped (`_verifies_overlapped`): drafts for every decoding request
        that may have them, those in flight guessing that step's outcome (`NgramProposer.propose_past`, its guess
        kept to check when the outcome arrives; room as if all its drafts were accepted), the others from their
        tokens; the adaptive policy trims them. Nothing waits for the device."""
        disabled = self._drafting_disabled()
        fed = {e.request_id: e.spec_token_ids for e in in_flight.scheduled_requests}
        decoding, waiting_for = [], {id(r) for r in waiting}
        for request in self.scheduler.running:
            request.spec_token_ids, request.spec_num_forced, request.spec_guess = [], 0, None
            known = not request.num_output_placeholders and request.num_tokens - request.num_computed_tokens == 1
            if id(request) not in waiting_for and not known:
                continue  # prefilling, or two steps in flight
            decoding.append(request)
            ahead = 0 if known else request.num_draft_placeholders + 1  # in flight, if all its drafts are accepted
            room = max_drafts_for(request.num_tokens + ahead, request.num_output_tokens + ahead, request.max_tokens,
                                  request.max_model_len)
            if disabled or room < 1 or not self._verifies_overlapped(request):
                continue
            if known:
                request.spec_token_ids = self.proposer.propose(request.all_token_ids, room)
                continue
            fed_now = fed.get(request.request_id, ()) if request.spec_redrafts is None else request.spec_redrafts
            drafts, guess = self.proposer.propose_past(request.all_token_ids, fed_now, room)
            request.spec_token_ids, request.spec_guess = drafts, (guess or None) if drafts else None
            if not drafts and request.spec_blanks_left > 0 and self.runner_config.prompt_lookup is not None:
                request.spec_token_ids = [BLANK_DRAFT_TOKEN] * min(room, self.runner_config.num_speculative_tokens)
                request.spec_guess = ()  # no guess: the device proposes them whatever the outcome
        if self.draft_policy is not None:
            self.draft_policy.trim(decoding)

    def _drafting_disabled(self) -> bool:
        """speculative_config.disable_by_batch_size: more requests enqueued than it allows draft nothing."""
        limit = self.args.speculative_config.disable_by_batch_size
        return limit is not None and self.scheduler.num_running + self.scheduler.num_waiting > limit

    def _drafts_likely(self) -> bool:
        """Async scheduling, a step in flight, some request in it not verifying overlapped (`_verifies_overlapped`):
        whether drafts would likely follow a request's token in flight,
        guessed from the tokens known (the n-gram proposal after that token; under a grammar, also the tokens
        it forces after it), those the adaptive policy would keep. Then that step is waited for, not overlapped.
        While drafts recently found no room in this batch, False (counting down `_no_room_wait`)."""
        if self._drafting_disabled():
            return False
        if self._no_room_wait and self._no_room_batch == self._batch_key():
            self._no_room_wait -= 1
            return False
        in_flight = [r for r in self.scheduler.running
                     if r.num_output_placeholders == 1 and r.num_computed_tokens == r.num_tokens]
        guesses = []  # (request, its guessed drafts after the token in flight)
        for request in in_flight:
            room = max_drafts_for(request.num_tokens + 1, request.num_output_tokens + 1, request.max_tokens,
                                  request.max_model_len)
            if room < 1:
                continue
            matcher = self._child_to_parent[request.request_id][1].matcher
            if matcher is not None and len(matcher.forced_tokens()) > 1:
                return True  # forced drafts are always verified
            drafts = self.proposer.propose(request.all_token_ids, room, skip=1)
            if drafts:
                guesses.append((request, drafts))
        if not guesses or self.draft_policy is None:
            return bool(guesses)
        rates = self.draft_policy.position_rates()
        keep = self.draft_policy.plan(len(in_flight), [self.draft_policy.gains(r, len(d), rates) for r, d in guesses],
                                      without_drafts=len(in_flight) - len(guesses))
        return any(keep)

    def _batch_key(self) -> tuple[frozenset[str], int, int]:
        """What decides whether a step has room for drafts: the requests running, those of them decoding, those
        waiting."""
        running = self.scheduler.running
        decoding = sum(r.num_tokens - r.num_computed_tokens <= 1 for r in running)
        return frozenset(r.request_id for r in running), decoding, self.scheduler.num_waiting

    def _grammar_drafts(self, request: Request, matcher: GrammarMatcher, room: int) -> list[int]:
        """A constrained request's drafts: the tokens its grammar forces next (a schema's keys and punctuation,
        which the prompt rarely holds), then the n-gram drafts after them, cut to the leading ones the grammar
        allows (a draft it forbids is never accepted: not worth its row)."""
        room = min(room, self.args.speculative_config.num_speculative_tokens)
        drafts = matcher.forced_tokens()[:room]
        forced = len(drafts)
        if forced < room:
            drafts += self.proposer.propose(request.all_token_ids + drafts, room - forced)
        del drafts[matcher.valid_prefix(drafts):]
        request.spec_num_forced = min(forced, len(drafts))
        return drafts

    def _observe_drafts(self, entries: Sequence[ScheduledRequest], result: ModelRunnerOutput,
                        redrafted: dict[str, list[int]] | None = None) -> None:
        """Count the step's verifications (metrics) and teach the adaptive policy; `redrafted`: the drafts the
        device proposed again in place of an entry's (`_note_redrafts`), of which those it found count."""
        for entry in entries:
            num_accepted = result.num_accepted_drafts.get(entry.request_id)
            if num_accepted is None:  # verified nothing
                continue
            request = self._child_to_parent[entry.request_id][1].request
            if num_accepted:  # a copy runs: blank drafts may follow a break in it (`_propose_past_in_flight`)
                request.spec_blanks_left = BLANK_DRAFT_STEPS
            drafts = (redrafted or {}).get(entry.request_id, entry.spec_token_ids)
            num_drafts = sum(t >= 0 for t in drafts)
            if num_drafts:
                self.spec_decoding_stats.observe(num_drafts, num_accepted)
                if self.draft_policy is not None:
                    self.draft_policy.observe_verification(request, num_drafts, num_accepted,
                                                           min(request.spec_num_forced, num_drafts))

    def _emit(self, child: _Child, result: ModelRunnerOutput,
              rows: Sequence[int]) -> tuple[list[int], StopVerdict | None]:
        """The tokens a request emits this step (its rows' samples, cut after the first that ends it) and
        the last one's verdict (see `_stop_verdict`)."""
        tokens, verdict, sampled = [], None, result.row_values[0]
        for ahead, row in enumerate(rows):
            tokens.append(sampled[row])
            verdict = self._stop_verdict(child, result, row, ahead)
            if verdict is not None:
                break
        return tokens, verdict

    def _stop_verdict(self, child: _Child, result: ModelRunnerOutput, row: int, ahead: int = 0) -> StopVerdict | None:
        """Record one sampled token (logprobs, text) and decide whether it ends the request.

        None: it goes on; else (status, stop_reason) for Scheduler.update_from_output. Token-level
        stops come from Request.check_stop, stop strings from the detokenizer (they win over length).
        ahead: the step's tokens before this one (speculative decoding), not appended yet.
        """
        request, (sampled, logprobs, finite) = child.request, result.row_values
        if not finite[row]:  # NaN/inf logits fail only their own request; the token is garbage
            return RequestStatus.FINISHED_ERROR, None
        token_id = sampled[row]
        verdict = request.check_stop(token_id, ahead)
        # A completed grammar stops after its last token, whose text is kept (unlike an EOS / stop id's).
        grammar_verdict = self._grammar_verdict(child, token_id) if verdict is None else None
        if child.logprobs is not None:
            child.logprobs.append(self._logprob_entry(result, row, token_id, request.sampling_params.logprobs))
        child.cumulative_logprob += logprobs[row]
        if child.detokenizer is not None:
            stop_terminated = verdict is not None and verdict[0] is RequestStatus.FINISHED_STOPPED
            stop_str = child.detokenizer.update([token_id], stop_terminated=stop_terminated)
            if stop_str is None and (verdict or grammar_verdict) is not None:
                stop_str = child.detokenizer.flush()
            if stop_str is not None:
                return RequestStatus.FINISHED_STOPPED, stop_str
        return verdict or grammar_verdict

    def _record_prompt_logprobs(self, parent: _Parent, child: _Child, chunk: PromptLogprobs) -> None:
        """Store one step's prompt log-probs by position (a recomputed chunk, after preemption or of another
        child, overwrites): every child computes its whole prompt, so the first to sample has them all."""
        k = parent.params.prompt_logprobs
        for j, lp in enumerate(chunk.token_logprobs):
            position = chunk.first_index + j
            token_id = parent.prompt_token_ids[position]
            entry = {int(t): Logprob(float(chunk.top_logprobs[j, r]), r + 1, self._decode_token(int(t)))
                     for r, t in enumerate(chunk.top_token_ids[j, :k])}
            if token_id not in entry:
                entry[token_id] = Logprob(float(lp), int(chunk.ranks[j]), self._decode_token(token_id))
            parent.prompt_logprobs[position] = entry

    def _logprob_entry(self, result: ModelRunnerOutput, row: int, token_id: int, k: int) -> dict[int, Logprob]:
        top_ids = result.top_token_ids[row]
        entry = {int(t): Logprob(float(result.top_logprobs[row, r]), r + 1, self._decode_token(int(t)))
                 for r, t in enumerate(top_ids[:k])}
        if token_id not in entry:
            ranks = np.nonzero(top_ids == token_id)[0]
            rank = int(ranks[0]) + 1 if len(ranks) else None
            entry[token_id] = Logprob(float(result.logprobs[row]), rank, self._decode_token(token_id))
        return entry

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, parent: _Parent, fresh: set[int]) -> RequestOutput | None:
        """The parent's output after a step in which its children `fresh` got a token (None: nothing due)."""
        kind, children, metrics = parent.params.output_kind, parent.children, parent.metrics
        finished, num_generated, num_cached = True, 0, 0
        for child in children:  # one plain loop: this runs for every request every step
            request = child.request
            finished = finished and request.is_finished
            num_generated += request.num_output_tokens
            num_cached = max(num_cached, request.num_cached_tokens)
        metrics.num_generation_tokens, metrics.num_cached_tokens = num_generated, num_cached
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        outputs = [_completion(c, delta) for c in children if not delta or c.index in fresh]
        if finished:
            metrics.finished_time = time.time()
            self._parents.pop(parent.request_id, None)
            for child in parent.children:
                self._child_to_parent.pop(child.request.request_id, None)
        prompt_logprobs = parent.prompt_logprobs
        if delta and parent.prompt_logprobs_sent:
            prompt_logprobs = None
        parent.prompt_logprobs_sent = True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             metrics, metrics.num_cached_tokens, prompt_logprobs)

    # ---- stats ------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        pool = self.scheduler.pool
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": pool.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": pool.prefix_cache_queries,
            "prefix_cache_hits": pool.prefix_cache_hits,
            **({} if self.spec_decoding_stats is None else self.spec_decoding_stats.as_stats()),
        }


def _as_ids(ids) -> list[int]:
    try:
        return [int(i) for i in ids]
    except (TypeError, ValueError):
        raise InvalidRequestError("prompt token ids must be integers", "prompt") from None


def _record_token_time(metrics: RequestMetrics, now: float) -> None:
    if metrics.first_token_time is None:
        metrics.first_token_time = now
    else:
        metrics.inter_token_latencies.append(now - metrics.last_token_time)
    metrics.last_token_time = now


def _completion(child: _Child, delta: bool) -> CompletionOutput:
    """One child's CompletionOutput: everything so far, or (delta) only what is new since the last one."""
    request = child.request
    finished = request.is_finished
    start = child.num_sent_tokens if delta else 0
    token_ids = request.output_token_ids[start:]  # a copy of the new part only, in DELTA
    logprobs = None if child.logprobs is None else child.logprobs[start:]
    child.num_sent_tokens = request.num_output_tokens
    text = "" if child.detokenizer is None else child.detokenizer.get_next_output_text(finished, delta=delta)
    return CompletionOutput(index=child.index, text=text, token_ids=token_ids,
                            cumulative_logprob=child.cumulative_logprob, logprobs=logprobs,
                            finish_reason=request.finish_reason, stop_reason=request.stop_reason)


__all__ = ["EngineArgs", "LLMEngine", "RequestStatus"]

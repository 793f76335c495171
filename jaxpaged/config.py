"""The engine's configuration: `EngineArgs` as given, and `EngineConfig`, every "auto" in them resolved.

`EngineArgs` holds vLLM's engine arguments, frozen and validated; None or "auto" leaves a choice to the model and
the machine. `resolve_engine_config(args, model, mesh)` makes every such choice, once, at the engine's
construction: the context length and batch limits, the KV pool's size, the step buckets (`RunnerConfig`), the
scheduler's limits (`SchedulerConfig`), async scheduling and overlapped verification; the machine-dependent
defaults are the constants below. The step's device-level choices (attention backend, KV cache dtype, fused
sampler, compiler options) are the runner's: `RunnerConfig` resolves them from the backend it runs on.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.sharding import Mesh

from jaxpaged.core.scheduler import SchedulerConfig
from jaxpaged.models.loader import DEFAULT_MODEL, LoadedModel
from jaxpaged.models.model_cache import default_cache_dir
from jaxpaged.spec_decode.ngram import SpeculativeConfig
from jaxpaged.worker import parallel
from jaxpaged.worker.runner_config import (
    RunnerConfig,
    check_batch_invariant,
    check_step_choices,
    packs_weights,
    resolve_kv_cache_dtype,
)
from jaxpaged.worker.step_input import kv_bytes_per_page
from jaxpaged.worker.weight_layout import resolve_weight_layout

_CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on CPU when no size is given
_CPU_DEFAULT_MAX_MODEL_LEN = 2048  # keeps the CPU warm-up (one compile per step shape) short
# On CPU async scheduling keeps only steps of at most this many tokens in flight: there the host's work for
# the next step runs beside the step's own threads on the same cores, which pays while a step is bound by
# reading the weights (a few rows) and costs once its matmuls are compute-bound (docs/performance.md,
# "Which knobs matter")
CPU_ASYNC_MAX_TOKENS = 8
# Speculative decoding on GPU: steps of up to this many tokens cost about the same (bf16 weights on an H200:
# ~200 FLOP a byte before the matmuls turn compute-bound), so drafts beside a request without drafts may fill a
# step up to it (SchedulerConfig.memory_bound_tokens; an estimate from the roofline, not yet measured). On CPU
# every row adds compute: 0.
GPU_MEMORY_BOUND_TOKENS = 128


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
    # the KV pool's dtype (runner_config.resolve_kv_cache_dtype); "fp8"/"fp8_e4m3": e4m3 pages with per-head scales
    kv_cache_dtype: str = "auto"
    # vLLM's `quantization`: "fp8", "int8" or "w8a8" (what each runs: runner_config.QUANTIZATIONS,
    # docs/quantization.md); None: the checkpoint's (an FP8 checkpoint: "fp8", `resolve_quantization`)
    quantization: str | None = None
    # The step's weight layout: "auto", "stacked" or "per_layer" (which and why: jaxpaged/worker/weight_layout.py);
    # fuse_projections: q/k/v and gate/up one gemm each
    weight_layout: str = "auto"
    fuse_projections: bool = True
    # XLA:GPU command buffers (CUDA graphs) over the step: "auto", "xla", "off" or "full" (runner_config.GPU_COMMAND_BUFFERS)
    command_buffers: str = "auto"
    # The sampler inside the step's jitted program, one executable call per step (runner_config.FUSE_SAMPLER):
    # "auto" (on with a GPU backend, off on CPU, where it measured slower: docs/performance.md), "on" or "off"
    fuse_sampler: str = "auto"
    tensor_parallel_size: int = 1  # devices in the "tp" mesh (see jaxpaged/worker/parallel.py)
    distributed_coordinator: str | None = None  # multi-host: "host:port" of process 0
    num_processes: int = 1  # multi-host: processes in jax.distributed
    process_id: int = 0  # multi-host: this process (0 schedules, the others `follow`)
    chat_template: str | None = None
    generation_config: str | None = None  # path to a generation_config.json
    compilation_cache_dir: str | None = dataclasses.field(default_factory=functools.partial(default_cache_dir, "xla"))
    # programs compiling faster than this are not persisted (JAX's default, 1 s, leaves most step shapes of a
    # small model out of the cache, so every start compiled them again); 0: persist every program
    compilation_cache_min_compile_secs: float = 0.0
    # a GGUF model's dequantised params and tokenizer, cached for the next start (None: no cache)
    model_cache_dir: str | None = dataclasses.field(default_factory=functools.partial(default_cache_dir, "models"))
    warmup: bool = True
    # vLLM's speculative_config: a SpeculativeConfig, or its dict / JSON text (converted here); None: off.
    # Only the n-gram (prompt lookup) method: {"method": "ngram", "num_speculative_tokens": k, ...}
    speculative_config: SpeculativeConfig | None = None

    # vLLM v1's async scheduling: dispatch step N+1 before step N's tokens reach the host (jaxpaged/engine/
    # llm_engine.py); None: on (one process; with speculative decoding, steps that verify drafts run synchronously)
    async_scheduling: bool | None = None
    # Which steps async scheduling keeps in flight: those feeding at most this many tokens; a larger step is
    # handled before the next one is scheduled (the synchronous order). None: every step with a GPU; on CPU,
    # where the host's work shares the cores with the step's matmuls, CPU_ASYNC_MAX_TOKENS
    async_scheduling_max_tokens: int | None = None
    # Speculative decoding under async scheduling: greedy requests' verification steps overlap the next step
    # (jaxpaged/engine/drafting.py). None: on with a GPU, where a synchronous step exposes the host's whole work
    # (H200: a verification step 7.3 ms against 4.4 ms overlapped); off on CPU, where the host time is a few % of a
    # step: SmolLM2 at batch 1 gained nothing from it (docs/performance.md, "Which knobs matter")
    overlap_verification: bool | None = None
    # Batch-invariant mode (docs/rl.md): a request's logits and log-probs the same to the bit whatever else is in
    # the batch, however its prompt was chunked, whether its prefix came from the cache, whichever bucket ran it
    # (RunnerConfig.batch_invariant); on CPU it needs float32 weights on the native kernels
    batch_invariant: bool = False

    def __post_init__(self):
        check_step_choices(self)  # before the model loads
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
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be a positive integer")
        _ = self.distributed  # validates the multi-host fields
        one_device_only = [  # (chosen, what, why)
            (self.speculative_config is not None, "speculative_config", ""),
            (self.kv_cache_dtype.startswith("fp8"), f"kv_cache_dtype={self.kv_cache_dtype!r}", ": scales not sharded"),
            (self.quantization is not None, f"quantization={self.quantization!r}", ": it quantises on one device"),
            (self.fuse_sampler == "on", "fuse_sampler='on'", ": leave it 'auto' (off there) or 'off'")]
        for chosen, what, why in one_device_only:
            if chosen and (self.tensor_parallel_size > 1 or self.num_processes > 1):
                raise ValueError(f"{what} is not supported with tensor parallelism or several processes yet{why}")
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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What an engine runs with: its `EngineArgs` with every "auto" resolved for its model and machine."""

    runner: RunnerConfig
    scheduler: SchedulerConfig
    async_scheduling: bool  # the overlapped loop (one process only: followers take each step's tokens from the host)
    async_max_tokens: int | None  # async scheduling keeps steps of at most this many tokens in flight (None: all)
    overlap_verification: bool  # verification steps overlap the next step (speculative decoding)


def make_mesh(args: EngineArgs) -> Mesh | None:
    """None for one device in one process; else the "tp" mesh over the global devices."""
    tp, procs = args.tensor_parallel_size, args.num_processes
    if tp == 1 and procs == 1:
        return None
    if procs > 1 and tp != jax.device_count():
        raise ValueError(f"with num_processes={procs}, tensor_parallel_size={tp} must equal the global "
                         f"device count {jax.device_count()} (every process serves a shard)")
    return parallel.make_mesh(tp)


def weight_layout_for(args: EngineArgs, model: LoadedModel, mesh: Mesh | None):
    """The step's weight layout (jaxpaged/worker/weight_layout.py) for this model and backend."""
    return resolve_weight_layout(args.weight_layout, args.fuse_projections, jax.default_backend(),
                                 packed=_packs_weights(args, model, mesh))


def resolve_engine_config(args: EngineArgs, model: LoadedModel, mesh: Mesh | None) -> EngineConfig:
    """Every choice `args` leaves open, made for `model` (its weights already in their layout: the KV pool is
    sized from the memory left) on this machine."""
    on_gpu = jax.default_backend() == "gpu"
    if args.batch_invariant:
        check_batch_invariant(_packs_weights(args, model, mesh), jax.default_backend(),
                              quantization=resolve_quantization(args, model, mesh), sharded=mesh is not None)
    overlap = on_gpu if args.overlap_verification is None else args.overlap_verification
    runner = _runner_config(args, model, mesh, on_gpu, overlap)
    config = model.config
    scheduler = SchedulerConfig(
        async_scheduling=args.async_scheduling is not False and args.num_processes == 1,
        num_pages=runner.num_pages, page_size=args.block_size, max_num_seqs=runner.max_num_seqs,
        max_num_batched_tokens=runner.max_num_batched_tokens, max_model_len=runner.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, max_num_partial_prefills=runner.max_num_partial_prefills,
        token_buckets=runner.token_buckets, memory_bound_tokens=GPU_MEMORY_BOUND_TOKENS if on_gpu else 0,
        sliding_window=config.sliding_window if config.all_layers_windowed else None)
    max_tokens = args.async_scheduling_max_tokens
    if max_tokens is None and not on_gpu:
        max_tokens = CPU_ASYNC_MAX_TOKENS
    return EngineConfig(runner, scheduler, scheduler.async_scheduling, max_tokens, overlap)


def resolve_quantization(args: EngineArgs, model: LoadedModel, mesh: Mesh | None) -> str | None:
    """The weight dots' quantisation: args.quantization, else "fp8" for an FP8 checkpoint (loaded dequantised,
    served as FP8 again), else None. An FP8 checkpoint on a mesh is refused (quantisation runs on one device)."""
    if model.quantization is not None and mesh is not None:
        raise ValueError(f"{model.source} is an FP8 checkpoint ({model.quantization.format}); FP8 weights are not "
                         "supported with tensor parallelism or several processes yet: serve it on one device")
    if args.quantization is None and model.quantization is not None:
        return "fp8"
    return args.quantization


def _packs_weights(args: EngineArgs, model: LoadedModel, mesh: Mesh | None) -> bool:
    """Whether the runner will hold the weight dots' weights packed (`runner_config.packs_weights`)."""
    return packs_weights(args.attention_backend, model.dtype, sharded=mesh is not None,
                         quantization=resolve_quantization(args, model, mesh))


def _runner_config(args: EngineArgs, model: LoadedModel, mesh: Mesh | None, on_gpu: bool,
                   overlap: bool) -> RunnerConfig:
    config = model.config
    max_model_len = args.max_model_len or (config.max_position_embeddings if on_gpu else
                                           min(config.max_position_embeddings, _CPU_DEFAULT_MAX_MODEL_LEN))
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length "
                         f"{config.max_position_embeddings}")
    max_num_seqs = args.max_num_seqs or (256 if on_gpu else 64)
    max_tokens = args.max_num_batched_tokens or max(8192 if on_gpu else 512, max_num_seqs)
    num_pages = args.num_pages or _pages_from_memory(args, model, on_gpu)
    needed = math.ceil(max_model_len / args.block_size) + 1
    if num_pages < needed:
        raise ValueError(f"the KV pool ({num_pages} pages of {args.block_size} tokens) cannot hold one "
                         f"sequence of max_model_len={max_model_len}; give more memory or a smaller "
                         "max_model_len")
    spec = args.speculative_config
    return RunnerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                        max_model_len=max_model_len, page_size=args.block_size, num_pages=num_pages,
                        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
                        quantization=resolve_quantization(args, model, mesh), batch_invariant=args.batch_invariant,
                        weight_layout=args.weight_layout, fuse_projections=args.fuse_projections,
                        command_buffers=args.command_buffers, fuse_sampler=args.fuse_sampler,
                        # CPU step time grows with padded tokens (all of it with XLA's dots, the non-dot part
                        # with packed weights): decode batches of 1-8 get their own shapes, and where XLA's dots
                        # compute every padding row, x1.5 buckets too (RunnerConfig.mid_token_buckets_from)
                        min_token_bucket=16 if on_gpu else 1,
                        mid_token_buckets_from=None if on_gpu or _packs_weights(args, model, mesh) else 32,
                        # and one request alone gets S = 1: its LM head is one row, not 4 (3 of them padding)
                        min_seq_bucket=4 if on_gpu else 1,
                        max_num_partial_prefills=min(args.max_num_partial_prefills or (16 if on_gpu else 4),
                                                     max_num_seqs),
                        num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
                        # the drafts of a request in flight are proposed on the device: the n-gram bounds, when
                        # verifications overlap the next step
                        prompt_lookup=None if spec is None or not overlap else
                        (spec.prompt_lookup_min, spec.prompt_lookup_max))


def _pages_from_memory(args: EngineArgs, model: LoadedModel, on_gpu: bool) -> int:
    # Each device holds 1/tp of every page (its KV heads); the budget is per device.
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model.dtype, jax.default_backend())
    per_page = kv_bytes_per_page(model.config, args.block_size, kv_dtype) // args.tensor_parallel_size
    budget = args.kv_cache_memory
    if budget is None and on_gpu:
        stats = jax.local_devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit", 0)
        budget = int(limit * args.gpu_memory_utilization) - stats.get("bytes_in_use", 0)
    if budget is None:
        budget = _CPU_KV_CACHE_BYTES
    return max(2, budget // per_page)

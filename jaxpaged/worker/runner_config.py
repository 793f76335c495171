"""RunnerConfig: the model runner's frozen configuration and every choice it resolves.

The step's buckets (token count T, sequence slots S, page-table width P, verification and draft shapes), the
attention backend, the KV cache dtype, the fused sampler, quantized CPU dots and the XLA compiler options per
device and step shape: each "auto" is resolved here, once, from the config and the backend.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.params import WeightLayout
from jaxpaged.worker.invariant_dots import check_gpu_batch_invariant
from jaxpaged.worker.weight_layout import check_weight_layout, resolve_weight_layout
from pallas_kernels import cpu_attention, cpu_build, cpu_matmul, cpu_rope, cpu_sampler
from pallas_kernels.cpu_attention import load_cpu_attention

if TYPE_CHECKING:  # config.py imports this module
    from jaxpaged.config import EngineArgs

logger = logging.getLogger(__name__)

_MAX_COMPILE_THREADS = 8  # warm-up compiles its programs in parallel on up to this many threads (half the cores)
_WARMUP_BARRIER_SECONDS = 1800.0  # multi-host: how long a process waits for the others to finish warming up
ATTENTION_BACKENDS = ("auto", "reference", "xla", "cpu", "pallas")
FUSE_SAMPLER = ("auto", "on", "off")  # RunnerConfig.fuse_sampler: the sampler inside the step program
# "fp8" and "fp8_e4m3" (vLLM's names): pages of float8_e4m3fn with a scale per layer and KV head
# (pallas_kernels/kv_quant.py, jaxpaged/worker/kv_scales.py): half a bf16 pool's bytes per token
KV_CACHE_DTYPES = {"auto": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32,
                   "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn}
# CUDA compute capability of the first FP8 hardware (Ada; Hopper is 9.0): Triton converts e4m3 there (the fp8 KV
# pool under the Pallas kernel), and its tensor cores run FP8 gemms (quantization "fp8")
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)


def check_choice(name: str, value, choices, note: str = "") -> None:
    """ValueError naming `name` and its `choices` where `value` is not one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {tuple(choices)}{note}")


def check_step_choices(c: EngineArgs | RunnerConfig) -> None:
    """The step's choices that EngineArgs and RunnerConfig both take, by the same names, validated alike
    (EngineArgs: before the model loads)."""
    if not isinstance(c.batch_invariant, bool):
        raise ValueError(f"batch_invariant={c.batch_invariant!r} must be a bool")
    if c.batch_invariant and not c.fuse_projections:  # the unfused projections are XLA's einsums
        raise ValueError("batch_invariant=True runs the fused projections (wqkv, w_gate_up) on the step's "
                         "row-invariant matmul: set fuse_projections=True")
    if c.quantization == "fp8" and not c.fuse_projections:
        raise ValueError("quantization='fp8' quantises the fused projections (wqkv, w_gate_up): set "
                         "fuse_projections=True")
    if c.batch_invariant and c.quantization == "int8":
        raise ValueError("batch_invariant=True does not take quantization='int8': its product dequantises whole "
                         "chunks of weights from 19 rows on and widens in registers below, two roundings (its "
                         "rounding depends on the step's row count); use 'w8a8' (the same bits at any row count) "
                         "or float32 weights")
    check_choice("kv_cache_dtype", c.kv_cache_dtype, KV_CACHE_DTYPES)
    if c.quantization is not None:
        check_choice("quantization", c.quantization, QUANTIZATIONS, " or None (the checkpoint's weights as loaded)")
    check_weight_layout(c.weight_layout)
    check_choice("command_buffers", c.command_buffers, ("auto", *GPU_COMMAND_BUFFERS))
    check_choice("fuse_sampler", c.fuse_sampler, FUSE_SAMPLER)


def check_fp8_kv_support(kv_dtype, backend: str, sharded: bool = False, device=None) -> None:
    """ValueError at start-up where an fp8 pool would not be read right: tensor parallelism (its scales are
    not sharded yet) and the Pallas kernel on a GPU older than FP8_MIN_COMPUTE_CAPABILITY. Every attention
    backend reads fp8 pages otherwise (reference, XLA, native CPU, Pallas). device: the first local device."""
    if np.dtype(kv_dtype) != np.dtype(jnp.float8_e4m3fn):
        return
    if sharded:
        raise ValueError("kv_cache_dtype='fp8' is not supported with tensor parallelism yet: use a float "
                         "kv_cache_dtype or tensor_parallel_size=1")
    device = device or jax.local_devices()[0]
    capability = compute_capability(device)
    if backend == "pallas" and device.platform == "gpu" and capability is not None and \
            capability < FP8_MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"kv_cache_dtype='fp8': the Pallas attention kernel reads e4m3 pages on GPUs of compute "
                         f"capability >= 8.9 (Ada, Hopper); this {device.device_kind} is "
                         f"{device.compute_capability}. Use a float kv_cache_dtype or attention_backend='xla'")


def compute_capability(device) -> tuple[int, int] | None:
    """A CUDA device's compute capability ("9.0" on an H100/H200: (9, 0)); None where it names none (CPU, ROCm)."""
    try:
        major, minor = str(device.compute_capability).split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return None


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype, platform: str) -> np.dtype:
    """The KV pool's dtype. "auto" is the model's, except bf16 on CPU, which gets f32.

    XLA:CPU has no bf16 scatter: it converts the whole pool to f32 and back around
    each layer's KV write, so a decode step costs two passes over the pool per layer
    (over 100x an f32 pool's step). The CPU attention
    path computes in f32 anyway; the price is half as many pages for the same bytes.
    "fp8"/"fp8_e4m3": float8_e4m3fn on every platform (written quantized, read by every attention path).
    """
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    if kv_cache_dtype != "auto":
        return np.dtype(KV_CACHE_DTYPES[kv_cache_dtype])
    if np.dtype(model_dtype) == np.dtype(jnp.bfloat16) and platform == "cpu":
        return np.dtype(np.float32)
    return np.dtype(model_dtype)


# XLA:CPU library fusions for dots (YNNPACK, a dot with its elementwise neighbours). jaxlib 0.10.2's
# default already sends each dot and reduction to YNNPACK one by one; this setting fused the step's
# dots with their neighbours and was the fastest set measured.
# 512-bit vectors where the CPU has them (XLA:CPU prefers 256): a one-row decode's matrix-vector products
# are XLA's own reductions, not library calls, and ran ~10% faster (batch-1 step 17.4 -> 15.6 ms with
# per-layer weights, SmolLM2 f32, AVX-512 machine; no change at batch 32 or in prefill).
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
                        "xla_cpu_prefer_vector_width": "512"}
# Steps of at most CPU_SMALL_STEP_TOKENS tokens (a few decodes, a speculative verification) compile without
# YNNPACK: XLA's own dots ran a 2-16-row matmul stack 5-30% faster than YNNPACK's, which wins from ~32 rows
# on.
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
    return dict(options) if _xla_accepts("XLA:CPU", tuple(sorted(options.items()))) else {}


@functools.cache
def _xla_accepts(xla: str, options: tuple[tuple[str, str], ...]) -> bool:
    """Whether this jaxlib compiles a tiny program with `options` (once per option set, not per step shape); where
    it does not (an XLA that does not know an option or a value), a warning naming `xla`."""
    try:
        x = np.ones((2, 2), np.float32)
        jax.jit(lambda a: a @ a, compiler_options=dict(options)).lower(x).compile()
    except Exception as err:  # pylint: disable=broad-except  (XLA raises its own errors)
        logger.warning("%s does not take %s (%s); compiling with its defaults", xla, dict(options), err)
        return False
    return True


# XLA:GPU command buffers (CUDA graphs): the kinds of work XLA records into graphs that replay with one
# launch (`xla_gpu_enable_command_buffer`). "xla": XLA's own default set; "off": every kernel launched one
# by one (the baseline that shows the launch overhead); "full": also while loops and conditionals, so a
# step's layer loop and attention's branches sit inside graphs too. RunnerConfig.command_buffers picks one;
# benchmarks/gpu_engine.py times the batch-1 forward under each.
GPU_COMMAND_BUFFERS: dict[str, str | None] = {
    "xla": None, "off": "", "full": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}
DEFAULT_GPU_COMMAND_BUFFERS = "full"  # "auto"; no difference measured at batch 1 on an H200 (docs/performance.md)


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
    return options if _xla_accepts("XLA:GPU", tuple(sorted(options.items()))) else {}


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
    batch_invariant: bool = False  # one reduction order per query, whatever the batch (RunnerConfig's)


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


# Quantisation of the weight dots (vLLM's `quantization`; what each runs where, and at what accuracy:
# docs/quantization.md): "fp8" on XLA's dots (FP8 gemms where `fp8_gemm`, else weight-only: jaxpaged/models/fp8.py),
# "int8" and "w8a8" on the native CPU matmul's int8 blocks (pallas_kernels/cpu_matmul.py); w8a8 quantises each dot's
# input too: ~1.7-2.1x int8's speed from 8 rows where AVX-512 VNNI runs it, ~10-20% slower elsewhere
QUANTIZATIONS = ("fp8", "int8", "w8a8")
INT8_DOTS = {"int8": cpu_matmul.matmul_cpu, "w8a8": cpu_matmul.matmul_w8a8}  # each's product over the int8 blocks
FP8_PLATFORMS = ("cpu", "gpu")  # where "fp8" runs (JAX's default backend)


def check_batch_invariant(packed: bool, platform: str, *, quantization: str | None = None,
                          sharded: bool = False) -> None:
    """Batch-invariant mode on a CPU backend needs the weight dots on the native matmul's packed blocks (float32
    weights, one device, the native kernels: `packs_weights`): XLA:CPU's dots block their rows by the step's
    row count, so a row's sums would change with the batch. On a GPU: `invariant_dots.check_gpu_batch_invariant`.
    Raises a ValueError naming what to change."""
    if platform == "cpu" and not packed:
        raise ValueError("batch_invariant=True on CPU needs float32 weights (dtype='float32' or 'auto' for a "
                         "float32 checkpoint), one device and the native CPU kernels (attention_backend 'auto' or "
                         "'cpu', a C++ compiler): XLA's own dots are not batch-invariant")
    if platform == "gpu":
        check_gpu_batch_invariant(quantization, sharded)
    elif platform != "cpu":
        logger.warning("batch_invariant=True on %s: attention runs one tiling for every batch, but the weight "
                       "dots are XLA's, which are not batch-invariant there (docs/rl.md)", platform)


def fp8_gemm(platform: str | None = None) -> bool:
    """Whether quantization "fp8" runs FP8 x FP8 gemms (True: a CUDA GPU of compute capability >= 8.9) or
    weight-only dots (False: CPU, older GPUs) on `platform` (default: JAX's default backend); a ValueError
    where it cannot run at all."""
    platform = platform or jax.default_backend()
    if platform not in FP8_PLATFORMS:
        raise ValueError(f"quantization='fp8' runs on {FP8_PLATFORMS} backends, not {platform!r}")
    if platform != "gpu":
        return False
    capability = compute_capability(jax.local_devices()[0])  # None (ROCm): no FP8 gemm assumed
    return capability is not None and capability >= FP8_MIN_COMPUTE_CAPABILITY


def quantization_summary(quantization: str | None, platform: str | None = None) -> str:
    """What the weight dots run, for the start-up log ("" without quantisation)."""
    if quantization is None:
        return ""
    if quantization != "fp8":
        return f"{quantization} (native CPU matmul, int8 weights)"
    if fp8_gemm(platform):
        return "fp8 (FP8 x FP8 gemms, per-token dynamic activation scales, per-channel weight scales)"
    return "fp8 (weight-only: FP8 weights upcast inside each dot, per-channel scales; no FP8 gemm on this backend)"


def packs_weights(attention_backend: str, dtype, sharded: bool = False, quantization: str | None = None) -> bool:
    """Whether a runner holds the weight dots' weights packed as the native CPU matmul's blocks (float32
    weights on one device, not FP8; `ModelRunner`, `_pack_for_cpu_matmul`). The weight layout follows it: a layer
    scan reads packed weights in place (`resolve_weight_layout`)."""
    return not sharded and quantization != "fp8" and np.dtype(dtype) == np.float32 and \
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
    # T buckets halfway between doublings (48, 96, 192, ...) from this T on; None: doublings only. They cut the
    # padding where XLA's dots compute every padding row (measured: docs/performance.md, "Which knobs matter");
    # the packed weights' dots skip padding rows (docs/kernels.md), so there the doublings alone compile less.
    mid_token_buckets_from: int | None = None
    # Most requests fed more than one token in a step; None: no cap. The scheduler enforces it (the engine
    # builds its SchedulerConfig from this config); attention sizes its prefill tiles for it and trusts it.
    max_num_partial_prefills: int | None = None
    # Speculative decoding: drafts verified per request and step (SpeculativeConfig's k); 0: off
    num_speculative_tokens: int = 0
    # ... and (prompt_lookup_min, prompt_lookup_max) of its n-gram lookup, for the drafts of a request whose step is
    # in flight (async scheduling, overlapped verification) to be proposed on the device (`redraft_in_flight`);
    # None: none are
    prompt_lookup: tuple[int, int] | None = None
    # The choices below are EngineArgs' (jaxpaged/config.py says what each does); here what the runner makes of them.
    weight_layout: str = "auto"  # resolved by `layout` (jaxpaged/worker/weight_layout.py)
    fuse_projections: bool = True
    command_buffers: str = "auto"  # a GPU_COMMAND_BUFFERS key or "auto" (ignored off GPU)
    fuse_sampler: str = "auto"  # `sampler_fused`: the step program samples too (`fused_step`)
    # QUANTIZATIONS or None: "int8" and "w8a8" need the packed weights (`packs_weights`), which the ModelRunner checks
    quantization: str | None = None
    # Attention gets one reduction order per query (ragged_paged_attention's batch_invariant), every CPU step shape
    # XLA's own codegen (`compiler_options`); the weight dots must be row-invariant: the native CPU matmul's blocks,
    # on a GPU the fixed-tile Pallas GEMM (invariant_dots.py; `check_batch_invariant`)
    batch_invariant: bool = False

    def __post_init__(self):
        check_step_choices(self)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
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
        if self.batch_invariant:  # one option set for every T: the small steps' (XLA's own codegen, no YNNPACK)
            num_tokens = 1
        return {**cpu_compiler_options(platform, num_tokens), **gpu_compiler_options(self.command_buffers, platform)}

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.backend, self.max_num_partial_prefills, uses_native_matmul(self.backend),
                               self.batch_invariant)

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    @functools.cached_property  # read by every step's `bucket_for`: made once (a frozen config's values)
    def token_buckets(self) -> tuple[int, ...]:
        doublings = _geometric_buckets(min(self.min_token_bucket, self.max_num_batched_tokens),
                                       self.max_num_batched_tokens, 2)
        if self.mid_token_buckets_from is None:
            return doublings
        mids = (b * 3 // 2 for b in doublings if b >= self.mid_token_buckets_from)
        return tuple(sorted(set(doublings) | {m for m in mids if m < self.max_num_batched_tokens}))

    @functools.cached_property  # read by every step's `bucket_for`: made once (a frozen config's values)
    def seq_buckets(self) -> tuple[int, ...]:
        return _geometric_buckets(min(self.min_seq_bucket, self.max_num_seqs), self.max_num_seqs, 4)

    @functools.cached_property  # read by every step's `bucket_for`: made once (a frozen config's values)
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

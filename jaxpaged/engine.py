"""LLMEngine: requests in, one continuous-batching step at a time, outputs back.

    request -> Scheduler.schedule() -> SchedulerOutput -> ModelRunner (StepInput,
    logits) -> sampler (SamplerOutput) -> Scheduler.update_from_output ->
    detokenizer / stop strings -> RequestOutput

A request with n > 1 becomes n child requests (`<id>#<i>`, seeds seed + i) that
share the prompt's pages through prefix caching, aggregated back into one
RequestOutput.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpaged import parallel, sampler
from jaxpaged.detokenizer import IncrementalDetokenizer
from jaxpaged.model_runner import (ModelRunner, RunnerConfig, check_kv_cache_dtype, kv_bytes_per_page,
                                   resolve_kv_cache_dtype)
from jaxpaged.models.loader import DEFAULT_MODEL, LoadedModel, load_model
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.request import Request, RequestStatus
from jaxpaged.sampler import RowInfo, make_sampling_batch, num_top_logprobs_for, sample_jit
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.scheduler import ScheduledRequest, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on CPU when no size is given
_CPU_DEFAULT_MAX_MODEL_LEN = 2048  # keeps the CPU warm-up (one compile per step shape) short


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
    max_num_batched_tokens: int | None = None  # default: 2048 on GPU, 512 on CPU
    # requests fed a prefill chunk in one step; default 16 on GPU, 4 on CPU (bounds attention's prefill tiles)
    max_num_partial_prefills: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes for the KV pool
    num_pages: int | None = None  # KV pool size in pages (incl. the null page); overrides the above
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # the KV pool's dtype (see model_runner.resolve_kv_cache_dtype)
    tensor_parallel_size: int = 1  # devices in the "tp" mesh (see jaxpaged/parallel.py)
    distributed_coordinator: str | None = None  # multi-host: "host:port" of process 0
    num_processes: int = 1  # multi-host: processes in jax.distributed
    process_id: int = 0  # multi-host: this process (0 schedules, the others `follow`)
    chat_template: str | None = None
    generation_config: str | None = None  # path to a generation_config.json
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)
    warmup: bool = True

    def __post_init__(self):
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be a positive integer")
        _ = self.distributed  # validates the multi-host fields
        check_kv_cache_dtype(self.kv_cache_dtype)  # before the model loads
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_num_partial_prefills",
                     "kv_cache_memory", "num_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")

    @property
    def distributed(self) -> parallel.DistributedConfig:
        return parallel.DistributedConfig(self.distributed_coordinator, self.num_processes, self.process_id)


@dataclasses.dataclass
class _Child:
    """Engine-side state of one sample (one scheduler Request) of a user request."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None when params.detokenize is False
    seed: int
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    metrics: RequestMetrics


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None, fault_injector=None):
        # fault_injector: a test hook, fault_injector(entries, logits) -> logits, called every step after
        # the forward; it may raise (fails the step) or corrupt rows (see docs/security.md)
        self.fault_injector = fault_injector
        start = time.perf_counter()
        self.args = args
        if args.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
        parallel.initialize_distributed(args.distributed)  # before any JAX computation
        self.mesh = self._make_mesh()
        self.model = loaded or load_model(args.model, dtype=args.dtype, tokenizer=args.tokenizer,
                                          revision=args.revision, chat_template=args.chat_template,
                                          generation_config=args.generation_config, mesh=self.mesh)
        self.tokenizer = self.model.tokenizer
        self.runner_config = self._runner_config()
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=self.runner_config.num_pages, page_size=args.block_size,
            max_num_seqs=self.runner_config.max_num_seqs,
            max_num_batched_tokens=self.runner_config.max_num_batched_tokens,
            max_model_len=self.runner_config.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
            max_num_partial_prefills=self.runner_config.max_prefill_seqs))
        self.runner = ModelRunner(self.model.config, self.model.params, self.runner_config, self.mesh)
        self._rng = np.random.default_rng(args.seed)
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Child]] = {}
        if args.warmup:
            self.warmup()
        self.startup_seconds = time.perf_counter() - start
        rc = self.runner_config
        logger.info("jaxpaged ready in %.1f s: %s (%s), KV pool %d pages x %d tokens = %d tokens (%s), "
                    "backend %s", self.startup_seconds, self.model.source, self.model.dtype, rc.num_pages - 1,
                    rc.page_size, (rc.num_pages - 1) * rc.page_size, self.runner.kv_dtype, rc.backend)

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

    def _runner_config(self) -> RunnerConfig:
        args, config = self.args, self.model.config
        on_gpu = jax.default_backend() == "gpu"
        max_model_len = args.max_model_len or (config.max_position_embeddings if on_gpu else
                                               min(config.max_position_embeddings, _CPU_DEFAULT_MAX_MODEL_LEN))
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length "
                             f"{config.max_position_embeddings}")
        max_num_seqs = args.max_num_seqs or (256 if on_gpu else 64)
        max_tokens = args.max_num_batched_tokens or max(2048 if on_gpu else 512, max_num_seqs)
        num_pages = args.num_pages or self._pages_from_memory(on_gpu)
        needed = math.ceil(max_model_len / args.block_size) + 1
        if num_pages < needed:
            raise ValueError(f"the KV pool ({num_pages} pages of {args.block_size} tokens) cannot hold one "
                             f"sequence of max_model_len={max_model_len}; give more memory or a smaller "
                             "max_model_len")
        return RunnerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                            max_model_len=max_model_len, page_size=args.block_size, num_pages=num_pages,
                            attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
                            # CPU matmul time grows with padded tokens: decode batches of 1-8 get their own shapes
                            min_token_bucket=16 if on_gpu else 1,
                            max_prefill_seqs=min(args.max_num_partial_prefills or (16 if on_gpu else 4),
                                                 max_num_seqs))

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

    def warmup(self) -> float:
        """Compile every step shape and every sampler shape now; none are compiled later."""
        start = time.perf_counter()
        self.runner.warmup()
        for s in self.runner_config.seq_buckets:
            sampler.warmup(s, self.model.config.vocab_size)
        return time.perf_counter() - start

    # ---- requests ---------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int] | dict[str, Any],
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> None:
        """Tokenize and queue a request; ValueError (nothing queued) if it can never be served."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        now = arrival_time or time.time()
        eos = () if params.ignore_eos else self.model.generation_config.eos_token_ids
        parent = _Parent(request_id, text, token_ids, [], RequestMetrics(arrival_time=now,
                                                                       num_prompt_tokens=len(token_ids)))
        for i in range(params.n):
            child_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            seed = child_params.seed if child_params.seed is not None else int(self._rng.integers(0, 2**63))
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(rid, list(token_ids), child_params, eos_token_ids=tuple(eos), arrival_time=now)
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens,
                                           stop=params.stop, min_tokens=params.min_tokens) \
                if params.detokenize else None
            parent.children.append(_Child(i, request, detok, seed, [] if params.logprobs is not None else None))
        for child in parent.children:  # validates on the first; children are identical
            try:
                self.scheduler.add_request(child.request)
            except ValueError:
                self.scheduler.abort_requests([c.request.request_id for c in parent.children])
                raise
        self._parents[request_id] = parent
        for child in parent.children:
            self._child_to_parent[child.request.request_id] = (parent, child)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, self._check_ids(prompt)

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (all their samples) and free their pages at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
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
        """Run one scheduling step; return outputs of requests that got new tokens or finished."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        entries = out.scheduled_requests
        now = time.time()
        for entry in entries:
            parent, _ = self._child_to_parent[entry.request_id]
            parent.metrics.first_scheduled_time = parent.metrics.first_scheduled_time or now
        logits = self.runner.execute(self.runner.prepare(entries))
        if self.fault_injector is not None:
            logits = self.fault_injector(entries, logits)
        top_logprobs = num_top_logprobs_for([e.sampling_params.logprobs for e in entries])  # 0 unless asked
        sampled = jax.device_get(sample_jit(logits, self._sampling_batch(entries, logits.shape),
                                            num_top_logprobs=top_logprobs))
        nonfinite = {e.request_id for i, e in enumerate(entries) if e.samples and not sampled.finite[i]}
        self.scheduler.finish_requests(nonfinite, "error")  # NaN/inf logits fail only their own request
        new_tokens = {e.request_id: [int(sampled.token_ids[i])] for i, e in enumerate(entries) if e.samples}
        self.scheduler.update_from_output(out, new_tokens)
        touched: dict[str, _Parent] = {}
        for i, entry in enumerate(entries):
            if entry.samples:
                parent, child = self._child_to_parent[entry.request_id]
                if entry.request_id in nonfinite:
                    child.finish_reason = "error"
                else:
                    self._process_token(child, sampled, i)
                touched[parent.request_id] = parent
        return [self._make_output(parent) for parent in touched.values()]

    def _sampling_batch(self, entries: Sequence[ScheduledRequest], logits_shape):
        rows = []
        for entry in entries:
            _, child = self._child_to_parent[entry.request_id]
            request = child.request
            banned = ()
            if request.num_output_tokens < request.sampling_params.min_tokens:
                banned = tuple(request.eos_token_ids) + request.sampling_params.stop_token_ids
            rows.append(RowInfo(params=entry.sampling_params, seed=child.seed, step=request.num_output_tokens,
                                prompt_token_ids=request.prompt_token_ids,
                                output_token_ids=request.output_token_ids, banned_token_ids=banned))
        return make_sampling_batch(rows, logits_shape[0], logits_shape[1])

    def _process_token(self, child: _Child, sampled, row: int) -> None:
        request = child.request
        token_id = int(sampled.token_ids[row])
        if child.logprobs is not None:
            child.logprobs.append(self._logprob_entry(sampled, row, token_id, request.sampling_params.logprobs))
        child.cumulative_logprob += float(sampled.logprobs[row])
        stop_str = None
        if child.detokenizer is not None:
            stop_terminated = request.is_finished and request.finish_reason == "stop"
            stop_str = child.detokenizer.update([token_id], stop_terminated=stop_terminated)
            if stop_str is None and request.is_finished:
                stop_str = child.detokenizer.flush()
        if stop_str is not None:
            if not request.is_finished:
                self.scheduler.finish_requests([request.request_id], "stop", stop_reason=stop_str)
            child.finish_reason, child.stop_reason = "stop", stop_str
        elif request.is_finished:
            child.finish_reason, child.stop_reason = request.finish_reason, request.stop_reason

    def _logprob_entry(self, sampled, row: int, token_id: int, k: int) -> dict[int, Logprob]:
        top_ids = sampled.top_token_ids[row]
        entry = {int(t): Logprob(float(sampled.top_logprobs[row, r]), r + 1, self._decode_token(int(t)))
                 for r, t in enumerate(top_ids[:k])}
        if token_id not in entry:
            ranks = np.nonzero(top_ids == token_id)[0]
            rank = int(ranks[0]) + 1 if len(ranks) else None
            entry[token_id] = Logprob(float(sampled.logprobs[row]), rank, self._decode_token(token_id))
        return entry

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, parent: _Parent) -> RequestOutput:
        now = time.time()
        metrics = parent.metrics
        metrics.first_token_time = metrics.first_token_time or now
        finished = all(c.finish_reason is not None for c in parent.children)
        outputs = [CompletionOutput(
            index=c.index, text=_text(c),
            token_ids=list(c.request.output_token_ids), cumulative_logprob=c.cumulative_logprob,
            logprobs=None if c.logprobs is None else list(c.logprobs),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in parent.children]
        metrics.num_generation_tokens = sum(len(o.token_ids) for o in outputs)
        metrics.num_cached_tokens = max(c.request.num_cached_tokens for c in parent.children)
        if finished:
            metrics.finished_time = now
            self._parents.pop(parent.request_id, None)
            for child in parent.children:
                self._child_to_parent.pop(child.request.request_id, None)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             metrics, metrics.num_cached_tokens)

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
        }


def _text(child: _Child) -> str:
    if child.detokenizer is None:
        return ""
    return child.detokenizer.get_next_output_text(child.finish_reason is not None, delta=False)


__all__ = ["EngineArgs", "LLMEngine", "RequestStatus"]

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

Speculative decoding under async scheduling: jaxpaged/engine/drafting.py.

A request with n > 1 becomes n child requests (`<id>#<i>`, seeds seed + i) that
share the prompt's pages through prefix caching, aggregated back into one
RequestOutput (in DELTA mode it holds only the children that got new tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.config import (EngineArgs, _configure_compilation_cache, make_mesh, resolve_engine_config,
                             resolve_quantization, weight_layout_for)
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.drafting import NO_ROOM_MAX_WAIT, Drafting
from jaxpaged.engine.grammar import GrammarSupport
from jaxpaged.engine.output_processor import FloatArray, OutputProcessor, _Child, _Parent, plan_child
from jaxpaged.engine.validation import validate_request
from jaxpaged.engine.weight_control import WeightControl
from jaxpaged.errors import InvalidRequestError
from jaxpaged.models.fp8 import quantize_params
from jaxpaged.models.loader import LoadedModel, load_model
from jaxpaged.outputs import RequestMetrics, RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker import parallel
from jaxpaged.worker.in_flight import PendingStep
from jaxpaged.worker.kv_scales import resolve_kv_scales
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.runner_config import build_native_kernels, fp8_gemm, quantization_summary
from jaxpaged.worker.step_input import FaultInjector
from jaxpaged.worker.weight_layout import to_weight_layout

logger = logging.getLogger(__name__)


class LLMEngine(Drafting, GrammarSupport, OutputProcessor, WeightControl):
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None,
                 fault_injector: FaultInjector | None = None):
        # fault_injector: a test hook handed to the ModelRunner (runner.fault_injector), called every step
        # after the forward as fault_injector(entries, logits) -> logits (see docs/security.md)
        start = time.perf_counter()
        self.args = args
        _configure_compilation_cache(args)
        parallel.initialize_distributed(args.distributed)  # before any JAX computation
        build_native_kernels(args.attention_backend)  # a cold start's C++ builds, beside the loading below
        self.mesh = make_mesh(args)
        self.model = loaded or load_model(args.model, dtype=args.dtype, tokenizer=args.tokenizer,
                                          revision=args.revision, chat_template=args.chat_template,
                                          generation_config=args.generation_config, mesh=self.mesh,
                                          cache_dir=args.model_cache_dir)
        self.tokenizer = self.model.tokenizer
        # The step's weight layout, before the KV pool is sized from free memory: weights this engine
        # loaded are converted in place (one group of tensors at a time); a caller's `loaded` is left usable.
        self.model = dataclasses.replace(self.model, params=to_weight_layout(
            self.model.config, self.model.params, weight_layout_for(args, self.model, self.mesh), self.mesh,
            consume=loaded is None))
        if resolve_quantization(args, self.model, self.mesh) == "fp8":  # FP8 weights, before the pool is sized
            self.model = dataclasses.replace(self.model, params=quantize_params(
                self.model.params, fp8_gemm(), consume=loaded is None))
        phases = {"load": time.perf_counter() - start}  # seconds per start-up phase, for the ready line
        self.config = resolve_engine_config(args, self.model, self.mesh)
        self.runner_config = self.config.runner
        self.overlap_verification = self.config.overlap_verification
        self.async_scheduling = self.config.async_scheduling
        if args.async_scheduling is not False and not self.async_scheduling:
            logger.info("async scheduling: off with num_processes=%d (the synchronous loop runs)", args.num_processes)
        self.async_max_tokens = self.config.async_max_tokens  # the steps kept in flight (None: all)
        self._in_flight: PendingStep | None = None  # async scheduling: the step dispatched, not yet handled
        self._last_handled = 0.0  # time.perf_counter() when the last step's outputs were handled
        self._deferred_error: BaseException | None = None  # async: a dispatch failure, raised by the next step()
        self.scheduler = Scheduler(self.config.scheduler)
        mark = time.perf_counter()
        # an fp8 KV cache's scales: the checkpoint's, else calibrated now on the model (jaxpaged/worker/kv_scales.py)
        kv_scales = resolve_kv_scales(self.model.config, self.model.params,
                                      self.runner_config.kv_dtype(self.model.params["embed"].dtype),
                                      self.model.source, None if self.tokenizer is None else self.tokenizer.encode)
        self.runner = ModelRunner(self.model.config, self.model.params, self.runner_config, self.mesh,
                                  fault_injector=fault_injector, consume_params=loaded is None, kv_scales=kv_scales)
        # the engine's model holds the runner's form of the weights (on CPU the native matmul's blocks): one copy
        self.model = dataclasses.replace(self.model, params=self.runner.params)
        phases["kv_pool"] = time.perf_counter() - mark
        self._init_structured_outputs()
        self._init_drafting(args.speculative_config)
        self._rng = np.random.default_rng(args.seed)
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Child]] = {}
        if args.warmup:
            phases.update(self.warmup())
        self.startup_seconds = time.perf_counter() - start
        self.startup_phases = phases
        self._log_ready()

    def _log_ready(self) -> None:
        rc, phases = self.runner_config, self.startup_phases
        quantized = "" if rc.quantization is None else f", weight dots {quantization_summary(rc.quantization)}"
        logger.info("jaxpaged ready in %.1f s (%s): %s (%s%s), KV pool %d pages x %d tokens = %d tokens (%s), "
                    "backend %s", self.startup_seconds, ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()),
                    _model_name(self.args.model, self.model.source), self.model.dtype, quantized, rc.num_pages - 1, rc.page_size,
                    (rc.num_pages - 1) * rc.page_size, self.runner.kv_dtype, rc.backend)

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
        self.check_awake()  # EngineSleepingError while asleep: nothing queued
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
                         RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids)),
                         fresh=set() if params.n > 1 else None)
        if params.prompt_logprobs is not None and params.array_logprobs:
            parent.prompt_token_logprobs = np.full(len(token_ids), np.nan, np.float32)
        elif params.prompt_logprobs is not None:
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
        for child in parent.children:  # queued: its max_model_len is the scheduler's
            plan_child(child)

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
        entries = [] if params.logprobs is not None and not params.array_logprobs else None
        return _Child(index, request, detok, entries,
                      token_logprobs=FloatArray(params.max_tokens or 16) if params.array_logprobs else None)

    # ---- structured outputs -----------------------------------------------

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
            self.runner.remove_requests(out)  # the rows of requests finished or preempted since the last step
            if not failed:
                self._wait_for_grammars()
            return failed
        return self._run_sync(out, failed, start)

    def _run_sync(self, out: SchedulerOutput, outputs: list[RequestOutput], start: float) -> list[RequestOutput]:
        """Run a scheduled step and handle its outputs; return `outputs` (those this call made before) and its
        own. start: when the step's host work began (the draft policy's clock)."""
        self._stamp_first_scheduled(out)
        # the grammar bitmask is filled while the forward runs (the runner calls it after dispatching it)
        result = self.runner.execute_model(out, functools.partial(self._grammar_bitmask, out.scheduled_requests))
        for rid, chunk in result.prompt_logprobs.items():
            self._record_prompt_logprobs(*self._child_to_parent[rid], chunk)
        sampled, stops, touched = self._emit_step(result)
        if self.spec_decoding_stats is not None:
            self._observe_drafts(out.scheduled_requests, result)
        self.scheduler.update_from_output(out, sampled, stops)
        outputs = outputs + self._outputs(touched)
        self._observe_step(out, start)
        return outputs

    def _stamp_first_scheduled(self, out: SchedulerOutput) -> None:
        """Each request's first scheduling time, from the entries sent whole (page_ids_from 0: a request's
        first step is one; the others, most rows, are only looked at)."""
        now = time.time()
        for entry in out.scheduled_requests:
            if not entry.page_ids_from:
                metrics = self._child_to_parent[entry.request_id][0].metrics
                metrics.first_scheduled_time = metrics.first_scheduled_time or now

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
        Speculative decoding: when every request in flight verifies overlapped (`_verifies_overlapped`), the
        host reserves draft slots past N's outcome, which the device fills (`_reserve_drafts_in_flight`), and N+1
        is dispatched as any other step. Otherwise, when drafts are likely (`_drafts_likely`), N is handled first and drafts are proposed;
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
                    self._reserve_drafts_in_flight(previous.scheduler_output, in_flight)  # nothing waits
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
            drafted = [e.request_id for e in out.scheduled_requests if e.spec_token_ids] if proposed or overlapped \
                else []
            if drafted:
                self._no_room_streak = 0
                if not all(self._verifies_overlapped(self.scheduler.get_request(rid)) for rid in drafted):
                    return self._run_sync(out, failed, start)  # verified before the next is scheduled
            elif proposed and not overlapped:  # drafts found no room (the partial-prefill slots, a bucket's padding):
                self._no_room_streak += 1  # wait for a token in flight again only after 2, 4, ... steps, or once the
                # batch changes
                self._no_room_batch, self._no_room_wait = batch, min(2 ** self._no_room_streak, NO_ROOM_MAX_WAIT)
            if out.is_empty:
                self.runner.remove_requests(out)  # the rows of requests finished or preempted since the last step
            if out.is_empty and previous is None:
                if not failed:
                    self._wait_for_grammars()
                return failed
            flight = None if out.is_empty else self._dispatch_async(out, previous)
            outputs = failed + (self._handle_in_flight(previous) if previous is not None else [])
            if flight is not None and self._dispatch_sampler_async(flight):
                if self.async_max_tokens is None or out.num_scheduled_tokens <= self.async_max_tokens:
                    self._in_flight = flight
                else:  # a step too large to overlap: handled now, so the next one schedules without placeholders
                    outputs += self._handle_now(flight)
        except BaseException:
            self._abandon_in_flight()
            raise
        return outputs

    def _dispatch_async(self, out: SchedulerOutput, previous: PendingStep | None) -> PendingStep | None:
        """Dispatch the step's forward; None (the error deferred to the next step()) if that fails. The step in
        flight notes when it was dispatched (its entries' Requests are its scheduler output's)."""
        self._stamp_first_scheduled(out)
        try:
            pending = self.runner.dispatch(out, previous)
        except Exception as err:
            self._deferred_error = err
            return None
        pending.dispatched_at = time.perf_counter()
        return pending

    def _dispatch_sampler_async(self, flight: PendingStep) -> bool:
        """Dispatch the step's sampler; False (the error deferred to the next step()) if that fails."""
        entries = flight.scheduler_output.scheduled_requests
        try:
            self.runner.dispatch_sample(flight, functools.partial(self._grammar_bitmask, entries))
        except Exception as err:
            self._deferred_error = err
            return False
        return True

    def _handle_now(self, flight: PendingStep) -> list[RequestOutput]:
        """`_handle_in_flight` for the step just dispatched; a failure is raised by the next step(), so the
        outputs already made this call (the previous step's) are still returned."""
        try:
            return self._handle_in_flight(flight)
        except Exception as err:
            self._deferred_error = err
            return []

    def _handle_in_flight(self, flight: PendingStep) -> list[RequestOutput]:
        """Bring a dispatched step's tokens to the host and apply them, as `step` does, to the requests
        still live: the same Request objects it scheduled (one finished or aborted since is skipped, even
        if a new request took its id)."""
        result = flight.result()
        out = flight.scheduler_output
        entries, live = out.scheduled_requests, None  # live None: every entry's request (no request finished since)
        if self.scheduler.num_finished != out.num_finished:
            live = {request.request_id for request in out.requests if not request.is_finished}
            entries = tuple(e for e in entries if e.request_id in live)
        for rid, chunk in result.prompt_logprobs.items():
            if live is None or rid in live:
                self._record_prompt_logprobs(*self._child_to_parent[rid], chunk)
        sampled, stops, touched = self._emit_step(result, live)
        if self.spec_decoding_stats is not None:
            self._observe_drafts(entries, result)
        self.scheduler.update_from_output(out, sampled, stops)  # (it skips the entries of requests finished since)
        outputs = self._outputs(touched)
        # overlapped: the time between steps; not for a step whose requests all ended before it was handled (the
        # slot wasted after a stop, left in flight while the engine idled: its time spans the idle gap)
        self._observe_step(out, max(flight.dispatched_at, self._last_handled), timed=bool(entries))
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


def _as_ids(ids) -> list[int]:
    try:
        return [int(i) for i in ids]
    except (TypeError, ValueError):
        raise InvalidRequestError("prompt token ids must be integers", "prompt") from None


__all__ = ["EngineArgs", "LLMEngine", "RequestStatus"]


def _model_name(model: str, source) -> str:
    """The model as the user named it, with the file it resolved to when that is not the name itself."""
    name = str(model)
    return name if name.rstrip("/").endswith(source.name) else f"{name} ({source.name})"

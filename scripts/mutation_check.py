"""Mutation check: remove each guard in a scratch copy of the repository, run the tests named for it, and
report which mutations survive (a surviving mutation is a guard no test protects).

Every row of docs/security.md and the engine's correctness guards (page accounting, prefix-cache hashing,
preemption, stop handling, seeded sampling) has one or more mutations below. A mutation is located by an
exact source snippet (`anchor`) that must occur exactly once in its file: after a refactor moves or rewrites
the guarded code, the check says "anchor not found" (and fails) instead of silently mutating nothing.

    python scripts/mutation_check.py --check-anchors        # seconds: every anchor matches exactly once
    python scripts/mutation_check.py --list
    python scripts/mutation_check.py [--only NAME,...] [--no-baseline] [--markdown FILE]

A full run first runs the union of the named tests unmutated (they must pass: a mutation "killed" by a
test that fails anyway proves nothing), then each mutation in turn, one pytest process at a time, in a
scratch copy of the working tree (tracked and untracked-but-not-ignored files; the checkout is never
touched). Exit status 0 only when every mutation was killed. New guards land with a row here
(docs/security.md, "Mutation check").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REL = "tests/reliability/"
SPEC = "tests/test_spec_decode.py::"
SPEC_SCHED = "tests/test_scheduler_spec.py::"
PYTEST = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "slow or not slow", "--tb=line"]


@dataclasses.dataclass(frozen=True)
class Mutation:
    """Replace `anchor` (exactly one occurrence in `path`) by `replacement`; `tests` must then fail."""

    name: str
    guard: str  # the docs/security.md row, or "engine: ..." for the engine's correctness guards
    path: str
    anchor: str
    replacement: str
    tests: tuple[str, ...]

    def apply(self, source: str) -> str:
        count = source.count(self.anchor)
        if count != 1:
            raise AnchorError(f"{self.name}: anchor {'not found' if count == 0 else f'found {count} times'} "
                              f"in {self.path}: {self.anchor.strip().splitlines()[0]!r}")
        return source.replace(self.anchor, self.replacement)


class AnchorError(RuntimeError):
    pass


def _m(name, guard, path, anchor, replacement, *tests):
    return Mutation(name, guard, path, anchor, replacement, tuple(tests))


SEC = REL + "test_security.py::"
FAULTS = REL + "test_faults.py::"
ISO = REL + "test_kv_isolation.py::"
SHUTDOWN = REL + "test_shutdown.py::test_sigterm_drains_and_exits_zero"
ASYNC = "tests/test_async_scheduling.py::"

MUTATIONS: tuple[Mutation, ...] = (
    # ---- docs/security.md rows -------------------------------------------------------------------------
    _m("api-key-prefix-list", "API key (deny by default)", "server/middleware.py",
       'if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:',
       'if scope["type"] != "http" or not scope["path"].startswith(("/v1", "/tokenize", "/detokenize", '
       '"/metrics")):',
       SEC + "test_path_tricks_do_not_bypass_the_key", SEC + "test_raw_path_tricks_do_not_bypass_the_key",
       SEC + "test_a_route_added_later_needs_the_key"),
    _m("api-key-public-prefix", "API key (deny by default)", "server/middleware.py",
       'if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:',
       'if scope["type"] != "http" or scope["path"].startswith(tuple(PUBLIC_PATHS)):',
       SEC + "test_raw_path_tricks_do_not_bypass_the_key"),
    _m("api-key-any-value", "API key", "server/middleware.py",
       "if not hmac.compare_digest(given, self.expected):", "if not given:",
       SEC + "test_every_non_public_route_needs_the_key"),
    _m("body-declared-length", "Body size", "server/middleware.py",
       "if length is not None and length.isdigit() and int(length) > self.max_bytes:", "if False:",
       SEC + "test_a_huge_declared_body_is_refused_before_it_is_read"),
    _m("body-streamed-size", "Body size", "server/middleware.py",
       "            if size > self.max_bytes:", "            if False:",
       SEC + "test_request_bodies_are_capped"),
    _m("prompt-plus-max-tokens", "Prompt / output length", "jaxpaged/core/scheduler.py",
       "if max_tokens < 1 or request.num_prompt_tokens + max_tokens > max_model_len:", "if max_tokens < 1:",
       SEC + "test_limits_are_400s_naming_the_field", ISO + "test_request_larger_than_the_model_length_is_a_400_at_once"),
    _m("stop-token-ids-vocabulary", "Per-request sizes the sampler must hold", "jaxpaged/engine/validation.py",
       "    check_token_ids(params.stop_token_ids, vocab_size, \"stop_token_ids\")\n",
       "    pass\n",
       SEC + "test_limits_are_400s_naming_the_field"),
    _m("logit-bias-size", "Per-request sizes the sampler must hold", "server/protocol.py",
       "Field(max_length=MAX_LOGIT_BIAS_ENTRIES)", "Field()",
       SEC + "test_logit_bias_is_capped_for_a_real_vocabulary"),
    _m("constraint-size-unbounded", "Output constraints (structured outputs, tools)", "jaxpaged/sample/structured_outputs.py",
       "            if size > self.config.max_spec_bytes:", "            if False:",
       "tests/test_structured_outputs.py::test_bad_constraints_fail_fast_with_the_reason"),
    _m("constraint-mask-skipped", "Output constraints (structured outputs, tools)", "jaxpaged/sample/sampler.py",
       "    if batch.token_bitmask is None:\n        return _sample_parts(", "    if True:\n        return _sample_parts(",
       "tests/test_structured_outputs.py::test_sampler_only_picks_allowed_tokens_and_logprobs_follow_the_mask",
       "tests/test_structured_outputs.py::test_engine_outputs_obey_their_constraint"),
    _m("waiting-queue-bound", "Waiting queue", "jaxpaged/engine/async_llm.py",
       "if waiting + params.n > limit:", "if False:",
       REL + "test_load.py::test_full_queue_answers_503_with_retry_after_at_once_then_recovers"),
    _m("no-eval-server", "No file / shell / eval from requests", "server/chat.py",
       "\nimport jinja2\n", "\nimport jinja2\n_PROBE = eval(\"0\")\n",
       SEC + "test_no_request_field_reaches_a_file_a_shell_or_eval"),
    _m("no-subprocess-engine", "No file / shell / eval from requests", "jaxpaged/models/llama.py",
       "\nimport jax\n", "\nimport jax\nimport subprocess  # noqa: F401\n",
       SEC + "test_no_request_field_reaches_a_file_a_shell_or_eval"),
    _m("template-unsandboxed", "Chat-template sandbox", "server/chat.py",
       "        text = ctx.tokenizer.apply_chat_template(conversation(messages), tools=list(tools) or None,\n"
       "                                                 tokenize=False, add_generation_prompt=add_generation_prompt,\n"
       "                                                 **template_kwargs)",
       "        text = jinja2.Template(ctx.tokenizer.chat_template).render(\n"
       "            messages=conversation(messages), add_generation_prompt=add_generation_prompt, **template_kwargs)",
       SEC + "test_a_malicious_model_template_is_a_400_over_http"),
    _m("template-kwargs-reserved", "Chat-template sandbox", "server/chat.py",
       "    if reserved:\n", "    if False:\n",
       SEC + "test_a_chat_template_in_the_request_is_ignored"),
    _m("validation-422", "Errors never leak as 5xx for bad input (400, never 422)", "server/errors.py",
       "        message, param = _validation_message(err)\n        return error_response(400, message, param)",
       "        message, param = _validation_message(err)\n        return error_response(422, message, param)",
       REL + "test_fuzz.py::test_schemathesis_every_operation"),
    _m("step-failure-no-reset", "Step failures are contained (prefix-cache reset)", "jaxpaged/engine/async_llm.py",
       "            self._reset_prefix_cache()\n", "            pass\n",
       FAULTS + "test_a_step_failing_before_the_forward_resets_the_prefix_cache"),
    _m("step-failure-kills-thread", "Step failures are contained", "jaxpaged/engine/async_llm.py",
       "            self._num_step_errors += 1\n            self._fail_running()\n            return",
       "            self._num_step_errors += 1\n            raise",
       FAULTS + "test_step_exception_fails_its_requests_and_the_server_goes_on"),
    _m("nan-rows-not-failed", "NaN / inf logits", "jaxpaged/engine/output_processor.py",
       "        if not finite[row]:  # NaN/inf logits fail only their own request",
       "        if False:  # NaN/inf logits fail only their own request",
       FAULTS + "test_nan_row_finishes_with_reason_error_at_the_engine", FAULTS + "test_nan_logits_fail_only_that_request"),
    _m("kv-len-mask", "Isolation (attention never reads past kv_len)", "pallas_kernels/xla_attention.py",
       "    kv_live = kpos < kv_len[:, None]                            # [C, K]\n",
       "    kv_live = kpos >= 0                            # [C, K]\n",
       ISO + "test_garbage_in_unused_kv_pages_is_never_read"),
    _m("disconnect-stream-no-abort", "Disconnects (streams)", "server/serving.py",
       "            for future in pending:\n                future.cancel()\n            self.abort()",
       "            for future in pending:\n                future.cancel()",
       REL + "test_disconnect.py::test_disconnect_storm_frees_every_page_without_errors"),
    _m("disconnect-poll-no-abort", "Disconnects (non-streaming)", "server/serving.py",
       "            task.cancel()\n            on_disconnect()", "            task.cancel()",
       REL + "test_disconnect.py::test_disconnect_storm_frees_every_page_without_errors"),
    _m("generate-leaver-no-abort", "Disconnects (AsyncLLM.generate)", "jaxpaged/engine/async_llm.py",
       "        finally:\n            if not finished:\n                self.abort(request_id)",
       "        finally:\n            pass",
       "tests/server/test_async_engine.py::test_consumer_leaving_early_aborts",
       "tests/server/test_async_engine.py::test_cancelled_consumer_aborts"),
    _m("finished-pages-leak", "Load / leaks", "jaxpaged/core/scheduler.py",
       "            self.waiting.remove(request)\n        self.pool.free(request)\n",
       "            self.waiting.remove(request)\n",
       REL + "test_load.py::test_256_concurrent_streams_three_rounds_no_leaks"),
    _m("shutdown-ignores-grace", "Shutdown (grace period honoured)", "server/lifecycle.py",
       "await self._drain(self.shutdown_config.grace_seconds)", "await self._drain(0.0)", SHUTDOWN),
    _m("shutdown-never-aborts", "Shutdown (the rest aborted at the end of the grace)", "server/lifecycle.py",
       "deadline = time.monotonic() + grace_seconds", "deadline = time.monotonic() + 3600", SHUTDOWN),
    _m("shutdown-reraises-signal", "Shutdown (exit 0)", "server/lifecycle.py",
       "    def handle_exit(self, sig: int, frame) -> None:", "    def _unused_handle_exit(self, sig: int, frame) -> None:",
       SHUTDOWN),
    # ---- the engine's correctness guards ----------------------------------------------------------------
    _m("pages-never-freed", "engine: page accounting", "jaxpaged/core/page_pool.py",
       "        if self._ref_counts[page_id] == 0:\n            self._free[page_id] = None",
       "        if False:\n            self._free[page_id] = None",
       "tests/test_page_pool.py", "tests/test_scheduler.py"),
    _m("no-capacity-check", "engine: page accounting", "jaxpaged/core/page_pool.py",
       "        if num_needed + num_prefix_free > self.num_free_pages:\n            return None",
       "        if False:\n            return None",
       "tests/test_page_pool.py", "tests/test_scheduler.py"),
    _m("double-free-allowed", "engine: page accounting", "jaxpaged/core/page_pool.py",
       "        if self._ref_counts[page_id] <= 0:\n            raise RuntimeError",
       "        if False:\n            raise RuntimeError",
       "tests/test_page_pool.py"),
    _m("hash-not-chained", "engine: prefix-cache hashing (and Isolation)", "jaxpaged/core/page_pool.py",
       "parent = hashes[-1] if hashes else _ROOT_HASH", "parent = _ROOT_HASH",
       ISO + "test_identical_pages_after_different_prefixes_are_not_shared"),
    _m("hit-covers-whole-prompt", "engine: prefix-cache hashing", "jaxpaged/core/page_pool.py",
       "max_pages = (request.num_tokens - 1) // self.page_size", "max_pages = request.num_tokens // self.page_size",
       "tests/test_page_pool.py", "tests/test_scheduler.py"),
    _m("uncomputed-pages-cached", "engine: prefix-cache hashing", "jaxpaged/core/page_pool.py",
       "num_full = min(request.num_computed_tokens, request.num_tokens) // self.page_size",
       "num_full = request.num_tokens // self.page_size",
       "tests/test_page_pool.py", "tests/test_scheduler.py"),
    _m("reused-page-keeps-hash", "engine: prefix-cache hashing", "jaxpaged/core/page_pool.py",
       "        if self._page_hashes[page_id] is not None:\n            self._evict(page_id)",
       "        if False:\n            self._evict(page_id)",
       "tests/test_page_pool.py", "tests/test_scheduler.py"),
    _m("preempt-keeps-progress", "engine: preemption (KV exhaustion)", "jaxpaged/core/scheduler.py",
       "        self.pool.free(request)\n        request.num_computed_tokens = 0\n        request.status = RequestStatus.PREEMPTED",
       "        self.pool.free(request)\n        request.status = RequestStatus.PREEMPTED",
       "tests/test_scheduler.py", ISO + "test_kv_exhaustion_preempts_and_matches_the_unconstrained_run"),
    _m("preempt-keeps-pages", "engine: preemption (KV exhaustion)", "jaxpaged/core/scheduler.py",
       "    def _preempt(self, request: Request) -> None:\n        self.pool.free(request)\n",
       "    def _preempt(self, request: Request) -> None:\n",
       "tests/test_scheduler.py", ISO + "test_kv_exhaustion_preempts_and_matches_the_unconstrained_run"),
    _m("eos-ignored", "engine: stop handling", "jaxpaged/core/request.py",
       "if not params.ignore_eos and token_id in self.eos_token_ids:", "if False:",
       "tests/test_request.py"),
    _m("stop-token-ids-ignored", "engine: stop handling", "jaxpaged/core/request.py",
       "            if token_id in params.stop_token_ids:", "            if False:",
       "tests/test_request.py"),
    _m("max-tokens-ignored", "engine: stop handling", "jaxpaged/core/request.py",
       "if max_tokens is not None and num_output >= max_tokens:", "if False:",
       "tests/test_request.py"),
    _m("min-tokens-ignored", "engine: stop handling", "jaxpaged/core/request.py",
       "        if num_output >= params.min_tokens:\n", "        if True:\n",
       "tests/test_request.py"),
    _m("max-model-len-ignored", "engine: stop handling", "jaxpaged/core/request.py",
       "if self.max_model_len is not None and self.num_tokens + ahead + 1 >= self.max_model_len:", "if False:",
       "tests/test_request.py"),
    _m("stop-strings-ignored", "engine: stop handling", "jaxpaged/engine/detokenizer.py",
       "        if not self.stop:\n            return None\n        return self._check_stop(check_from)",
       "        if not self.stop:\n            return None\n        return None",
       "tests/test_detokenizer.py"),
    _m("lean-screen-ignores-stop-ids", "engine: stop handling", "jaxpaged/engine/output_processor.py",
       "return (not finite or token_id in child.stop_ids", "return (not finite",
       "tests/test_output_processor.py"),
    _m("lean-screen-ignores-length", "engine: stop handling", "jaxpaged/engine/output_processor.py",
       "or len(child.request.output_token_ids) + ahead + 1 >= child.length_limit)", ")",
       "tests/test_output_processor.py"),
    _m("output-token-ids-not-copied", "engine: outputs", "jaxpaged/outputs.py",
       "_TOKEN_IDS_SLOT.__set__(output, _TOKEN_IDS_SLOT.__get__(output)[start:end])",
       "_TOKEN_IDS_SLOT.__set__(output, _TOKEN_IDS_SLOT.__get__(output))",
       "tests/test_engine_outputs.py::test_a_cumulative_output_keeps_its_tokens_when_read_after_later_steps"),
    _m("min-tokens-not-banned", "engine: stop handling", "jaxpaged/core/request.py",
       "        if num_output_tokens >= params.min_tokens:\n            return ()",
       "        if True:\n            return ()",
       "tests/test_request.py", "tests/test_engine.py"),
    _m("seed-ignored", "engine: seeded sampling", "jaxpaged/sample/sampling_batch.py",
       "    padded_key_data[:n] = key_data\n", "    padded_key_data[:n] = 0\n",
       "tests/test_sampler.py"),
    _m("step-not-folded", "engine: seeded sampling", "jaxpaged/sample/sampling_batch.py",
       "    padded_steps[:n] = steps\n", "    padded_steps[:n] = 0\n",
       "tests/test_sampler.py"),
    _m("n-children-same-seed", "engine: seeded sampling", "jaxpaged/engine/llm_engine.py",
       "seed=None if params.seed is None else params.seed + index)", "seed=params.seed)",
       "tests/test_engine.py::test_n_samples_with_seed_differ_and_reproduce"),
    # ---- async scheduling (one step in flight) -------------------------------------------------------
    _m("async-stale-id-applied", "engine: async scheduling", "jaxpaged/engine/llm_engine.py",
       "live = {request.request_id for request in out.requests if not request.is_finished}",
       "live = {request.request_id for request in out.requests}",
       ASYNC + "test_aborted_id_reused_while_its_step_is_in_flight"),
    _m("async-length-stop-rescheduled", "engine: async scheduling", "jaxpaged/core/scheduler.py",
       "(in_flight and len(request.output_token_ids) + in_flight >= request.max_output_tokens):",
       "False:",
       "tests/test_scheduler.py::test_async_request_at_max_tokens_is_not_scheduled_again"),
    _m("async-preempted-readmitted-early", "engine: async scheduling", "jaxpaged/core/scheduler.py",
       "            if request.num_output_placeholders:\n                break",
       "            if False:\n                break",
       "tests/test_scheduler.py::test_async_preempted_request_waits_for_its_tokens_in_flight"),
    _m("async-placeholders-not-counted", "engine: async scheduling", "jaxpaged/core/scheduler.py",
       "num_output = len(outputs) + request.num_output_placeholders  # the next token's output number",
       "num_output = len(outputs) + 0",
       "tests/test_scheduler.py::test_async_decode_feeds_a_placeholder_with_exact_pages"),
    _m("async-placeholder-source-unchecked", "engine: async scheduling", "jaxpaged/worker/in_flight.py",
       "    if len(source) and source.min() < 0:\n", "    if False:\n",
       "tests/test_model_runner.py::test_outputs_in_flight_are_what_the_host_counts_lack"),
    _m("step-past-page-table", "engine: page accounting", "jaxpaged/worker/model_runner.py",
       "        if num_tokens and (page_index >= num_pages[token_rows]).any():", "        if False:",
       "tests/test_model_runner.py::test_prepare_packs_exact_arrays"),
    _m("batch-row-cut-back-ignored", "engine: page accounting", "jaxpaged/worker/input_batch.py",
       "elif entry.page_ids or start != pages[row]:", "elif entry.page_ids:",
       "tests/test_input_batch.py"),
    _m("batch-row-tail-not-cleared", "engine: page accounting", "jaxpaged/worker/input_batch.py",
       "        table[end:max(end, self._pages[row])] = 0\n", "",
       "tests/test_input_batch.py"),
    _m("batch-diff-past-row", "engine: page accounting", "jaxpaged/worker/input_batch.py",
       "elif row is None or start > pages[row]:", "elif row is None:",
       "tests/test_input_batch.py"),
    _m("pages-sent-after-truncate", "engine: page accounting", "jaxpaged/core/page_pool.py",
       "        request.num_pages_sent = min(request.num_pages_sent, len(request.page_ids))\n", "",
       "tests/test_scheduler_spec.py"),
    _m("pages-sent-after-window", "engine: page accounting", "jaxpaged/core/page_pool.py",
       "            request.num_pages_sent = min(request.num_pages_sent, i)\n", "",
       "tests/test_input_batch.py"),
    _m("async-flags-read-before-inputs", "engine: async scheduling", "jaxpaged/worker/dispatch.py",
       "        history = _in_flight_history(entries, layout, None) if layout is not None else {}\n",
       "        carry()\n        history = _in_flight_history(entries, layout, None) if layout is not None else {}\n",
       "tests/test_fused_step.py::test_a_step_after_random_rows_builds_its_sampler_inputs_before_reading_their_flags"),
    _m("async-gather-not-warmed", "engine: async scheduling", "jaxpaged/engine/llm_engine.py",
       "return self.runner.warmup(self.async_scheduling)", "return self.runner.warmup()",
       ASYNC + "test_no_compilation_after_warmup"),
    _m("async-dispatch-error-not-deferred", "engine: async scheduling", "jaxpaged/engine/llm_engine.py",
       "            self._deferred_error = err\n            return False", "            raise",
       ASYNC + "test_failed_step_loses_no_delivered_token"),
    _m("async-multi-process", "engine: async scheduling", "jaxpaged/config.py",
       "async_scheduling=args.async_scheduling is not False and args.num_processes == 1,",
       "async_scheduling=args.async_scheduling is not False,",
       "tests/test_parallel.py::test_two_processes_serve_like_tp1"),
    # ---- speculative decoding (jaxpaged/spec_decode/ngram.py) -----------------------------------------------------
    _m("spec-drafts-no-prefill-slot", "engine: speculative decoding", "jaxpaged/core/scheduler.py",
       "if not drafts or not self._prefill_slot_free(1 + len(drafts)) or \\\n",
       "if not drafts or \\\n",
       SPEC_SCHED + "test_drafts_take_a_partial_prefill_slot_and_fit_the_budget",
       SPEC_SCHED + "test_drafts_never_delay_a_prompt"),
    _m("spec-drafts-without-pages", "engine: speculative decoding", "jaxpaged/core/scheduler.py",
       "                    self.pool.allocate(request, len(drafts)) is None:", "                    False:",
       SPEC_SCHED + "test_drafts_without_pages_are_dropped_before_anyone_is_preempted"),
    _m("spec-drafts-before-prompts", "engine: speculative decoding", "jaxpaged/core/scheduler.py",
       "            budget = self._schedule_waiting(budget, scheduled)\n"
       "            budget = self._schedule_drafts(budget, scheduled, drafting)\n",
       "            budget = self._schedule_drafts(budget, scheduled, drafting)\n"
       "            budget = self._schedule_waiting(budget, scheduled)\n",
       SPEC_SCHED + "test_drafts_never_delay_a_prompt"),
    _m("spec-drafts-beyond-bucket-padding", "engine: speculative decoding", "jaxpaged/core/scheduler.py",
       "if not self.config.token_buckets or (len(drafting)", "if True or (len(drafting)",
       SPEC_SCHED + "test_beside_a_request_without_drafts_drafts_only_fill_the_bucket_padding"),
    _m("spec-drafts-exempt-when-some-cannot-fit", "engine: speculative decoding", "jaxpaged/core/scheduler.py",
       "len(drafting) == len(scheduled) <= slots and\n"
       "                                             sum(len(drafts) for _, _, drafts in drafting) <= budget)",
       "len(drafting) == len(scheduled))",
       SPEC_SCHED + "test_when_some_drafts_cannot_fit_the_others_only_fill_the_bucket_padding"),
    _m("spec-rejected-not-rolled-back", "engine: speculative decoding", "jaxpaged/core/scheduler.py",
       "                    self._roll_back_rejected(request, entry, len(token_ids))", "                    pass",
       SPEC_SCHED + "test_rejected_drafts_roll_back_computed_tokens_pages_and_hashes",
       SPEC_SCHED + "test_random_workloads_with_drafts_finish_with_reference_outputs"),
    _m("spec-rejected-pages-kept", "engine: speculative decoding", "jaxpaged/core/scheduler.py",
       "        self.pool.truncate(request, request.num_computed_tokens)\n", "",
       SPEC_SCHED + "test_rejected_drafts_roll_back_computed_tokens_pages_and_hashes"),
    _m("spec-room-ignored", "engine: speculative decoding", "jaxpaged/engine/drafting.py",
       "self.proposer.propose(request.all_token_ids, room) if matcher is None",
       "self.proposer.propose(request.all_token_ids) if matcher is None",
       SPEC + "test_drafts_stay_within_max_model_len"),
    _m("spec-step-time-from-too-few-samples", "engine: speculative decoding", "jaxpaged/spec_decode/ngram.py",
       "        if len(times) >= self.MIN_SAMPLES:\n", "        if True:\n",
       SPEC + "test_step_times_are_medians_and_never_fall_with_rows"),
    _m("spec-penalties-without-drafts", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "history = list(history) + list(before) + [t for t in drafts[:j] if t >= 0]",
       "history = list(history) + list(before)",
       SPEC + "test_logprobs_and_penalties_are_those_without_speculation"),
    _m("spec-banned-ids-of-first-position", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "return entry.banned_token_ids if j == 0 else entry.spec_banned_token_ids[j - 1]",
       "return entry.banned_token_ids",
       SPEC + "test_stops_and_lengths_cut_accepted_drafts"),
    _m("spec-key-not-advanced", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "step=entry.num_output_tokens + j,", "step=entry.num_output_tokens,",
       SPEC + "test_seeded_sampling_is_identical_and_batch_independent_with_speculation"),
    _m("spec-grammar-drafts-unchecked", "engine: speculative decoding", "jaxpaged/engine/drafting.py",
       "del drafts[matcher.valid_prefix(drafts):]", "pass",
       SPEC + "test_structured_outputs_with_speculation_are_those_without"),
    _m("spec-grammar-drafts-unmasked", "engine: speculative decoding", "jaxpaged/engine/grammar.py",
       "rows.append((matcher, entry.spec_token_ids, [*range(draft_row, draft_row + d), i]))",
       "rows.append((matcher, (), [i]))",
       SPEC + "test_structured_outputs_with_speculation_are_those_without"),
    _m("spec-grammar-packed-drafts-unmasked", "engine: speculative decoding", "jaxpaged/worker/model_runner.py",
       "token_bitmask=_pad_bitmask(grammar_bitmask, S, rows),",
       "token_bitmask=_pad_bitmask(grammar_bitmask, S, len(entries)),",
       SPEC + "test_structured_outputs_with_speculation_are_those_without"),
    _m("spec-grammar-unpacked-drafts-unmasked", "engine: speculative decoding", "jaxpaged/worker/model_runner.py",
       "token_bitmask=_draft_bitmask(layout, grammar_bitmask))", "token_bitmask=None)",
       SPEC + "test_structured_outputs_with_speculation_are_those_without"),
    _m("spec-disable-by-batch-size-ignored", "engine: speculative decoding", "jaxpaged/engine/drafting.py",
       "return limit is not None and self.scheduler.num_running", "return False and self.scheduler.num_running",
       SPEC + "test_no_drafts_while_more_requests_are_enqueued_than_disable_by_batch_size"),
    _m("spec-async-always-waits", "engine: speculative decoding", "jaxpaged/engine/llm_engine.py",
       "if previous is None or self._drafts_likely():", "if True:",
       SPEC + "test_async_scheduling_overlaps_verifications_it_can"),
    _m("spec-async-no-room-forgotten", "engine: speculative decoding", "jaxpaged/engine/llm_engine.py",
       "batch, min(2 ** self._no_room_streak, NO_ROOM_MAX_WAIT)", "batch, 0",
       SPEC + "test_async_scheduling_overlaps_verifications_it_can"),
    _m("spec-overlap-positions-not-moved", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "shift = jnp.where(shifts >= 0, rejected[jnp.maximum(shifts, 0)], 0)  # i32[T]",
       "shift = jnp.zeros_like(shifts)  # i32[T]",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing",
       "tests/test_model_runner.py::test_fill_in_flight_moves_a_sequence_back_by_its_rejected_drafts"),
    _m("spec-overlap-carries-the-bonus-row", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "token = jnp.where(num_accepted < num_drafts, draft_token_ids[at], main)", "token = main",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing",
       "tests/test_model_runner.py::test_carry_tokens_takes_each_verifications_first_rejection_or_bonus"),
    _m("spec-overlap-rollback-from-start", "engine: speculative decoding", "jaxpaged/core/scheduler.py",
       "request.num_computed_tokens -= 1 + len(entry.spec_token_ids) - num_emitted",
       "request.num_computed_tokens = entry.start_position + num_emitted",
       SPEC_SCHED + "test_a_step_after_a_verification_in_flight_is_rolled_back_when_its_outcome_arrives",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-fused-drafts-unpacked", "engine: speculative decoding", "jaxpaged/worker/model_runner.py",
       "num_slots = num_logits_rows if self.fuse_sampler and num_logits_rows <= self.config.max_num_seqs else n",
       "num_slots = n",
       "tests/test_fused_step.py::test_packed_drafts_are_verified_in_the_step_program"),
    _m("spec-overlap-min-tokens-rows-overlap", "engine: speculative decoding", "jaxpaged/engine/drafting.py",
       "return self.overlap_verification and request.num_output_tokens >= request.sampling_params.min_tokens and",
       "return self.overlap_verification and",
       SPEC + "test_async_scheduling_overlaps_verifications_it_can"),
    _m("spec-overlap-accepted-not-counted", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "return jnp.concatenate([fed, before], axis=1)", "return jnp.concatenate([fed, before * 0 - 1], axis=1)",
       "tests/test_model_runner.py::test_outputs_in_flight_are_what_the_host_counts_lack",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-fed-drafts-not-counted", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "at = token_index[:, None] - jnp.arange(k + 1)[None]", "at = token_index[:, None] - 0 * jnp.arange(k + 1)[None]",
       "tests/test_model_runner.py::test_outputs_in_flight_are_what_the_host_counts_lack",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-placeholder-not-counted", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "count_from[:num_rows] = np.where(sources[first] >= 0, first, T)",
       "count_from[:num_rows] = np.where(sources[first] >= 0, first + 1, T)",
       "tests/test_model_runner.py::test_outputs_in_flight_are_what_the_host_counts_lack",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-handled-rows-stale", "engine: speculative decoding", "jaxpaged/worker/dispatch.py",
       "            pending.layout = layout = _with_history(entries, layout, history)\n", "",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-unpacked-outcome-ignored", "engine: speculative decoding", "jaxpaged/worker/dispatch.py",
       "pending.layout = layout = _with_history(entries, layout, _in_flight_history(entries, layout, outcome))",
       "pass",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-outcome-without-token", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "outcome[e.request_id] = drafts + (int(tokens[row]),)", "outcome[e.request_id] = drafts",
       "tests/test_model_runner.py::test_penalised_draft_rows_count_the_outputs_in_flight_and_the_drafts_fed",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-host-drafts-counted", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "fed = outcome(), dict(zip(layout.request_ids, np.asarray(layout.verified_ids)))",
       "fed = outcome(), dict(zip(layout.request_ids, np.asarray(layout.draft_ids)))",
       "tests/test_model_runner.py::test_penalised_draft_rows_count_the_outputs_in_flight_and_the_drafts_fed"),
    _m("spec-policy-times-idle", "engine: speculative decoding", "jaxpaged/engine/llm_engine.py",
       "self._observe_step(out, max(flight.dispatched_at, self._last_handled), timed=bool(entries))",
       "self._observe_step(out, max(flight.dispatched_at, self._last_handled))",
       SPEC + "test_a_step_left_in_flight_while_the_engine_idles_is_not_timed"),
    _m("spec-overlap-keys-not-moved", "engine: speculative decoding", "jaxpaged/worker/step_program.py",
       "sample = in_step.sample_in_step(logits, batch, fed,", "sample = in_step.sample_in_step(logits, sampling, fed,",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-host-keys-not-moved", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "if self.shifts is None or not has_random_rows(batch):", "if True:",
       "tests/test_model_runner.py::test_key_steps_move_back_by_the_drafts_rejected_in_flight",
       SPEC + "test_async_scheduling_overlaps_verifications_it_can",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-unpacked-keys-not-moved", "engine: speculative decoding", "jaxpaged/worker/dispatch.py",
       "pending.drafts = self._verify_drafts(layout, None, hidden, top, pending=pending)",
       "pending.drafts = self._verify_drafts(layout, None, hidden, top)",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-fallback-keys-from-host", "engine: speculative decoding", "jaxpaged/sample/in_step.py",
       "out = _finish_random(state.logits, dataclasses.replace(batch, steps=state.steps), random_rows, state)",
       "out = _finish_random(state.logits, batch, random_rows, state)",
       SPEC + "test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing"),
    _m("spec-overlap-redraft-never", "engine: speculative decoding", "jaxpaged/spec_decode/verify.py",
       "proposed = rows >= 0  # bool[M]", "proposed = rows < -1  # bool[M]",
       SPEC + "test_drafts_of_rows_in_flight_are_proposed_on_the_device",
       "tests/test_model_runner.py::test_redraft_in_flight_proposes_the_drafts_of_every_slot_in_flight"),
    _m("spec-overlap-redraft-not-fed", "engine: speculative decoding", "jaxpaged/worker/in_flight.py",
       "write = redraft.proposed[:, None] & (redraft.drafts >= 0)",
       "write = redraft.proposed[:, None] & (redraft.drafts < -1)",
       SPEC + "test_drafts_of_rows_in_flight_are_proposed_on_the_device",
       "tests/test_model_runner.py::test_redraft_in_flight_proposes_the_drafts_of_every_slot_in_flight"),
    _m("spec-overlap-drafts-fed-miscounted", "engine: speculative decoding", "jaxpaged/engine/drafting.py",
       "num_drafts = result.num_draft_tokens[entry.request_id]", "num_drafts = len(entry.spec_token_ids)",
       SPEC + "test_drafts_of_rows_in_flight_are_proposed_on_the_device"),
    _m("spec-overlap-redraft-past-host-drafts", "engine: speculative decoding", "jaxpaged/spec_decode/verify.py",
       "fed_again = (previous_slots < X) & previous.proposed[slot]", "fed_again = previous_slots < -1",
       SPEC + "test_drafts_of_rows_in_flight_are_proposed_on_the_device",
       "tests/test_model_runner.py::test_redraft_in_flight_proposes_the_drafts_of_every_slot_in_flight"),
    _m("spec-overlap-slots-forever", "engine: speculative decoding", "jaxpaged/engine/drafting.py",
       "if found or request.spec_reserve_left <= 0:", "if found:",
       SPEC + "test_a_copy_that_breaks_keeps_its_draft_slots_for_a_while"),
    _m("spec-overlap-redraft-as-if-all-accepted", "engine: speculative decoding", "jaxpaged/spec_decode/verify.py",
       "sequence = history.at[jnp.arange(M), known + accepted].set(token)",
       "sequence = history.at[jnp.arange(M), known + num_previous].set(token)",
       SPEC + "test_drafts_of_rows_in_flight_are_proposed_on_the_device",
       "tests/test_model_runner.py::test_redraft_in_flight_proposes_the_drafts_of_every_slot_in_flight"),
    _m("spec-overlap-abandoned-drafts-kept", "engine: speculative decoding", "jaxpaged/engine/llm_engine.py",
       "request.num_output_placeholders = request.num_draft_placeholders = 0",
       "request.num_output_placeholders = 0",
       SPEC + "test_a_failed_verification_in_flight_leaves_a_request_preempted_since_to_go_on"),
    _m("spec-mixed-batch-slowed", "engine: speculative decoding", "jaxpaged/spec_decode/ngram.py",
       "        if without_drafts:  # seconds never falls", "        if False:  # seconds never falls",
       SPEC + "test_a_decode_without_drafts_is_not_slowed_by_verifications"),
    _m("spec-drafts-always-accepted", "engine: speculative decoding", "jaxpaged/spec_decode/verify.py",
       "return jnp.sum(jnp.cumprod(match, axis=1), axis=1)", "return jnp.sum(jnp.ones_like(match), axis=1)",
       SPEC + "test_sampling_distribution_is_the_models"),
    _m("fused-host-floats-read-as-ints", "engine: fused step inputs", "jaxpaged/worker/step_input.py",
       '        if dtype != "i":  # int32\'s character', "        if False:",
       "tests/test_step_input.py::test_unpacked_tree_equals_the_host_tree_bit_for_bit",
       "tests/test_fused_step.py::test_fused_equals_unfused"),
    _m("fused-host-layout-ignored", "engine: fused step inputs", "jaxpaged/worker/step_input.py",
       "        if (wanted is None or wanted[i] is not None) and isinstance(", "        if isinstance(",
       "tests/test_step_input.py::test_a_compiled_layout_decides_what_is_packed",
       "tests/test_fused_step.py::test_no_compilation_after_warmup"),
    _m("fused-qkv-k-v-swapped", "engine: weight layout", "jaxpaged/models/params.py",
       "return xp.concatenate([q, wk[..., None, :], wv[..., None, :]], axis=-2)",
       "return xp.concatenate([q, wv[..., None, :], wk[..., None, :]], axis=-2)",
       "tests/test_weight_layout.py::test_every_layout_gives_the_same_logits_and_pool"),
    _m("layout-converted-from-any", "engine: weight layout", "jaxpaged/worker/weight_layout.py",
       "    if current != WeightLayout():\n", "    if False:\n",
       "tests/test_weight_layout.py::test_conversion_shapes_ownership_and_refusals"),
    _m("auto-keeps-the-scan", "engine: weight layout", "jaxpaged/worker/weight_layout.py",
       'PER_LAYER_PLATFORMS = ("cpu", "gpu", "cuda", "rocm")', "PER_LAYER_PLATFORMS = ()",
       "tests/test_weight_layout.py::test_resolve_weight_layout",
       "tests/test_weight_layout.py::test_cuda_lowering_of_the_gpu_default_has_no_weight_slices"),
)


# Mutations known to survive, with why (docs/security.md, "Surviving, and why"). A fix removes its entry;
# the slow test fails on any other survivor and on an entry here that is killed.
KNOWN_SURVIVORS = {
    "disconnect-stream-no-abort": "sse_stream's finally aborts too; the storm's requests finish on their own",
    "disconnect-poll-no-abort": "Submitted.outputs' finally aborts too; the storm's requests finish on their own",
}


# ---------------------------------------------------------------------------------------------- running


def check_anchors(root: Path = ROOT, mutations=MUTATIONS) -> list[str]:
    """Problems: anchors that do not match exactly once, replacements that do not compile, duplicate names."""
    problems = []
    names = [m.name for m in mutations]
    problems += [f"duplicate mutation name {n!r}" for n in sorted({n for n in names if names.count(n) > 1})]
    for m in mutations:
        path = root / m.path
        if not path.is_file():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        try:
            mutated = m.apply(path.read_text())
            compile(mutated, m.path, "exec")
        except AnchorError as err:
            problems.append(str(err))
        except SyntaxError as err:
            problems.append(f"{m.name}: the mutated {m.path} does not compile: {err}")
        for test in m.tests:
            file, _, func = test.partition("::")
            if not (root / file).is_file():
                problems.append(f"{m.name}: test file {file} does not exist")
            elif func and f"def {func}(" not in (root / file).read_text():
                problems.append(f"{m.name}: no test {func} in {file}")
    return problems


def copy_tree(root: Path, dest: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files (what the run tool also copies)."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_pytest(tree: Path, tests, timeout: float) -> tuple[str, float, str]:
    """(verdict, seconds, last output line): pass / fail / timeout / error(rc)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *PYTEST, *tests], cwd=tree, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, f"no result within {timeout:.0f} s"
    seconds = time.monotonic() - start
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    last = lines[-1] if lines else proc.stderr.strip()[-200:]
    verdict = {0: "pass", 1: "fail"}.get(proc.returncode, f"error(rc={proc.returncode})")
    return verdict, seconds, last


def run(mutations, timeout: float, baseline: bool, log) -> list[dict]:
    problems = check_anchors(ROOT, mutations)
    if problems:
        raise SystemExit("mutation check: " + "; ".join(problems))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as scratch:
        tree = Path(scratch)
        copy_tree(ROOT, tree)
        if baseline:
            tests = sorted({t for m in mutations for t in m.tests})
            verdict, seconds, last = run_pytest(tree, tests, timeout * 3)
            log(f"baseline (unmutated, {len(tests)} test selections): {verdict} in {seconds:.0f} s: {last}")
            if verdict != "pass":
                raise SystemExit("mutation check: the named tests fail without any mutation")
        for m in mutations:
            original = (tree / m.path).read_text()
            (tree / m.path).write_text(m.apply(original))
            try:
                verdict, seconds, last = run_pytest(tree, m.tests, timeout)
            finally:
                (tree / m.path).write_text(original)
            result = {"pass": "SURVIVED", "fail": "killed", "timeout": "killed (timeout)"}.get(verdict, verdict)
            rows.append(dict(mutation=m, result=result, seconds=seconds, detail=last))
            log(f"{m.name:28s} {result:16s} {seconds:6.0f} s  {last[:110]}")
    return rows


def markdown(rows) -> str:
    out = ["| mutation (guard removed) | guard | file | killed by | result | s |", "|---|---|---|---|---|---|"]
    for r in rows:
        m = r["mutation"]
        tests = ", ".join(f"`{t.removeprefix('tests/').replace('reliability/', '')}`" for t in m.tests)
        out.append(f"| `{m.name}` | {m.guard} | `{m.path}` | {tests} | {r['result']} | {r['seconds']:.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-anchors", action="store_true", help="only check that every anchor matches once")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", default=None, help="comma-separated mutation names")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutation's test run")
    parser.add_argument("--markdown", default=None, help="write the result table (markdown) here")
    args = parser.parse_args(argv)
    mutations = MUTATIONS
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {m.name for m in MUTATIONS}
        if unknown:
            parser.error(f"unknown mutations: {sorted(unknown)}")
        by_name = {m.name: m for m in MUTATIONS}
        mutations = tuple(by_name[name] for name in wanted)  # in the order given
    if args.list:
        for m in mutations:
            print(f"{m.name:28s} {m.guard:45s} {m.path}")
        return 0
    if args.check_anchors:
        problems = check_anchors(ROOT, mutations)
        print("\n".join(problems) or f"all {len(mutations)} anchors match exactly once")
        return 1 if problems else 0
    start = time.monotonic()
    rows = run(mutations, args.timeout, not args.no_baseline, lambda s: print(s, flush=True))
    table = markdown(rows)
    survived = [r["mutation"].name for r in rows if r["result"] != "killed" and not r["result"].startswith("killed")]
    summary = (f"{len(rows) - len(survived)} of {len(rows)} mutations killed in {time.monotonic() - start:.0f} s"
               + (f"; not killed: {', '.join(survived)}" if survived else ""))
    print(table + "\n\n" + summary)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n\n" + summary + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())

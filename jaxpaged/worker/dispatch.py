"""Async scheduling's dispatch: a step packed and launched before the previous step's tokens reach the host.

Async scheduling (the engine's overlapped loop) splits `ModelRunner.execute_model` in three:
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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np

from jaxpaged.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxpaged.sample import in_step
from jaxpaged.sample.sampler import sample_deferred
from jaxpaged.spec_decode.verify import DraftRows, Redraft, _check_bitmask, redraft_in_flight
from jaxpaged.worker.in_flight import (
    PendingStep,
    _count_from,
    _in_flight_history,
    _outcome_in_flight,
    _placeholder_sources,
    _shift_rows,
    _with_history,
    fill_in_flight_jit,
    merge_sampled_tokens,
)
from jaxpaged.worker.runner_output import prompt_logprob_spans, prompt_targets
from jaxpaged.worker.step_input import GrammarBitmask, StepInput
from jaxpaged.worker.step_program import prompt_logprobs_step


class AsyncDispatch:
    """ModelRunner's methods for async dispatch: they share its state (see ModelRunner.__init__)."""

    def dispatch(self, scheduler_output: SchedulerOutput, previous: PendingStep | None) -> PendingStep:
        """Pack the step, fill its placeholder tokens on the device from `previous` (the step dispatched just
        before, whose sampled tokens the host has not seen), dispatch the forward. Nothing waits.
        With the fused sampler the step's sampler is dispatched here too, in the same program."""
        if self.multi_process:
            raise RuntimeError("async scheduling needs the step's tokens on the host of every process: "
                               "multi-process runs take the synchronous loop")
        entries = scheduler_output.scheduled_requests
        self.remove_requests(scheduler_output)
        step, rows = self.pack(entries)
        layout = self._layout_drafts(entries, step) if any(e.spec_token_ids for e in entries) else None
        sources = _placeholder_sources(entries, step, previous, rows) if any(e.placeholder for e in entries) else None
        shifts = None if sources is None else _shift_rows(entries, step, previous)

        def carry() -> tuple:
            """`PendingStep.carry` of previous: waits for its forward where it has random rows (their sampler
            flags), so this step takes it once the host work that needs none of it is done."""
            return (None, None, None) if sources is None else previous.carry(self.config.seq_buckets[-1])

        layout, redraft = self._redraft(entries, step, layout, previous, carry) if sources is not None else \
            (layout, None)
        if self.fuse_sampler:
            pending = self._dispatch_fused(entries, rows, step, layout, sources, carry, shifts, redraft, previous)
        else:
            pending = self._dispatch_unfused(entries, rows, step, layout, sources, carry, shifts, redraft)
        pending.scheduler_output = scheduler_output
        return pending

    def _dispatch_unfused(self, entries: Sequence[ScheduledRequest], rows: np.ndarray, step: StepInput,
                          layout: DraftRows | None, sources: np.ndarray | None, carry: Callable[[], tuple],
                          shifts: np.ndarray | None, redraft: Redraft | None) -> PendingStep:
        """`dispatch`'s forward alone (the sampler separate, `dispatch_sample`): placeholders filled, positions
        moved back after a verification in flight, on the device."""
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
                           rejected=carried[1], batch_rows=rows)

    def _redraft(self, entries: Sequence[ScheduledRequest], step: StepInput, layout: DraftRows | None,
                 previous: PendingStep, carry: Callable[[], tuple]) -> tuple[DraftRows | None, Redraft | None]:
        """With RunnerConfig.prompt_lookup: the drafts of `layout`'s slots fed after a placeholder (their request's
        step, `previous`, in flight: the host reserved their count only) proposed on the device from that step's
        real outcome (`redraft_in_flight`). Returns (the layout with the drafts it verifies, `redrafted`; the Redraft
        to feed), or (layout, None) when no slot follows a placeholder. carry: `previous.carry` (called only then)."""
        lookup = self.config.prompt_lookup
        if layout is None or lookup is None:
            return layout, None
        index = {e.request_id: i for i, e in enumerate(entries)}
        in_flight = [(m, entries[index[rid]]) for m, rid in enumerate(layout.request_ids)
                     if entries[index[rid]].placeholder]
        if not in_flight:
            return layout, None
        fed = {e.request_id: e.spec_token_ids for e in previous.entries}  # the drafts in flight
        known = [list(e.prompt_token_ids) + list(e.output_token_ids) for _, e in in_flight]
        width = max(len(c) + len(fed.get(e.request_id, ())) + 1 for c, (_, e) in zip(known, in_flight))
        M, H = len(layout.draft_ids), next(b for b in self.config.history_buckets if b >= width)
        history = np.zeros((M, H), np.int32)  # i32[M, H]: known tokens, then the drafts in flight
        lengths = np.zeros((3, M), np.int32)  # per slot: known tokens, drafts in flight, its fed token's index
        rows = np.full(M, -1, np.int32)
        previous_slots = np.full(M, self._redraft_slots, np.int32)  # i32[M]: the slot in previous' Redraft
        slot_before = {} if previous.layout is None else {rid: m for m, rid in enumerate(previous.layout.request_ids)}
        for (m, e), tokens in zip(in_flight, known):
            drafts = fed.get(e.request_id, ())
            history[m, :len(tokens)], history[m, len(tokens):len(tokens) + len(drafts)] = tokens, drafts
            lengths[:, m] = len(tokens), len(drafts), step.cu_q_lens[index[e.request_id]]
            rows[m], previous_slots[m] = previous.rows[e.request_id], slot_before.get(e.request_id, previous_slots[m])
        tokens, rejected, _ = carry()
        before = previous.redraft or self._no_redraft
        draft_ids, redraft = redraft_in_flight(layout.draft_ids, history, lengths[0], lengths[1], rows, tokens,
                                               self._zeros_r if rejected is None else rejected, lengths[2], before,
                                               previous_slots, self._redraft_slots, lookup)
        return dataclasses.replace(layout, redrafted=draft_ids), redraft

    def _dispatch_fused(self, entries: Sequence[ScheduledRequest], rows: np.ndarray, step: StepInput,
                        layout: DraftRows | None, sources: np.ndarray | None, carry: Callable[[], tuple],
                        shifts: np.ndarray | None, redraft: Redraft | None = None,
                        previous: PendingStep | None = None) -> PendingStep:
        """`dispatch` as one program, its sampler rows known now (penalties count the tokens in flight on the
        device: `outputs_in_flight`). A step with a constrained row (its grammar mask needs the previous step's
        token on the host) or a fault injector runs the program's forward only; `dispatch_sample` then samples
        separately. carry: `previous.carry`, called once the host's inputs are built: where the previous step has
        random rows it waits for that step's forward (its sampler flags), so the host work before it overlaps the
        device's."""
        if self.fault_injector is not None or (self.input_batch.any_flag(self.input_batch.constrained, rows) and any(
                e.samples and e.sampling_params.structured_outputs is not None for e in entries)):
            tokens, rejected, _ = carry()
            logits, hidden = self._forward(step, sources, tokens, rejected, shifts, redraft)
            return PendingStep(entries, step, logits, hidden, layout=layout, redraft=redraft, shifts=shifts,
                               rejected=rejected, batch_rows=rows)
        # the device counts what the lists lack (only rows with drafts have a history: none without a layout)
        history = _in_flight_history(entries, layout, None) if layout is not None else {}
        if history and layout is not None and layout.packed:
            layout = _with_history(entries, layout, history)
        batch, top = self._sampling_batch(entries, rows, step, layout, None, history, fused=True)
        num_rows = len(entries) + (len(layout.rows) if layout is not None and layout.packed else 0)
        count_from = None if sources is None else _count_from(step, sources, num_rows)
        carried = carry()  # the wait, if any, after the sampler's rows are built
        tokens, rejected, accepted = carried
        (sample, num_accepted, next_tokens), hidden = self._run_fused(
            step, self._step_sampling(batch, step, layout=layout, sources=sources, previous=tokens,
                                      rejected=rejected, shifts=shifts, redraft=redraft, accepted=accepted,
                                      count_from=count_from))
        pending = PendingStep(entries, step, None, hidden, batch=batch, num_top_logprobs=top, layout=layout,
                              redraft=redraft, shifts=shifts, rejected=rejected, batch_rows=rows,
                              fused_sample=sample, num_accepted=num_accepted, fused_tokens=next_tokens)
        if layout is not None and not layout.packed:  # random or penalised rows after a verification in flight: wait
            outcome = None if sources is None else functools.partial(_outcome_in_flight, previous, carried, entries)
            pending.layout = layout = _with_history(entries, layout, _in_flight_history(entries, layout, outcome))
            pending.drafts = self._verify_drafts(layout, None, hidden, top, pending=pending)
        return pending

    def dispatch_sample(self, pending: PendingStep, grammar_bitmask: GrammarBitmask | None = None) -> None:
        """Dispatch the sampler (and prompt log-probs) of a dispatched step: execute_model's second half.
        A fused step sampled in its own program: only its fallbacks are left (run by `pending.result`)."""
        entries, layout = pending.entries, pending.layout
        if pending.fused_sample is not None:
            pending.finish_sample = in_step.finish_in_step(pending.fused_sample, pending.batch,
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
            batch, top = self._sampling_batch(entries, pending.batch_rows, pending.step, layout, grammar_bitmask,
                                              history)
            batch = pending.key_steps(batch, pending.step.logits_indices)
            pending.finish_sample = sample_deferred(logits, batch, num_top_logprobs=top)
            if layout is not None and not layout.packed:  # the draft rows' own pass, from the hidden states
                pending.drafts = self._verify_drafts(layout, None, pending.hidden, top, grammar_bitmask, pending)
        kept = self.input_batch  # (a pass over the entries only when some row asks for prompt log-probs)
        spans = prompt_logprob_spans(entries) if pending.batch_rows is None or kept.any_flag(
            kept.prompt_lp, pending.batch_rows) else {}
        if spans:
            pending.prompt_spans = spans
            pending.prompt_arrays = prompt_logprobs_step(self.model_config, self.params, pending.hidden,
                                                         prompt_targets(spans, len(pending.step.token_ids)),
                                                         batch_invariant=self.invariant_head)
        pending.logits = pending.hidden = None  # the sampler has what it needs: let the device free them

"""Steps in flight under async scheduling: a dispatched step, and the next one packed before its tokens arrive.

`PendingStep` is a dispatched step whose device work may still run. The next step is packed on the host with
placeholder tokens (and, after a verification, as if every draft were accepted); `fill_in_flight` puts the real
tokens in and moves positions, slots and KV lengths back on the device, so no step waits on the host. The
sampler rows of a step (`sampling_row`) are made here too, with the history a row in flight has on the device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.core.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from jaxpaged.sample.sampler import SamplerOutput, fetch
from jaxpaged.sample.sampling_batch import RowInfo, SamplingBatch
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.spec_decode.verify import DraftRows, Redraft, VerifiedDrafts, verify_packed
from jaxpaged.worker.runner_output import ModelRunnerOutput, split_prompt_logprobs
from jaxpaged.worker.step_input import StepInput, has_random_rows, pad_sampled_tokens


@dataclasses.dataclass(eq=False)
class PendingStep:
    """A step dispatched by `ModelRunner.dispatch` (async scheduling); its device work may still run. The
    engine keeps it as its step in flight (the one record of the step across the engine/runner seam): the
    scheduler output it runs, each entry's Request as scheduled, when it was dispatched.

    Sampler row r is entry r (rows past the entries are padding); `rows` maps the entries that sample."""

    entries: tuple[ScheduledRequest, ...]
    step: StepInput  # host arrays, but token_ids: on the device when placeholders were filled
    logits: jax.Array | None  # f32[S, V]; dropped once the sampler is dispatched
    hidden: jax.Array | None  # [T, E]; idem
    finish_sample: Callable[[], SamplerOutput] | None = None  # set by dispatch_sample (sampler.sample_deferred)
    # the fused program's sampling results, on device (ModelRunner._dispatch_fused; `step_program.FusedSample`):
    fused_sample: SamplerOutput | None = None  # the sampler's unfinished output (before its rare fallbacks)
    num_accepted: jax.Array | None = None  # i32[S]: slot m's accepted drafts, valid when no fallback changed a token
    fused_tokens: jax.Array | None = None  # i32[R]: its sampled ids zero-padded, the next step's previous_tokens
    batch: SamplingBatch | None = None  # the fused step's host batch (its fallbacks read it)
    num_top_logprobs: int = 0  # the fused step's (its finish adds the top log-probs when > 0)
    sampled: SamplerOutput | None = None  # finish_sample's result, once called (`sampler_output`)
    prompt_spans: dict | None = None  # prompt_logprob_spans(entries) when some entry asks
    prompt_arrays: tuple | None = None  # prompt_logprobs_step's device outputs over the spans
    layout: DraftRows | None = None  # speculative decoding: where the step verifies its drafts
    redraft: Redraft | None = None  # ... those the device proposed (`redraft_in_flight`)
    drafts: VerifiedDrafts | None = None  # their verification, on device (set once the sampler's output is)
    carried: tuple[jax.Array, jax.Array, jax.Array] | None = None  # `carry`'s result, once called
    shifts: np.ndarray | None = None  # i32[T]: `_shift_rows`, when a verification was in flight at dispatch
    rejected: jax.Array | None = None  # i32[R]: its drafts rejected per row (its `carry`), with shifts
    batch_rows: np.ndarray | None = None  # intp[n]: the entries' rows of the persistent batch (`ModelRunner.pack`)
    scheduler_output: SchedulerOutput | None = None  # the output it runs (its scheduled_requests are `entries`)
    dispatched_at: float = 0.0  # the engine's (LLMEngine._dispatch_async): time.perf_counter() once dispatched

    @functools.cached_property
    def rows(self) -> dict[str, int]:
        return {e.request_id: i for i, e in enumerate(self.entries) if e.samples}

    def sampler_row_of(self, batch_rows: np.ndarray) -> np.ndarray:
        """i64[N]: the sampler row each of the persistent batch's rows `batch_rows` intp[N] had in this step (its
        entries' rows: `batch_rows` the field), -1 where none sampled."""
        table = self._sampler_rows
        inside = batch_rows < len(table)
        return np.where(inside, table[np.where(inside, batch_rows, 0)], -1) if len(table) else \
            np.full(len(batch_rows), -1, np.int64)

    @functools.cached_property
    def _sampler_rows(self) -> np.ndarray:
        """i64[max batch row + 1]: each batch row's sampler row in this step, -1 where none (`sampler_row_of`)."""
        if self.batch_rows is None:
            raise RuntimeError("the step's rows of the persistent batch are unknown (PendingStep.batch_rows)")
        table = np.full(int(self.batch_rows.max(initial=-1)) + 1, -1, np.int64)
        if len(self.rows) == len(self.entries):  # every entry samples (a decode step): sampler row i is entry i
            table[self.batch_rows] = np.arange(len(self.batch_rows))
        else:
            index = np.fromiter(self.rows.values(), np.int64, len(self.rows))
            table[self.batch_rows[index]] = index
        return table

    def sampler_output(self) -> SamplerOutput:
        """The sampler's device output, its fallbacks dispatched (reads the sampler's flags: the host waits
        for the step's forward here, and only here, when some row samples at random)."""
        if self.sampled is None:
            if self.finish_sample is None:
                raise RuntimeError("the step's sampler was never dispatched (ModelRunner.dispatch_sample)")
            self.sampled, self.finish_sample = self.finish_sample(), None
            if self.layout is not None and self.drafts is None:  # packed drafts: counted on the final tokens
                self.drafts = verify_packed(self.layout, self.sampled, self.fused_sample, self.num_accepted)
        return self.sampled

    def result(self) -> ModelRunnerOutput:
        """The step's sampled tokens on the host (waits for the device)."""
        sampled = self.sampler_output()
        prompt = {}
        if self.prompt_spans:
            prompt = split_prompt_logprobs(self.prompt_spans, jax.device_get(self.prompt_arrays))
        drafts = None if self.drafts is None else self.drafts.to_host()
        return ModelRunnerOutput.from_rows(self.rows, sampled, prompt, drafts)

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
        if self.fused_sample is not None and sampled.token_ids is self.fused_sample.token_ids:
            return self.fused_tokens
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


def fill_in_flight(step: StepInput, tokens: jax.Array, rejected: jax.Array, sources: jax.Array,
                   shifts: jax.Array, page_size: int, redraft: Redraft | None = None) -> StepInput:
    """The step with what the previous step (still in flight when it was packed) decided, on the device:
    each placeholder token (sources i32[T] >= 0) becomes tokens[sources]; each token of a sequence that follows
    a verification in flight (shifts i32[T] >= 0: that sequence's row there) moves back by rejected[shifts]
    positions (the host packed it as if every draft were accepted): positions, slots (from the page table)
    and the sequence's kv_lens; the drafts the device proposed (`redraft`) are fed in place of the host's slots.
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
    write = redraft.proposed[:, None] & (redraft.drafts >= 0)
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
    (`in_step.sample_in_step` counts them; in the fused step, dispatched before the step in flight is handled):
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


def _placeholder_sources(entries: Sequence[ScheduledRequest], step: StepInput, previous: PendingStep | None,
                         rows: np.ndarray) -> np.ndarray:
    """i32[T]: the previous step's sampler row of each placeholder token, else -1. rows: the entries' rows of the
    persistent batch (`ModelRunner.pack`'s); a request keeps its row from the previous step to this one (rows go
    only with requests finished or preempted, which feed no placeholder), so the sources come out of two indexings,
    not a lookup per entry."""
    if previous is None:
        raise RuntimeError("placeholder tokens need the previous step, dispatched with its sampler")
    sources = np.full(len(step.token_ids), -1, np.int32)
    first = step.cu_q_lens[:len(entries)]  # i32[n]: each entry's first fed token (a placeholder's place)
    fed = np.flatnonzero(step.token_ids[first] == PLACEHOLDER_TOKEN_ID)  # the entries fed a placeholder
    source = previous.sampler_row_of(rows[fed])  # i64[len(fed)]: -1 where it sampled nothing there
    if len(source) and source.min() < 0:
        raise RuntimeError(f"request {entries[fed[np.argmin(source)]].request_id!r} feeds a placeholder but sampled "
                           "nothing in the previous step")
    sources[first[fed]] = source
    if not np.array_equal(sources >= 0, step.token_ids == PLACEHOLDER_TOKEN_ID):
        raise RuntimeError("placeholder tokens outside the placeholder entries' single token")
    return sources


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
    tokens, _, accepted = fetch(carried)
    outcome = {}
    for e in entries:
        if e.placeholder:
            row = previous.rows[e.request_id]
            drafts = () if accepted is None else tuple(int(t) for t in accepted[row] if t >= 0)
            outcome[e.request_id] = drafts + (int(tokens[row]),)
    return outcome

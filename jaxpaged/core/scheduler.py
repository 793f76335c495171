"""Scheduler: continuous batching with chunked prefill and preemption (vLLM v1 style).

One code path: each request has `num_computed_tokens` and a step hands out a
token budget (max_num_batched_tokens):

1. running requests, in admission order: whatever they have left to compute
   (1 token for a decode; min(remaining, budget) for a request still in
   prefill: chunked prefill). When the pool is out of pages the most recently
   admitted running request is preempted by recompute (its pages freed,
   num_computed_tokens reset to 0, outputs kept, put at the FRONT of the
   waiting queue) and the allocation retried; if that victim is the request
   itself, it stops there.
2. then, if nothing was preempted this step, waiting requests FCFS: a
   prefix-cache lookup sets num_computed_tokens to the hit (none for requests
   asking for prompt_logprobs: their whole prompt is fed), then a chunk of
   min(remaining, budget). A waiting request that can't get pages waits, and
   so do the ones behind it. `max_num_seqs` caps the number of running requests.

`max_num_partial_prefills` caps the requests fed more than one token in a step
(in either phase; a running request over the cap just waits a step), so that
attention can size its prefill tiles for a few sequences, not for all of them.

`num_computed_tokens` advances at SCHEDULE time (as in vLLM v1): after
`schedule()` it counts the tokens whose KV is in the pool or is written by the
step just scheduled, and the pages those tokens fill are registered in the
prefix cache right away, so a request scheduled later in the same step (the n
children of one prompt) can share them. Runner contract that follows: within a
step, the KV of every scheduled token is written to its slot before attention
reads the pages (per layer), as paged attention does in vLLM and nano-vllm.
`update_from_output()` only appends the sampled tokens and finishes requests.

Speculative decoding (jaxpaged/spec_decode/ngram.py): a decoding request may carry draft tokens
(`Request.spec_token_ids`, set by the engine's proposer before `schedule()`). It is then fed its
last token and the drafts in one chunk, and num_computed_tokens counts them all until
`update_from_output` learns how many were accepted: it rolls back to the accepted ones and frees
the pages past them. Drafts are never hashed into the prefix cache (hashing covers real tokens
only). Drafts are scheduled last (`_schedule_drafts`), from what the step's decodes and prefill
chunks left: the budget, the max_num_partial_prefills slots (attention tiles a verification like
a prefill chunk) and free pages; a request whose drafts don't fit decodes without them, and in a
step that preempts anyone nobody drafts. So a draft never delays another request's prompt or
decode and never preempts anyone. And when the step carries a request without drafts, drafts only
fill the rows its T bucket (`SchedulerConfig.token_buckets`) pads anyway, or up to
`memory_bound_tokens`: that request is not slowed (`_draft_room`).

Stopping has one owner: `update_from_output` ends every request that stops on a
sampled token (EOS, stop token ids, length: `Request.check_stop`; stop strings and
non-finite logits: the engine's verdicts, passed in), and `finish_requests` ends
the others (abort, error). Both write the one finish record (`Request.finish`:
status and stop_reason) and free the pages (`_release`).

Async scheduling (`SchedulerConfig.async_scheduling`, vLLM v1's AsyncScheduler):
the engine schedules step N+1 before step N's sampled tokens reach the host. A
chunk that samples adds one to the request's `num_output_placeholders`, so the
next `schedule()` sees one more token to compute: a decode entry whose one token
is a placeholder (`ScheduledRequest.placeholder`; `PLACEHOLDER_TOKEN_ID` in
token_ids), which the runner fills on the device from the previous step's
sampled tokens. `update_from_output` appends the real token and drops the
placeholder. So that nothing runs past its end or needs a token it cannot know:
  * a request whose placeholders already reach max_tokens or max_model_len is not
    scheduled again (it finishes by length when they arrive): no wasted slot, and
    no page beyond what admission counted;
  * a preempted request waits until its placeholders have arrived (FCFS: the
    queue behind it waits too), since its recompute feeds every token it has.
A request that stops (or is aborted) at step N has been scheduled at N+1: one
wasted slot, whose page is released with the others, once, when it finishes.
With speculative decoding a step in flight may verify drafts: they count as
`num_draft_placeholders` (computed, and known-or-placeholder tokens, as if all
accepted), so the next step feeds the placeholder at the position after them (the
runner moves it back on the device by those rejected) and may carry drafts of its
own (`_with_drafts`); `update_from_output` then rolls back the rejected ones from
num_computed_tokens, whatever was scheduled since.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from jaxpaged.core.page_pool import CachedPrefix, PagePool
from jaxpaged.core.request import Request, RequestStatus, StopVerdict
from jaxpaged.core.scheduler_config import SchedulerConfig
from jaxpaged.core.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from jaxpaged.errors import InvalidRequestError


class Scheduler:
    """The step planner (module docstring); `schedule` makes a `SchedulerOutput`, `update_from_output` applies a
    step's tokens."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.pool = PagePool(config.num_pages, config.page_size, config.enable_prefix_caching)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self._finished_ids: list[str] = []  # since the previous schedule()
        self.num_finished = 0  # requests finished so far (SchedulerOutput.num_finished)
        self._num_partial = 0  # the step being planned: its entries fed more than one token (`_prefill_slot_free`)

    # ---- counters ----------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def decoding_requests(self) -> list[Request]:
        """Running requests past their prefill (one token left to feed): who may speculate next step."""
        return [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # ---- admission and finishing ------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a fresh request; InvalidRequestError (param "prompt"; request untouched) if it could
        never be served, ValueError for an id in use or a request that is not fresh."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already queued")
        if request.status is not RequestStatus.WAITING or request.page_ids or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} is not fresh (status {request.status.name})")
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError(f"request {rid!r} has an empty prompt", "prompt")
        max_model_len = min(request.max_model_len or self.config.max_model_len, self.config.max_model_len)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - request.num_prompt_tokens
        if max_tokens < 1 or request.num_prompt_tokens + max_tokens > max_model_len:
            raise InvalidRequestError(
                f"request {rid!r}: prompt ({request.num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                f"exceeds max_model_len={max_model_len}", "prompt")
        # The last sampled token is never fed, so at most prompt + max_tokens - 1 slots.
        pages_needed = -(-(request.num_prompt_tokens + max_tokens - 1) // self.config.page_size)
        if pages_needed > self.pool.num_usable_pages:
            raise InvalidRequestError(
                f"request {rid!r} needs up to {pages_needed} KV pages "
                f"but the pool has {self.pool.num_usable_pages}", "prompt")
        request.max_model_len, request.max_output_tokens = max_model_len, max_tokens
        self._requests[rid] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Finish the requests with reason "abort" and free their pages at once."""
        return self.finish_requests(request_ids, "abort")

    def finish_requests(
        self, request_ids: str | Iterable[str], finish_reason: str, stop_reason: int | str | None = None
    ) -> list[Request]:
        """Finish unfinished requests from outside (stop strings, errors, aborts).

        finish_reason is "stop", "length", "abort" or "error"; unknown or already
        finished ids are ignored. Returns the requests finished by this call.
        """
        status = RequestStatus.from_finish_reason(finish_reason)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished = []
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is None:
                continue
            request.finish(status, stop_reason)
            self._release(request)
            finished.append(request)
        return finished

    def _release(self, request: Request) -> None:
        """Take a just-finished request (its finish record written) out of its queue and free its pages."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.pool.free(request)
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self.num_finished += 1

    # ---- scheduling --------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step; advances num_computed_tokens of every scheduled request (see module doc)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        drafting: list[tuple[int, Request, tuple[int, ...]]] = []  # (index in scheduled, request, its drafts)
        self._num_partial = 0
        budget = self._schedule_running(budget, scheduled, preempted, drafting)
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled)
            budget = self._schedule_drafts(budget, scheduled, drafting)
        finished, self._finished_ids = self._finished_ids, []
        requests = self._requests
        return SchedulerOutput(
            scheduled_requests=tuple(scheduled),
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=tuple(preempted),
            finished_request_ids=tuple(finished),
            requests=tuple([requests[entry.request_id] for entry in scheduled]),
            num_finished=self.num_finished,
        )

    def _chunk_size(self, num_remaining: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_remaining:
            num_remaining = threshold
        return min(num_remaining, budget)

    def _prefill_slot_free(self, num_new: int) -> bool:
        """Whether a chunk of num_new tokens fits under max_num_partial_prefills this step (a count kept as the
        step is planned: O(1) for each prefill candidate)."""
        cap = self.config.max_num_partial_prefills
        return num_new <= 1 or cap is None or self._num_partial < cap

    def _schedule_running(self, budget: int, scheduled: list, preempted: list, drafting: list) -> int:
        """Running requests in order: their next chunk (a decode: one token), preempting from the back of
        the queue when pages run out. A decode with drafts is noted in `drafting` (see `_schedule_drafts`).
        This loop runs for every running request every step: a plain decode (one token, its last page has room)
        takes no call but `_advance`. Its tokens: known ones, and (async scheduling) those sampled by dispatched
        steps, not appended yet, and their drafts as if accepted (the lists' lengths, not Request's properties)."""
        index, running, page_size, window = 0, self.running, self.config.page_size, self.config.sliding_window
        while index < len(running) and budget > 0:
            request = running[index]
            index += 1
            in_flight = request.num_output_placeholders
            num_left = len(request.prompt_token_ids) + len(request.output_token_ids) + in_flight + \
                request.num_draft_placeholders - request.num_computed_tokens
            num_new = 1 if num_left == 1 else self._chunk_size(num_left, budget)
            # 0: its sampled token hasn't come back yet; or its prefill waits for a free slot; or (async) the
            # placeholders in flight end it (max_tokens, max_model_len): scheduling it would waste a slot (and a
            # page admission never counted)
            if num_new == 0 or (num_new > 1 and not self._prefill_slot_free(num_new)) or \
                    (in_flight and len(request.output_token_ids) + in_flight >= request.max_output_tokens):
                continue
            if window is not None:
                self.pool.free_outside_window(request, window)
            if request.num_computed_tokens + num_new > len(request.page_ids) * page_size or not request.page_ids:
                while self.pool.allocate(request, num_new) is None:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        return budget
            if request.spec_token_ids and num_new == num_left == 1:  # a decode
                drafting.append((len(scheduled), request, tuple(request.spec_token_ids)))
            scheduled.append(self._advance(request, num_new))
            if num_new > 1:
                self._num_partial += 1
            budget -= num_new
        return budget

    def _schedule_drafts(self, budget: int, scheduled: list, drafting: list) -> int:
        """Speculative decoding: add the noted decodes' drafts to their entries, in order, from what the
        step left: the token budget and the rows of `_draft_room` (drafts cut to them), a
        max_num_partial_prefills slot each (attention tiles a sequence fed several tokens as a prefill
        chunk) and free pages (none: no drafts)."""
        if not drafting:
            return budget
        room = self._draft_room(budget, scheduled, drafting)
        for index, request, drafts in drafting:
            drafts = drafts[:min(budget, room)]
            if not drafts or not self._prefill_slot_free(1 + len(drafts)) or \
                    self.pool.allocate(request, len(drafts)) is None:
                continue
            scheduled[index] = self._with_drafts(scheduled[index], request, drafts)
            self._num_partial += 1  # (a decode of one token before)
            budget -= len(drafts)
            room -= len(drafts)
        return budget

    def _draft_room(self, budget: int, scheduled: list, drafting: list) -> int:
        """Rows the step's drafts may take. A step whose every entry is a decode with drafts that all fit
        (budget and partial-prefill slots): any number (the rows each verification adds cost only requests
        that speculate). A step that carries a request without drafts (a decode, a prefill chunk, a decode
        whose drafts find no slot): only the rows its T bucket pads anyway, or up to memory_bound_tokens,
        so that request's step costs what it would without speculation (on a CPU a step of 32 rows takes
        ~2x one of 4)."""
        num_tokens = sum(entry.num_tokens for entry in scheduled)
        cap = self.config.max_num_partial_prefills
        slots = len(drafting) if cap is None else cap - self._num_partial
        if not self.config.token_buckets or (len(drafting) == len(scheduled) <= slots and
                                             sum(len(drafts) for _, _, drafts in drafting) <= budget):
            return budget
        bucket = next((b for b in self.config.token_buckets if b >= num_tokens), num_tokens)
        return max(bucket, self.config.memory_bound_tokens) - num_tokens

    def _with_drafts(self, entry: ScheduledRequest, request: Request, drafts: tuple[int, ...]) -> ScheduledRequest:
        """The decode entry with the drafts fed after its token (their pages already allocated); they count
        as computed until `update_from_output` rolls the rejected ones back. Async scheduling: that token may be
        a placeholder (the previous step's, drafts of which may be in flight too: the device then moves this
        entry's positions back by those rejected, `model_runner.fill_in_flight`)."""
        if (entry.placeholder and not self.config.async_scheduling) or not entry.samples or entry.num_tokens != 1:
            raise RuntimeError(f"request {request.request_id!r}: drafts go after a decode of one token only")
        num_output = entry.num_output_tokens
        request.num_computed_tokens += len(drafts)
        request.num_draft_placeholders += len(drafts)
        request.num_pages_sent = len(request.page_ids)  # the drafts' pages ride on this entry's diff
        return dataclasses.replace(
            entry, token_ids=entry.token_ids + drafts, page_ids=tuple(request.page_ids[entry.page_ids_from:]),
            spec_token_ids=drafts,
            spec_banned_token_ids=tuple(request.banned_token_ids_at(num_output + j + 1) for j in range(len(drafts))))

    def _schedule_waiting(self, budget: int, scheduled: list) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with tokens in flight: its recompute needs them (async scheduling)
            # Prompt log-probs need every prompt position fed through the model: no cached prefix.
            prefix = CachedPrefix() if request.sampling_params.prompt_logprobs is not None else \
                self.pool.find_cached_prefix(request)
            num_new = self._chunk_size(request.num_tokens - prefix.num_tokens, budget)
            if not self._prefill_slot_free(num_new) or self.pool.allocate(request, num_new, prefix) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = prefix.num_tokens
            self.running.append(request)
            scheduled.append(self._advance(request, num_new))
            if num_new > 1:
                self._num_partial += 1
            budget -= num_new
        return budget

    def _advance(self, request: Request, num_new: int) -> ScheduledRequest:
        """Snapshot the request's chunk, then count it as computed and cache its full pages (of real tokens
        only: placeholders are never hashed; drafts, added later by `_with_drafts`, neither): the pool is
        called only when a page has filled since its last call (`Request.num_full_pages_cached`).

        Async scheduling: a chunk that samples adds a placeholder; a chunk past the known tokens is the one
        placeholder the previous step sampled (see the module docstring)."""
        start = request.num_computed_tokens
        end = start + num_new
        prompt, outputs = request.prompt_token_ids, request.output_token_ids  # read once: this runs for every row
        num_prompt = len(prompt)
        num_tokens = num_prompt + len(outputs)
        num_placeholders_fed = max(0, end - max(start, num_tokens))
        if num_placeholders_fed and (num_new != 1 or not request.num_output_placeholders):
            raise RuntimeError(f"request {request.request_id!r}: a chunk of {num_new} tokens at {start} feeds "
                               f"{num_placeholders_fed} placeholders (at most its one in-flight token)")
        if num_placeholders_fed:  # the token in flight (async scheduling)
            token_ids = _PLACEHOLDER_TOKENS
        elif num_new == 1 and start >= num_prompt:  # a decode of a known token
            token_ids = (outputs[start - num_prompt],)
        else:
            token_ids = tuple(request.token_ids_slice(start, end))
        sent, page_ids = request.num_pages_sent, request.page_ids
        num_output = len(outputs) + request.num_output_placeholders  # the next token's output number
        drafts_in_flight = request.num_draft_placeholders
        params = request.sampling_params
        samples = end == num_tokens + request.num_output_placeholders + drafts_in_flight
        entry = ScheduledRequest(  # by position, in the fields' order: a third of the time keywords take
            request.request_id, token_ids, start,
            tuple(page_ids[sent:]) if len(page_ids) > sent else (),  # the diff: pages the worker lacks
            samples, params, num_prompt, sent, request.seed, num_output + drafts_in_flight,
            # Request.banned_token_ids (none past min_tokens: most rows)
            request.banned_token_ids_at(num_output) if params.min_tokens else (),
            prompt, outputs, bool(num_placeholders_fed))
        if request.spec_token_ids:
            request.spec_token_ids = []
        request.num_computed_tokens = end
        request.num_pages_sent = len(page_ids)
        if samples and self.config.async_scheduling:
            request.num_output_placeholders += 1
        if self.config.enable_prefix_caching and \
                min(end, num_tokens) // self.config.page_size != request.num_full_pages_cached:
            self.pool.cache_full_pages(request)  # full pages of known tokens only
        return entry

    def _preempt(self, request: Request) -> None:
        self.pool.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- results -----------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]],
        stops: Mapping[str, StopVerdict | None] | None = None,
    ) -> list[Request]:
        """Append the sampled tokens of the entries that sample, finish those that stop; return them.

        `stops[request_id]`, when given, is the caller's verdict on the request's (last) token,
        replacing `Request.check_stop`: None goes on, (status, stop_reason) ends it (a stop
        string, decided on the text; FINISHED_ERROR: the token is garbage and is not appended).
        Entries that don't sample are ignored, and so are requests finished (aborted) since the
        step was scheduled (`SchedulerOutput.requests`: a new request that took the id gets nothing).
        A sampling entry of a live request without tokens is a runner bug: ValueError.

        Speculative decoding: an entry that fed d drafts gets up to 1 + d tokens (the accepted drafts,
        then one sampled token; fewer when the engine cut them at a stop). The verdict is the last
        token's, the caller's word that the others go on (`Request.append_step_tokens`); a FINISHED_ERROR verdict
        appends the tokens before it. A request that goes on then counts as computed only its
        accepted drafts: the rejected ones' pages go back to the pool (`_roll_back_rejected`).
        """
        stops, finished = stops or {}, []
        entries, requests = scheduler_output.scheduled_requests, scheduler_output.requests
        if len(requests) != len(entries):
            raise ValueError("update_from_output takes a SchedulerOutput made by schedule() (its requests)")
        stale = scheduler_output.num_finished != self.num_finished  # some request finished since it was scheduled
        for entry, request in zip(entries, requests):
            if not entry.samples or (stale and request.status.is_finished):
                continue
            rid, drafts = entry.request_id, entry.spec_token_ids
            if request.num_output_placeholders:  # async scheduling: the token in flight has arrived
                request.num_output_placeholders -= 1
            if drafts:
                request.num_draft_placeholders -= len(drafts)
            token_ids = sampled_token_ids.get(rid)
            if not token_ids:
                raise ValueError(f"no sampled token for request {rid!r}, whose chunk samples")
            if len(token_ids) > 1 + len(drafts):
                raise ValueError(f"{len(token_ids)} tokens for request {rid!r}, which fed {len(drafts)} drafts")
            verdict = stops.get(rid, _NO_VERDICT)
            if verdict is None and len(token_ids) == 1 and not drafts:  # a decode that goes on (most rows)
                request.output_token_ids.append(int(token_ids[0]))  # (a live request: never finished)
                continue
            given = verdict is not _NO_VERDICT
            request.append_step_tokens(token_ids, given, verdict if given else None)
            if not request.is_finished:
                if entry.spec_token_ids and request.status is RequestStatus.RUNNING:  # (not preempted since)
                    self._roll_back_rejected(request, entry, len(token_ids))
                continue
            self._release(request)
            finished.append(request)
        return finished

    def _roll_back_rejected(self, request: Request, entry: ScheduledRequest, num_emitted: int) -> None:
        """After a verification step: the KV of the last token and of the num_emitted - 1 accepted drafts is
        valid, the rest was written for rejected drafts. Count only the valid part as computed (and, async
        scheduling, the next step's tokens, scheduled as if every draft were accepted: the device moved them
        back), return the pages past it to the pool, and hash the pages it filled."""
        request.num_computed_tokens -= 1 + len(entry.spec_token_ids) - num_emitted
        self.pool.truncate(request, request.num_computed_tokens)
        self.pool.cache_full_pages(request)

    # ---- checks ------------------------------------------------------------

    def check_invariants(self) -> None:
        """Pool invariants plus: ref counts equal page-table occurrences, page tables cover progress."""
        self.pool.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
        refs = collections.Counter()
        for request in self._requests.values():
            assert request.num_output_placeholders >= 0 and request.num_draft_placeholders >= 0, request.request_id
            assert self.config.async_scheduling or not request.num_output_placeholders, request.request_id
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, request.request_id
            assert len(request.page_ids) == -(-request.num_computed_tokens // self.config.page_size)
            assert request.num_pages_sent <= len(request.page_ids), request.request_id  # the diff starts in the table
            refs.update(request.page_ids)
            for page_id, page_hash in zip(request.page_ids, request.page_hashes):
                stored = self.pool.page_hash(page_id)
                assert stored is None or stored == page_hash, f"page {page_id} cached under another prefix"
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request.request_id
            assert not request.page_ids and request.num_computed_tokens == 0, request.request_id
        for page_id in range(1, self.pool.num_pages):
            assert self.pool.ref_count(page_id) == refs[page_id], f"page {page_id}: ref count != page-table uses"
        assert {r.request_id for r in self.running} | {r.request_id for r in self.waiting} == set(self._requests)


_PLACEHOLDER_TOKENS = (PLACEHOLDER_TOKEN_ID,)  # the token_ids of every entry that feeds its token in flight
_NO_VERDICT = object()  # update_from_output: the caller gave no verdict on the request's token

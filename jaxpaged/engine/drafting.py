"""N-gram drafting in the engine's step loop: which requests draft, and their drafts proposed on the host (for a
request in flight, their count: the device proposes them).

Before each schedule the engine proposes drafts for decoding requests (NgramProposer, trimmed by DraftLengthPolicy).
Under async scheduling a request's last token is still in flight then. Requests without min_tokens bans or a grammar
verify overlapped (`_verifies_overlapped`; EngineArgs.overlap_verification, on with a GPU): with step N in flight,
N+1 is scheduled as if all of N's drafts were accepted (the scheduler's `num_draft_placeholders`); the host reserves
only how many draft slots each such request feeds (`_reserve_drafts_in_flight`), and the device moves N+1's token,
positions and random rows' key steps to N's real outcome (`model_runner.fill_in_flight`, `steps_moved_back`: seeded
outputs stay those of the synchronous loop), adds the tokens in flight to penalty counts (`outputs_in_flight`) and
proposes the slots' drafts from the tokens known, N's drafts and N's outcome (`redraft_in_flight`); the drafts it fed
come back with N+1's tokens (`ModelRunnerOutput.num_draft_tokens`). N's rejected drafts are rolled back when its
tokens reach the host. Grammar masks and min_tokens bans follow the tokens on the host, so a step verifying other
requests' drafts runs synchronously, and with a step in flight the engine waits for it only when drafts are likely
(`_drafts_likely`).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpaged.core.request import Request
from jaxpaged.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxpaged.sample.structured_outputs import GrammarMatcher
from jaxpaged.spec_decode.ngram import (DraftLengthPolicy, NgramProposer, SpecDecodingStats, SpeculativeConfig,
                                        max_drafts_for)
from jaxpaged.worker.runner_output import ModelRunnerOutput

# Overlapped verification: a request in flight whose draft was accepted lately but whose lookup on the tokens the host
# knows finds nothing past the step in flight still reserves k draft slots, up to this many times after its last
# accepted draft (`Request.spec_reserve_left`): the host's lookup lags the device's by that step's outcome, so after
# a copy breaks the device finds the match again a step sooner
RESERVE_AFTER_ACCEPT = 3
# what the host packs in a draft slot whose draft the device proposes (fed as is only where it finds none: never
# accepted, -1 in the drafts verified)
DRAFT_SLOT_TOKEN = 0
# Speculation with async scheduling: after drafts proposed for a token in flight found no room in the step (a
# mixed batch's padding, the partial-prefill slots), the engine overlaps 2, 4, ... up to this many steps of the
# same batch before it waits for a token in flight to propose again (each wait costs the step's host time).
NO_ROOM_MAX_WAIT = 32


class Drafting:
    """LLMEngine's methods for n-gram drafting: they share its state (see LLMEngine.__init__)."""

    def _init_drafting(self, spec: SpeculativeConfig | None) -> None:
        self.proposer = None if spec is None else NgramProposer(spec)  # speculative decoding (n-gram)
        self.spec_decoding_stats = None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)
        self.draft_policy = None if spec is None or not spec.adaptive_draft_length else \
            DraftLengthPolicy(spec.num_speculative_tokens)  # which drafts pay for their rows
        # with async scheduling: after drafts found no room in a step, the batch (_batch_key) then, the steps left
        # that do not wait to propose again while it stays the same, and the no-room steps in a row
        self._no_room_batch, self._no_room_wait, self._no_room_streak = None, 0, 0

    def _propose_drafts(self) -> None:
        """Speculative decoding: n-gram drafts for every decoding request (under a grammar, `_grammar_drafts`;
        none while more requests are enqueued than speculative_config.disable_by_batch_size)."""
        disabled = self._drafting_disabled()
        decoding = self.scheduler.decoding_requests()
        for request in decoding:
            request.spec_num_forced = 0
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

    def _reserve_drafts_in_flight(self, in_flight: SchedulerOutput, waiting: Sequence[Request]) -> None:
        """Speculative decoding with a step in flight (`in_flight`) whose requests `waiting` for its tokens
        (`_in_flight_decodes`) all verify overlapped (`_verifies_overlapped`): drafts for every decoding request
        that may have them, the others' from their tokens; for those in flight only a count of draft slots
        (`_draft_slots`), whose drafts the device proposes from that step's outcome; the adaptive policy trims
        them. Nothing waits for the device."""
        disabled = self._drafting_disabled()
        fed = {e.request_id: len(e.spec_token_ids) for e in in_flight.scheduled_requests}
        decoding, waiting_for = [], {id(r) for r in waiting}
        for request in self.scheduler.running:
            request.spec_token_ids, request.spec_num_forced = [], 0
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
            elif self.runner_config.prompt_lookup is not None:
                request.spec_token_ids = [DRAFT_SLOT_TOKEN] * self._draft_slots(request, fed.get(request.request_id, 0),
                                                                                room)
        if self.draft_policy is not None:
            self.draft_policy.trim(decoding)

    def _draft_slots(self, request: Request, num_in_flight: int, room: int) -> int:
        """The draft slots a request in flight reserves (their drafts the device's): as many as the lookup on the
        tokens the host knows finds past the step in flight if it accepts all its num_in_flight drafts (the
        device proposed those from the same tokens, so they are that lookup's own), else k while
        `Request.spec_reserve_left` (a draft accepted lately: RESERVE_AFTER_ACCEPT), one less each time, else none."""
        found = len(self.proposer.propose(request.all_token_ids, room, skip=num_in_flight + 1))
        if found or request.spec_reserve_left <= 0:
            return found
        request.spec_reserve_left -= 1
        return min(room, self.runner_config.num_speculative_tokens)

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

    def _observe_drafts(self, entries: Sequence[ScheduledRequest], result: ModelRunnerOutput) -> None:
        """Count the step's verifications (metrics: the drafts fed, as the device fed them where it proposed them,
        `ModelRunnerOutput.num_draft_tokens`) and teach the adaptive policy; keep `Request.spec_reserve_left`."""
        for entry in entries:
            num_accepted = result.num_accepted_drafts.get(entry.request_id)
            if num_accepted is None:  # verified nothing
                continue
            request = self._child_to_parent[entry.request_id][1].request
            if num_accepted:  # a copy runs: slots may follow a break in it (`_draft_slots`)
                request.spec_reserve_left = RESERVE_AFTER_ACCEPT
            num_drafts = result.num_draft_tokens[entry.request_id]
            if num_drafts:
                self.spec_decoding_stats.observe(num_drafts, num_accepted)
                if self.draft_policy is not None:
                    self.draft_policy.observe_verification(request, num_drafts, num_accepted,
                                                           min(request.spec_num_forced, num_drafts))

"""N-gram drafting in the engine's step loop: which requests draft, and their drafts proposed on the host.

Before each schedule the engine proposes drafts for decoding requests (NgramProposer, trimmed by DraftLengthPolicy).
Under async scheduling a request's last token is still in flight then. Requests without min_tokens bans or a grammar
verify overlapped (`_verifies_overlapped`; EngineArgs.overlap_verification, on with a GPU): with step N in flight,
N+1 is scheduled as if all of N's drafts were accepted (the scheduler's `num_draft_placeholders`), its drafts are
proposed on a guess of N's outcome (`_propose_past_in_flight`), and the device moves N+1's token, positions and
random rows' key steps to N's real outcome (`model_runner.fill_in_flight`, `steps_moved_back`: seeded outputs stay
those of the synchronous loop), adds the tokens in flight to penalty counts (`outputs_in_flight`) and, where the
guess proves wrong, proposes N+1's drafts again (`redraft_in_flight`; the host's twin: `_note_redrafts`). N's
rejected drafts are rolled back when its tokens reach the host. Grammar masks and min_tokens bans follow the
tokens on the host, so a step verifying other requests' drafts runs synchronously, and with a step in flight the
engine waits for it only when drafts are likely (`_drafts_likely`).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpaged.core.request import Request
from jaxpaged.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxpaged.sample.structured_outputs import GrammarMatcher
from jaxpaged.spec_decode.ngram import (DraftLengthPolicy, NgramProposer, SpecDecodingStats, SpeculativeConfig,
                                        max_drafts_for)
from jaxpaged.worker.runner_output import ModelRunnerOutput

# Overlapped verification: a request whose draft was accepted lately but whose lookup finds nothing before its token
# in flight reserves blank draft rows (BLANK_DRAFT_TOKEN, fed and proposed again on the device from that token on)
# for up to this many steps without a match; the host's lookup lags the device's by that token, so after a copy
# breaks the device finds the match again a step sooner
BLANK_DRAFT_STEPS = 3
BLANK_DRAFT_TOKEN = 0
# Speculation with async scheduling: after drafts proposed for a token in flight found no room in the step (a
# mixed batch's padding, the partial-prefill slots), the engine overlaps 2, 4, ... up to this many steps of the
# same batch before it waits for a token in flight to propose again (each wait costs the step's host time).
NO_ROOM_MAX_WAIT = 32


class Drafting:
    """LLMEngine's methods for n-gram drafting: they share its state (see LLMEngine.__init__)."""

    def _init_drafting(self, spec: SpeculativeConfig | None) -> None:
        self.proposer = None if spec is None else NgramProposer(spec)  # speculative decoding (n-gram)
        self._device_lookup = None if spec is None else NgramProposer(spec)  # the host twin of redraft_in_flight's
        self.spec_decoding_stats = None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)
        self.draft_policy = None if spec is None or not spec.adaptive_draft_length else \
            DraftLengthPolicy(spec.num_speculative_tokens)  # which drafts pay for their rows
        # with async scheduling: after drafts found no room in a step, the batch (_batch_key) then, the steps left
        # that do not wait to propose again while it stays the same, and the no-room steps in a row
        self._no_room_batch, self._no_room_wait, self._no_room_streak = None, 0, 0

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

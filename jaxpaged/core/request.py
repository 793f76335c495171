"""Request: the host-side state of one sequence being served.

Plain Python, no JAX. One `Request` is one sequence: an `n > 1` prompt is
split by the engine into `n` child requests that share the prompt's KV pages
through prefix caching.

Progress is tracked by ONE counter, `num_computed_tokens`: the number of
leading tokens of `all_token_ids` whose KV is in the page pool (or is being
written by the step that was just scheduled; see `Scheduler`). A prefix-cache
hit and a chunk of prefill advance it the same way; preemption resets it to 0.

With async scheduling (vLLM v1's) a request also has `num_output_placeholders`:
tokens sampled by steps already dispatched whose values have not reached the
host yet. They count as computed (the next step feeds them from the device) but
are not in `output_token_ids` until `Scheduler.update_from_output` appends them.
Drafts fed by such a step count too (`num_draft_placeholders`), as if all accepted.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import time
from collections.abc import Sequence

from jaxpaged.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES  # by value: an Enum member hashes in Python (a hot path)

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason: "stop", "length", "abort", "error" or None."""
        return _FINISHED_VALUES.get(self._value_)

    @classmethod
    def from_finish_reason(cls, finish_reason: str) -> RequestStatus:
        for status, reason in _FINISH_REASONS.items():
            if reason == finish_reason:
                return status
        raise ValueError(f"unknown finish_reason {finish_reason!r}; expected one of {sorted(_FINISH_REASONS.values())}")


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_FINISHED_VALUES = {status.value: reason for status, reason in _FINISH_REASONS.items()}


# How a token ends a request: (finished status, stop_reason: the stop token id or stop string, or None).
StopVerdict = tuple[RequestStatus, int | str | None]


@dataclasses.dataclass(eq=False)
class Request:
    """Mutable host state of one sequence. Compared by identity."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()  # from the generation config; ignored when ignore_eos
    seed: int = 0  # the sampler's PRNG seed: params.seed, or one the engine drew
    arrival_time: float = dataclasses.field(default_factory=time.time)
    max_model_len: int | None = None  # set by Scheduler.add_request when None
    # Set by Scheduler.add_request: the outputs that end it by length (max_tokens, else what max_model_len leaves)
    max_output_tokens: int = sys.maxsize
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    page_ids: list[int] = dataclasses.field(default_factory=list)  # the page table
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # filled by PagePool
    # Its pages before this index are hashed into the prefix cache (PagePool.cache_full_pages's last count, lowered
    # where the table shrinks): the scheduler calls the pool again only once another page has filled
    num_full_pages_cached: int = 0
    # The leading pages of page_ids the worker holds as they are (sent in earlier entries; the scheduler sends the
    # rest, ScheduledRequest.page_ids_from): PagePool lowers it where it changes the table before that index
    num_pages_sent: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    # async scheduling: tokens sampled by dispatched steps, not yet appended (see the module docstring)
    num_output_placeholders: int = 0
    # ... and the drafts fed by dispatched steps whose verification has not reached the host yet: counted as
    # computed as if all accepted (the next step's positions are moved back on the device by those rejected)
    num_draft_placeholders: int = 0
    # The finish record: `status` (finish_reason derives from it) and this, the stop token id or stop string.
    stop_reason: int | str | None = None
    # Speculative decoding: draft tokens to verify after the last token in the next step (set by the engine's
    # proposer, consumed by Scheduler.schedule; see jaxpaged/spec_decode/ngram.py). Never part of all_token_ids.
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    # ... of which the leading ones its grammar forces (structured outputs): not guesses, so the adaptive draft
    # length keeps them and does not learn acceptance from them
    spec_num_forced: int = 0
    # ... and its recent verifications, decayed (the adaptive draft length's estimate of its first draft's
    # acceptance, see spec_decode.DraftLengthPolicy): those whose first draft was accepted, and rejected
    spec_first_accepted: float = 0.0
    spec_first_rejected: float = 0.0
    # Overlapped verification: the times it may still reserve draft slots in flight where the host's lookup finds
    # none (engine.drafting.RESERVE_AFTER_ACCEPT after an accepted draft: `Drafting._draft_slots`)
    spec_reserve_left: int = 0

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"Request.request_id={self.request_id!r}: must be a non-empty string")
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if any(t < 0 for t in self.prompt_token_ids):
            raise ValueError(f"Request {self.request_id!r}: prompt token ids must be >= 0")
        self.eos_token_ids = tuple(int(t) for t in (self.eos_token_ids or ()))
        if not isinstance(self.sampling_params, SamplingParams):
            raise TypeError(f"Request {self.request_id!r}: sampling_params must be a SamplingParams")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"Request {self.request_id!r}: max_model_len={self.max_model_len} must be >= 1")

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, pages={self.page_ids})"
        )

    # ---- token views -------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - num_prompt)]

    @property
    def max_tokens(self) -> int | None:
        """Effective output cap: sampling_params.max_tokens, else what max_model_len leaves."""
        if self.sampling_params.max_tokens is not None:
            return self.sampling_params.max_tokens
        if self.max_model_len is not None:
            return self.max_model_len - self.num_prompt_tokens
        return None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length", "abort", "error", or None while unfinished (derived from `status`)."""
        return self.status.finish_reason

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Ids the sampler must not pick for the next token: EOS and stop token ids before min_tokens.

        The next token is output number num_output_tokens + num_output_placeholders (placeholders count)."""
        return self.banned_token_ids_at(self.num_output_tokens + self.num_output_placeholders)

    def banned_token_ids_at(self, num_output_tokens: int) -> tuple[int, ...]:
        """`banned_token_ids` for the output token that follows `num_output_tokens` outputs (a draft position)."""
        params = self.sampling_params
        if num_output_tokens >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(eos) + params.stop_token_ids

    # ---- state changes -----------------------------------------------------

    def finish(self, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        if not status.is_finished:
            raise ValueError(f"Request {self.request_id!r}: {status} is not a finished status")
        if self.is_finished:
            raise RuntimeError(f"Request {self.request_id!r} is already finished ({self.status.name})")
        self.status = status
        self.stop_reason = stop_reason

    def check_stop(self, token_id: int, ahead: int = 0) -> StopVerdict | None:
        """The token-level stop that appending `token_id` would cause, or None (pure: nothing changes).

        ahead: tokens to be appended before this one (speculative decoding checks a step's tokens
        one by one before any is appended).

        Order (vLLM's): no EOS / stop-token stop before `min_tokens` outputs; EOS ids
        (unless ignore_eos; stop_reason None); stop_token_ids (stop_reason = the id);
        max_tokens -> "length"; the max_model_len bound -> "length". Stop strings are text:
        the engine checks them with the detokenizer and hands the verdict to
        `Scheduler.update_from_output`, which applies every stop in one place. `stop_screen` says what this
        can stop on: change the two together.
        """
        token_id = int(token_id)
        params = self.sampling_params
        num_output = self.num_output_tokens + ahead + 1
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        max_tokens = self.max_tokens
        if max_tokens is not None and num_output >= max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if self.max_model_len is not None and self.num_tokens + ahead + 1 >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None

    def stop_screen(self) -> tuple[frozenset[int], int]:
        """What `check_stop` can stop on, for a caller that screens tokens before asking it (the engine's lean
        path: OutputProcessor): the ids that may end the request (EOS unless ignore_eos, stop_token_ids; min_tokens
        left out, so a superset) and the output count at which length ends it (max_tokens, max_model_len). A token
        outside the ids that brings fewer outputs is one check_stop passes. A rule added to check_stop is added
        here too (tests/test_output_processor.py holds the screen to check_stop)."""
        params = self.sampling_params
        ids = frozenset(() if params.ignore_eos else self.eos_token_ids) | frozenset(params.stop_token_ids)
        limits = [self.max_tokens]
        if self.max_model_len is not None:
            limits.append(self.max_model_len - self.num_prompt_tokens)
        return ids, min((n for n in limits if n is not None), default=sys.maxsize)

    def append_step_tokens(self, token_ids: Sequence[int], given: bool, verdict: StopVerdict | None) -> None:
        """Append one step's tokens (more than one only with speculative decoding). A caller's verdict (given)
        is on the last token, and the caller decided the tokens before it go on (the engine cuts a step's tokens
        at the first that stops: OutputProcessor._emit): nothing is checked twice. Without one, each token is
        checked with `check_stop`, stopping at the first that ends it."""
        if given:
            error = verdict is not None and verdict[0] is RequestStatus.FINISHED_ERROR
            if error:  # the last token is garbage: keep the ones before it, then fail
                token_ids = token_ids[:-1]
            last = len(token_ids) - 1
            for i, token_id in enumerate(token_ids):
                self.append_with_verdict(token_id, verdict if i == last and not error else None)
            if error:
                self.finish(*verdict)
            return
        for token_id in token_ids:
            if self.append_with_verdict(token_id, self.check_stop(token_id)):
                return

    def append_output_token(self, token_id: int) -> bool:
        """Append one sampled token and finish the request if `check_stop` says it stops; True when it
        finished."""
        return self.append_with_verdict(token_id, self.check_stop(token_id))

    def append_with_verdict(self, token_id: int, verdict: StopVerdict | None) -> bool:
        """Append one sampled token whose stop is already decided (the engine's verdict, which also
        weighs stop strings): None goes on, (status, stop_reason) finishes it so. True when it finished."""
        if self.is_finished:
            raise RuntimeError(f"Request {self.request_id!r} is already finished ({self.status.name})")
        self.output_token_ids.append(int(token_id))
        if verdict is None:
            return False
        self.finish(*verdict)
        return True

"""The scheduler's output: what one step runs, the one record the worker reads from the core.

`SchedulerOutput.entries` holds one `ScheduledRequest` per running request scheduled this step, in step order:
the tokens it feeds (a prefill chunk, one decode token, or a token and its drafts), what changed in its page table
since its previous entry and what the sampler needs of it. The worker keeps each running request's page table
(worker/input_batch.py) and applies the diff: the table is its first `page_ids_from` pages as the worker holds them,
then `page_ids` (page_ids_from 0: the whole table, sent on a request's first step and after preemption). A placeholder token (`PLACEHOLDER_TOKEN_ID`) stands for a token still in flight under async
scheduling; the worker fills it on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxpaged.core.request import Request
from jaxpaged.sampling_params import SamplingParams

PLACEHOLDER_TOKEN_ID = -1  # in ScheduledRequest.token_ids: a token the previous step sampled, still on the device


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step; the runner builds positions and slot mapping from it.

    Read-only by contract, derived with `dataclasses.replace`, but not frozen: the scheduler makes one for every
    running request every step, and a frozen dataclass's __init__ (a guarded setattr per field) took 4x as long
    (1.96 us against 0.46 with slots, 17 fields; ~0.4 ms of a 256-request step)."""

    request_id: str
    token_ids: tuple[int, ...]  # the tokens at positions [start_position, start_position + len)
    start_position: int  # num_computed_tokens before this step
    page_ids: tuple[int, ...]  # its page table after allocation from index page_ids_from on (covers every position fed)
    samples: bool  # the chunk reaches the end of the known tokens: sample a next token
    sampling_params: SamplingParams
    num_prompt_tokens: int  # tokens below this position are prompt (outputs follow after preemption)
    page_ids_from: int = 0  # pages before this index are those the worker holds from earlier entries; 0: none
    # The sampler's per-request state (read by ModelRunner.execute_model when `samples`):
    seed: int = 0  # PRNG seed; the key of this token is fold_in(PRNGKey(seed), num_output_tokens)
    num_output_tokens: int = 0  # outputs before this step's sampled token
    banned_token_ids: tuple[int, ...] = ()  # masked to -inf (EOS / stop token ids before min_tokens)
    # The request's own lists, by reference (no copy per step; read only while this step runs), for penalties:
    prompt_token_ids: Sequence[int] = dataclasses.field(default=(), compare=False, repr=False)
    output_token_ids: Sequence[int] = dataclasses.field(default=(), compare=False, repr=False)
    # async scheduling: the chunk is one token, the one the previous step sampled for this request; token_ids
    # holds PLACEHOLDER_TOKEN_ID and the runner gathers the value on the device
    placeholder: bool = False
    # Speculative decoding: the d drafts fed after the last token (they end token_ids), to verify this step (fed
    # after a placeholder: slots whose drafts the runner proposes on the device, `redraft_in_flight`);
    # spec_banned_token_ids[j]: banned_token_ids of the output after the first j + 1 drafts.
    spec_token_ids: tuple[int, ...] = ()
    spec_banned_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens fed this step (drafts included)."""
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    scheduled_requests: tuple[ScheduledRequest, ...]  # in scheduling order
    num_scheduled_tokens: int
    preempted_request_ids: tuple[str, ...]  # preempted by this schedule() call
    finished_request_ids: tuple[str, ...]  # finished (any reason) since the previous schedule()
    # (the worker forgets the rows of both: every output reaches it, empty or not, `ModelRunner.remove_requests`)
    # For the engine and `Scheduler.update_from_output`, not the worker: each entry's Request (ids are reusable once
    # a request finishes) and `Scheduler.num_finished` when made. While the count has not moved, every entry's
    # request is unfinished: the engine checks no row of a step in flight (async scheduling) for liveness.
    requests: tuple[Request, ...] = dataclasses.field(default=(), compare=False, repr=False)
    num_finished: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests

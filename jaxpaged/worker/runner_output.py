"""ModelRunnerOutput: what one step hands back to the engine (host side), and the prompt log-probs it carries.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.sample.sampler import SamplerOutput
from jaxpaged.spec_decode.verify import VerifiedDrafts


@dataclasses.dataclass(frozen=True)
class ModelRunnerOutput:
    """What one step sampled, on the host: row r belongs to req_ids[r] (the entries that sample, in order).

    K = MAX_LOGPROBS when some row of the step asks for logprobs, else 0 (the sampler skips its top-k
    pass): the raw distribution's top ids and log-probs, most likely first.
    """

    req_ids: tuple[str, ...]
    sampled_token_ids: np.ndarray  # i32[R]
    logprobs: np.ndarray  # f32[R]; of sampled_token_ids under the raw model distribution
    top_token_ids: np.ndarray  # i32[R, K]
    top_logprobs: np.ndarray  # f32[R, K]
    finite: np.ndarray  # bool[R]; False: the row's logits held a NaN/inf, its token is garbage
    # the prompt tokens this step predicted, for the requests that asked (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[str, PromptLogprobs] = dataclasses.field(default_factory=dict)
    # Speculative decoding: for each request that fed drafts, the rows of its emitted tokens, in order (the
    # arrays above then hold more than R rows: the draft positions' samples follow the R rows), and how many
    # of its drafts were accepted. Other requests emit their one row.
    spec_token_rows: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    num_accepted_drafts: dict[str, int] = dataclasses.field(default_factory=dict)
    # ... and how many drafts it fed: those the host proposed, or the device where it proposed them (a slot it found
    # none for is not counted: `VerifiedDrafts.num_drafts_fed`)
    num_draft_tokens: dict[str, int] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def req_id_to_index(self) -> dict[str, int]:
        return {rid: r for r, rid in enumerate(self.req_ids)}

    @functools.cached_property
    def row_values(self) -> tuple[list[int], list[float], list[bool]]:
        """(sampled_token_ids, logprobs, finite) as Python lists: the engine reads them row by row."""
        return self.sampled_token_ids.tolist(), self.logprobs.tolist(), self.finite.tolist()

    def token_rows(self, request_id: str) -> tuple[int, ...]:
        """The rows of the tokens `request_id` emits this step, in order (more than one only when it
        verified drafts: its accepted drafts, then the token sampled after them)."""
        rows = self.spec_token_rows.get(request_id)
        return rows if rows is not None else (self.req_id_to_index[request_id],)

    @classmethod
    def from_sampler(cls, entries: Sequence[ScheduledRequest], sampled: SamplerOutput,
                     prompt_logprobs: dict[str, PromptLogprobs] | None = None,
                     drafts: VerifiedDrafts | None = None) -> ModelRunnerOutput:
        """The output of a step whose sampler row i is entries[i] (the entries that sample)."""
        rows = {e.request_id: i for i, e in enumerate(entries) if e.samples}
        return cls.from_rows(rows, sampled, prompt_logprobs, drafts)

    @classmethod
    def from_rows(cls, rows: dict[str, int], sampled: SamplerOutput,
                  prompt_logprobs: dict[str, PromptLogprobs] | None = None,
                  drafts: VerifiedDrafts | None = None) -> ModelRunnerOutput:
        """`from_sampler` from {request id: its sampler row} of the entries that sample, in entry order
        (`PendingStep.rows`, which the next step's dispatch has already made). `sampled`: finished, on the device
        or the host (fetched here, `SamplerOutput.to_host`)."""
        sampled = sampled.to_host()
        req_ids, n = tuple(rows), len(rows)
        # rows 0..n-1 (every entry samples: a decode step; rows increase, so the last is n - 1 only then) are the
        # arrays' first n rows, views; else gathered
        index = slice(0, n) if not n or next(reversed(rows.values())) == n - 1 else \
            np.fromiter(rows.values(), np.int64, n)
        arrays = [np.asarray(a)[index] for a in (sampled.token_ids, sampled.logprobs, sampled.top_token_ids,
                                                  sampled.top_logprobs, sampled.finite)]
        if drafts is None:
            return cls(req_ids, *arrays, prompt_logprobs or {})
        x = drafts.sampled  # its rows follow the R rows
        arrays = [np.concatenate([a, np.asarray(b)]) for a, b in zip(
            arrays, (x.token_ids, x.logprobs, x.top_token_ids, x.top_logprobs, x.finite))]
        position = {rid: r for r, rid in enumerate(req_ids)}
        ids = drafts.layout.request_ids
        token_rows = {rid: drafts.token_rows(m, n, position[rid]) for m, rid in enumerate(ids)}
        accepted = {rid: int(drafts.num_accepted[m]) for m, rid in enumerate(ids)}
        fed = {rid: drafts.num_drafts_fed(m) for m, rid in enumerate(ids)}
        return cls(req_ids, *arrays, prompt_logprobs or {}, token_rows, accepted, fed)


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """One request's prompt log-probabilities from one step (a chunk of its prompt), on the host.

    Row j is prompt token `first_index + j` given the tokens before it (token 0 has none).
    """

    first_index: int
    token_logprobs: np.ndarray  # f32[M]; of the prompt token under the raw model distribution
    ranks: np.ndarray  # i32[M]; 1 + how many tokens are more likely
    top_token_ids: np.ndarray  # i32[M, K]
    top_logprobs: np.ndarray  # f32[M, K]


def prompt_logprob_spans(entries: Sequence[ScheduledRequest]) -> dict[str, tuple[int, int, int, ScheduledRequest]]:
    """For each entry asking for prompt logprobs whose chunk predicts prompt tokens:
    (row offset of its first fed token in the step, first predicted prompt index, count, entry).

    The token fed at position q predicts token q + 1; only q + 1 < num_prompt_tokens are prompt."""
    spans, offset = {}, 0
    for entry in entries:
        if entry.sampling_params.prompt_logprobs is not None:
            count = min(entry.start_position + entry.num_tokens, entry.num_prompt_tokens - 1) - entry.start_position
            if count > 0:
                spans[entry.request_id] = (offset, entry.start_position + 1, count, entry)
        offset += entry.num_tokens
    return spans


def prompt_targets(spans: dict, num_tokens: int) -> np.ndarray:
    """i32[T]: the prompt token each fed position of `prompt_logprob_spans`' spans predicts (0 elsewhere)."""
    targets = np.zeros(num_tokens, np.int32)
    for offset, first, count, entry in spans.values():
        targets[offset:offset + count] = entry.prompt_token_ids[first:first + count]
    return targets


def split_prompt_logprobs(spans: dict, arrays: tuple) -> dict[str, PromptLogprobs]:
    """Each span's rows of `prompt_logprobs_step`'s host outputs (target log-probs, ranks, top ids, top log-probs)."""
    return {rid: PromptLogprobs(first, *(a[offset:offset + count] for a in arrays))
            for rid, (offset, first, count, _) in spans.items()}

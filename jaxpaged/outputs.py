"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes.

What an output holds depends on `SamplingParams.output_kind` (RequestOutputKind): CUMULATIVE
(everything so far), DELTA (token ids, logprobs and text new since the previous output; with
n > 1 only the samples that got a token) or FINAL_ONLY (one output, at the end). Running totals
are in `RequestOutput.metrics` (num_generation_tokens) whatever the kind.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely under the raw model distribution
    decoded_token: str | None = None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    # seconds between the steps that gave the request tokens (appended by the engine; whatever the output kind)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass(slots=True)  # slots: made for every request every step, at half a dict's cost
class CompletionOutput:
    """One sample's output. Its token ids are copied only when first read (`span`): a CUMULATIVE output that the
    caller never reads costs no O(length) copy every step."""

    index: int
    text: str  # all or new (output_kind); while unfinished, text that may still become a stop string is held back
    token_ids: list[int]  # all or new (output_kind); with span, read through `_span_token_ids`
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per generated token, when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # SamplingParams.array_logprobs: each token's raw log-prob, float32 [len(token_ids)] (all or new, as token_ids)
    token_logprobs: np.ndarray | None = None
    # (start, end): token_ids was given as a list that only grows (the engine's Request.output_token_ids) and the
    # output's ids are its [start:end], copied on the first read, so later appends never show; None once read
    span: tuple[int, int] | None = dataclasses.field(default=None, repr=False, compare=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


_TOKEN_IDS_SLOT = CompletionOutput.token_ids  # the slot itself, behind the `token_ids` property below


def _span_token_ids(output: CompletionOutput) -> list[int]:
    """CompletionOutput.token_ids: the span's copy, made on the first read (the caller's own list from then on)."""
    if output.span is not None:
        start, end = output.span
        _TOKEN_IDS_SLOT.__set__(output, _TOKEN_IDS_SLOT.__get__(output)[start:end])
        output.span = None
    return _TOKEN_IDS_SLOT.__get__(output)


def _set_token_ids(output: CompletionOutput, token_ids: list[int]) -> None:
    _TOKEN_IDS_SLOT.__set__(output, token_ids)
    output.span = None  # (__init__ sets span after token_ids: a span given there stays)


# dataclasses.replace, ==, repr and the server read token_ids through this, so they all see the copy
CompletionOutput.token_ids = property(_span_token_ids, _set_token_ids)


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token (the first is None, nothing predicts it), its
    # entry and the top-k; complete from the first output on (in DELTA mode only in the first output)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # SamplingParams.array_logprobs with prompt_logprobs=0: each prompt token's log-prob, float32 [len(prompt)]
    # (index 0 NaN: nothing predicts it); sent as prompt_logprobs is
    prompt_token_logprobs: np.ndarray | None = None

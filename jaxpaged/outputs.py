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


@dataclasses.dataclass(slots=True)  # slots: its token times are written for every request every step
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


class CompletionOutput:
    """One sample's output (vLLM's CompletionOutput fields). Made for every request every step: slots, and its token
    ids copied only when first read (`span`), so a CUMULATIVE output the caller never reads costs no O(length) copy.

    token_ids: the ids, all or new (output_kind); with span = (start, end), a list that only grows (the engine's
    Request.output_token_ids) whose [start:end] they are: copied on first read, so later appends never show.
    """

    __slots__ = ("index", "text", "_token_ids", "_span", "cumulative_logprob", "logprobs", "finish_reason",
                 "stop_reason", "token_logprobs")

    def __init__(self, index: int, text: str, token_ids: list[int], cumulative_logprob: float | None,
                 logprobs: list[dict[int, Logprob]] | None, finish_reason: str | None = None,
                 stop_reason: int | str | None = None, token_logprobs: np.ndarray | None = None,
                 span: tuple[int, int] | None = None):
        self.index = index
        self.text = text  # all or new (output_kind); while unfinished, text that may still become a stop string is held
        self._token_ids, self._span = token_ids, span
        self.cumulative_logprob = cumulative_logprob
        self.logprobs = logprobs  # per generated token, when asked for
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | "error"
        self.stop_reason = stop_reason  # the stop token id or stop string that ended it
        # SamplingParams.array_logprobs: each token's raw log-prob, float32 [len(token_ids)] (all or new, as token_ids)
        self.token_logprobs = token_logprobs

    @property
    def token_ids(self) -> list[int]:
        if self._span is not None:  # the first read: the caller's own copy from here on
            start, end = self._span
            self._token_ids, self._span = self._token_ids[start:end], None
        return self._token_ids

    @token_ids.setter
    def token_ids(self, token_ids: list[int]) -> None:
        self._token_ids, self._span = token_ids, None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple:
        return (self.index, self.text, self.token_ids, self.cumulative_logprob, self.logprobs, self.finish_reason,
                self.stop_reason, self.token_logprobs)

    def __eq__(self, other: object) -> bool:
        if type(other) is not CompletionOutput:
            return NotImplemented
        return self._fields() == other._fields()  # as the dataclass it replaced compared

    __hash__ = None  # mutable, as the dataclass it replaced

    def __repr__(self) -> str:
        names = ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason",
                 "token_logprobs")
        return "CompletionOutput(" + ", ".join(f"{n}={v!r}" for n, v in zip(names, self._fields())) + ")"


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

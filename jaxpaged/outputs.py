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
    index: int
    text: str  # all or new (output_kind); while unfinished, text that may still become a stop string is held back
    token_ids: list[int]  # all or new (output_kind)
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per generated token, when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # SamplingParams.array_logprobs: each token's raw log-prob, float32 [len(token_ids)] (all or new, as token_ids)
    token_logprobs: np.ndarray | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


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

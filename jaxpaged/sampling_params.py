"""SamplingParams: what one request asks of the sampler and of the stop checks.

Names and meanings follow vLLM's `SamplingParams`, so code written for vLLM
ports by changing the import. Frozen and validated at construction; derive
variants with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any

from jaxpaged.errors import InvalidRequestError

MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's RequestOutputKind).

    CUMULATIVE: everything so far (token ids, logprobs, text) every time it grows.
    DELTA: only what is new since the request's previous output (streaming; O(new tokens) a step).
    FINAL_ONLY: one output, when the request finishes, with everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's StructuredOutputsParams): set exactly one field.

    json: a JSON schema (dict or its JSON text); regex: a regular expression (Rust
    `regex` syntax); choice: the output is one of these strings; grammar: a Lark
    grammar (or GBNF/EBNF, recognized by `::=`); json_object: any JSON object.
    Compiled by jaxpaged.sample.structured_outputs (off the engine thread).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(f"StructuredOutputsParams: set exactly one of json, regex, choice, grammar, "
                             f"json_object (got {set_fields or 'none'})")
        self._validate(set_fields[0])

    def _validate(self, kind: str) -> None:
        value = getattr(self, kind)

        def bad(why: str) -> None:
            raise ValueError(f"StructuredOutputsParams.{kind}: {why}")

        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as err:
                    bad(f"not valid JSON ({err})")
            if not isinstance(value, (dict, bool)):
                bad(f"a JSON schema must be an object (or a boolean), got {type(value).__name__}")
        elif kind == "choice":
            if isinstance(value, str) or not value or any(not isinstance(c, str) or not c for c in value):
                bad("must be a non-empty list of non-empty strings")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value.strip():
                bad("must be a non-empty string")
        elif value is not True:
            bad("must be True or None")

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False))

    def __hash__(self) -> int:
        return hash((self.kind, self.key_text))

    @property
    def key_text(self) -> str:
        """The constraint as text (a JSON schema serialized canonically): the grammar cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(list(value))
        return str(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None  # top-k log-probs of each prompt token (one device: refused with a mesh)
    # Log-probs as arrays for a trainer (docs/rl.md, "rollout outputs"): each sampled token's raw log-prob in
    # CompletionOutput.token_logprobs and, with prompt_logprobs=0, the prompt tokens' in
    # RequestOutput.prompt_token_logprobs (float32 numpy arrays), no per-token dicts (logprobs and prompt_logprobs
    # then ask no top-k: None or 0). Not part of vLLM's SamplingParams.
    array_logprobs: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (no text, so no stop strings)
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        # Normalise list-ish inputs so the dataclass stays hashable and frozen.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias.items()))
        self._validate()

    @property
    def uses_penalties(self) -> bool:
        """Whether some penalty is on (the sampler then counts the output tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _validate(self) -> None:
        def bad(field: str, value, why: str) -> None:
            raise InvalidRequestError(f"SamplingParams.{field}={value!r}: {why}", field)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "must be a finite number >= 0 (0 means greedy)")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", self.top_k, "must be -1, 0 (disabled) or a positive integer")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                bad(name, value, "must be in [-2, 2]")
        if not (0.0 < self.repetition_penalty <= 10.0) or not math.isfinite(self.repetition_penalty):
            bad("repetition_penalty", self.repetition_penalty, "must be in (0, 10]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, value, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.array_logprobs, bool):
            bad("array_logprobs", self.array_logprobs, "must be a bool")
        for name in ("logprobs", "prompt_logprobs"):
            if self.array_logprobs and getattr(self, name) not in (None, 0):
                bad(name, getattr(self, name), "array_logprobs gives the tokens' own log-probs only: None or 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "stop strings must be non-empty strings")
        if self.stop and not self.detokenize:
            bad("stop", self.stop, "stop strings need detokenize=True")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "token ids must be >= 0")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", self.output_kind, "must be a RequestOutputKind")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", self.seed, "must be an integer or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                   StructuredOutputsParams):
            bad("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams or None")
        if self.logit_bias is not None:
            for token_id, value in self.logit_bias:
                if token_id < 0 or not (-100.0 <= value <= 100.0):
                    bad("logit_bias", (token_id, value), "ids must be >= 0 and biases in [-100, 100]")

"""Streaming choices from the engine's DELTA outputs, and OpenAI's logprob formats."""

from __future__ import annotations

import dataclasses
import math

from jaxpaged.outputs import CompletionOutput, Logprob
from server.errors import OpenAIError

_MIN_LOGPROB = -9999.0  # -inf is not JSON


@dataclasses.dataclass
class ChoiceStream:
    """One choice of a stream fed the engine's DELTA outputs: tokens whose text is still held back
    (an incomplete character, a possible stop string) wait here and go out with the next text."""

    sent_chars: int = 0  # characters sent so far (completions' text_offset)
    done: bool = False
    pending_ids: list[int] = dataclasses.field(default_factory=list)
    pending_logprobs: list[dict[int, Logprob]] | None = None

    def take(self, comp: CompletionOutput) -> Delta | None:
        """Fold in one DELTA CompletionOutput; the chunk to send, or None (nothing to send yet).

        500 if the engine failed the request. Costs O(the delta)."""
        if self.done:
            return None
        if comp.finish_reason == "error":
            raise OpenAIError(500, "the engine failed while generating this request; see the server log")
        self.pending_ids.extend(comp.token_ids)
        if comp.logprobs is not None:
            if self.pending_logprobs is None:
                self.pending_logprobs = []
            self.pending_logprobs.extend(comp.logprobs)
        finishing = comp.finish_reason is not None
        if not comp.text and not finishing:
            return None
        delta = Delta(comp.text, self.pending_ids, self.pending_logprobs, comp.finish_reason, comp.stop_reason)
        self.sent_chars += len(comp.text)
        self.done = finishing
        self.pending_ids, self.pending_logprobs = [], None
        return delta


@dataclasses.dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


def _clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], offset: int) -> dict:
    """OpenAI's legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        tokens.append(token)
        token_logprobs.append(_clamp(chosen.logprob))
        ranked = sorted(entry.values(), key=lambda e: e.rank if e.rank is not None else math.inf)
        top.append({(e.decoded_token or ""): _clamp(e.logprob) for e in ranked})
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int) -> dict:
    """OpenAI's chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""

    def item(entry: Logprob) -> dict:
        token = entry.decoded_token or ""
        return {"token": token, "logprob": _clamp(entry.logprob), "bytes": list(token.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, entries):
        top = sorted((e for e in entry.values() if e.rank is not None and e.rank <= top_n), key=lambda e: e.rank)
        content.append({**item(entry[token_id]), "top_logprobs": [item(e) for e in top]})
    return {"content": content}

"""Turning cumulative CompletionOutputs into choices and streaming deltas, and logprob formats."""

from __future__ import annotations

import dataclasses
import math

from jaxpaged.outputs import CompletionOutput, Logprob
from server.errors import OpenAIError

_MIN_LOGPROB = -9999.0  # -inf is not JSON


@dataclasses.dataclass
class ChoiceState:
    """How much of one choice a stream has sent."""

    sent_chars: int = 0
    sent_tokens: int = 0
    done: bool = False


@dataclasses.dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


def final_text(comp: CompletionOutput, include_stop_str: bool) -> str:
    """The choice's text, with the stop string that ended it when asked to include it."""
    if include_stop_str and comp.finish_reason == "stop" and isinstance(comp.stop_reason, str):
        return comp.text + comp.stop_reason
    return comp.text


def take_delta(comp: CompletionOutput, state: ChoiceState, include_stop_str: bool) -> Delta | None:
    """What is new in `comp` since the last call (None: nothing to send); 500 if the engine failed it."""
    if state.done:
        return None
    if comp.finish_reason == "error":
        raise OpenAIError(500, "the engine failed while generating this request; see the server log")
    text = final_text(comp, include_stop_str) if comp.finish_reason else comp.text
    new_text, new_ids = text[state.sent_chars:], comp.token_ids[state.sent_tokens:]
    finishing = comp.finish_reason is not None
    if not new_text and not finishing:
        return None  # tokens whose text is held back wait for the next delta
    logprobs = None if comp.logprobs is None else comp.logprobs[state.sent_tokens:len(comp.token_ids)]
    state.sent_chars, state.sent_tokens, state.done = len(text), len(comp.token_ids), finishing
    return Delta(new_text, new_ids, logprobs, comp.finish_reason, comp.stop_reason)


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

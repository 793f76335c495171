"""Incremental detokenization and stop-string checks, per request (vLLM v1's detokenizer).

Generated tokens arrive a few at a time; `IncrementalDetokenizer.update` turns them into text
without re-decoding the whole output. It decodes a small window of tokens (vLLM's
`prefix_offset` / `read_offset`): the text of `ids[prefix:]` minus the text of
`ids[prefix:read]` is what the new tokens add, and it is emitted only once it does not end in
U+FFFD, so a character whose UTF-8 bytes are split across byte-level BPE tokens is held back
until its last byte arrives instead of coming out as a replacement character. A fast tokenizer
(one with a Rust `backend_tokenizer`) runs that window in `tokenizers.decoders.DecodeStream`
(vLLM v1's fast detokenizer does too): the same text, ~3.7x less time per token (SmolLM2's
tokenizer: 1.8 us against 6.8 us in Python), which the server pays for every request every step.

Stop strings are searched in the newly decoded text plus the `len(stop) - 1` characters before
it; the text is cut at the match (before the stop string, or after it with
`include_stop_str_in_output`). For streaming, `get_next_output_text` holds back the tail of
the text (at most `max(len(s) for s in stop) - 1` characters) that could still begin a stop
string, so text once released is never taken back. The engine reads it with `delta=True` for
`RequestOutputKind.DELTA` outputs (only the new characters are copied: O(delta) a step).

The detokenizer only detects stop strings (`update` / `flush` return the one matched); the
engine turns that into a stop verdict that `Scheduler.update_from_output` applies, so the
request's finish record lives in one place (the scheduler `Request`).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers

try:  # tokenizers >= 0.21; with an older one (an image where nothing can be installed) the window decodes in Python
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover  (the pinned environments have it)
    DecodeStream = None

# Prompt tokens decoded as context before the first output token (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough for decoders whose output depends on the
# preceding token (SentencePiece's leading space).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


def detokenize(tokenizer: Any, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The whole text of `token_ids`, decoded at once (no tokenization-space clean-up)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids = {i for i, token in added.items() if getattr(token, "special", False)}
    return frozenset(ids | set(getattr(tokenizer, "all_special_ids", ())))


def _prompt_context(prompt_token_ids: Sequence[int], skip_ids: frozenset[int]) -> list[int]:
    """The last PROMPT_CONTEXT_TOKENS prompt ids not in `skip_ids` (without scanning it all)."""
    context: list[int] = []
    for token_id in reversed(prompt_token_ids):
        if len(context) == PROMPT_CONTEXT_TOKENS:
            break
        if int(token_id) not in skip_ids:
            context.append(int(token_id))
    return context[::-1]


class _TextBuffer:
    """Append-only text with O(k) tail reads and truncation (a str `+=` copies it all)."""

    __slots__ = ("_buffer", "length", "_at_end")  # one per request that wants text, written every step

    def __init__(self):
        self._buffer = io.StringIO(newline="")
        self.length = 0
        self._at_end = True  # the stream's position is `length` (no seek before the next append)

    def append(self, text: str) -> None:
        if not self._at_end:
            self._buffer.seek(self.length)
            self._at_end = True
        self._buffer.write(text)
        self.length += len(text)

    def read(self, start: int, end: int | None = None) -> str:
        """Characters [start, end) (end defaults to the current length)."""
        end = self.length if end is None else min(end, self.length)
        start = max(0, start)
        if start >= end:
            return ""
        self._buffer.seek(start)
        self._at_end = end == self.length
        return self._buffer.read(end - start)

    def truncate(self, length: int) -> None:
        self._buffer.truncate(length)
        self.length = length
        self._at_end = False

    def getvalue(self) -> str:
        return self._buffer.getvalue()


class IncrementalDetokenizer:
    """One request's output text, built token by token, with stop-string checks.

    Args:
        tokenizer: a transformers tokenizer (anything with `decode(ids, skip_special_tokens=...)`).
        prompt_token_ids: the prompt; its last few tokens are decode context, never output.
        skip_special_tokens: drop special tokens' text (as `tokenizer.decode` does).
        stop: stop strings; generation stops at the first one the text completes.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        min_tokens: no stop string is matched in the text of the first `min_tokens` tokens.
    """

    __slots__ = ("stop", "tokenizer", "skip_special_tokens", "include_stop_str_in_output", "min_tokens",
                 "stop_buffer_length", "_skip_ids", "_window_ids", "_prefix_offset", "_read_offset", "_backend",
                 "_stream", "output_token_ids", "stop_reason", "_text", "_released")  # read for every token

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, stop: Iterable[str] = (),
                 include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self.stop = (stop,) if isinstance(stop, str) else tuple(stop)  # checked by SamplingParams
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.stop_buffer_length = (max(map(len, self.stop)) - 1
                                   if self.stop and not include_stop_str_in_output else 0)
        self._skip_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        context = _prompt_context(prompt_token_ids, self._skip_ids)
        self._window_ids = context  # decode context + output ids (skipped special ones left out)
        self._prefix_offset = 0
        self._read_offset = len(context)
        # A fast (Rust) tokenizer decodes the window in `tokenizers`' DecodeStream, the same algorithm without a
        # Python decode call per token (module docstring); None: decode in Python
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = _decode_stream(self._backend, context, skip_special_tokens)
        self.output_token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that matched
        self._text = _TextBuffer()
        self._released = 0  # output_text[:_released] went out through get_next_output_text

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def output_text(self) -> str:
        """All text decoded so far (cut at a matched stop string); O(length)."""
        return self._text.getvalue()

    @property
    def finished(self) -> bool:
        """True once a stop string matched; no more tokens are accepted."""
        return self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append generated tokens; return the stop string they completed, or None.

        `stop_terminated`: the last id ended the request (EOS or a stop token id); as in
        vLLM, its text is left out unless `include_stop_str_in_output`. The engine calls this for every token of
        every request that wants text: one plain loop, no list built.
        """
        if self.stop_reason is not None:
            raise RuntimeError(f"stop string {self.stop_reason!r} already ended this request")
        skip_last = stop_terminated and not self.include_stop_str_in_output  # the last id's text is left out
        text_buffer, output_ids, min_tokens = self._text, self.output_token_ids, self.min_tokens
        check_from = text_buffer.length
        for token_id in new_token_ids[:-1] if skip_last else new_token_ids:
            token_id = int(token_id)
            output_ids.append(token_id)
            text = self._decode_next(token_id)
            if text:
                text_buffer.append(text)
            if len(output_ids) <= min_tokens:
                check_from = text_buffer.length
        if skip_last:
            output_ids.append(int(new_token_ids[-1]))
        if not self.stop:
            return None
        return self._check_stop(check_from)

    def flush(self) -> str | None:
        """Release text held back for an incomplete character (call once the request ends).

        Whatever the pending tokens decode to, U+FFFD included, joins the output, so that
        `output_text` equals the full decode. Returns a stop string this completed, or None.
        """
        if self.finished or self._read_offset >= len(self._window_ids):
            return None
        check_from = self._text.length
        self._text.append(self._window_delta(allow_partial=True))
        self._prefix_offset = self._read_offset = len(self._window_ids)
        if self.num_output_tokens <= self.min_tokens:
            return None
        return self._check_stop(check_from)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the caller: all of it (`delta=False`) or only what is new since last time.

        While not `finished`, the longest tail of the text that could still begin a stop string
        (at most `stop_buffer_length` characters) is held back; vLLM holds back a fixed
        `stop_buffer_length`. `finished=True` flushes and releases everything.
        """
        if finished:
            self.flush()
        length = self._text.length
        if self.stop_buffer_length and not finished:
            length -= self._held_back()
        if not delta:
            return self._text.read(0, length)
        start = self._released
        if start >= length:
            return ""
        self._released = length
        return self._text.read(start, length)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if not self.stop_buffer_length:
            return 0
        tail = self._text.read(self._text.length - self.stop_buffer_length)
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(tail)), 0, -1)
                    if tail.endswith(s[:k])), default=0)

    def _decode_next(self, token_id: int) -> str:
        """The text `token_id` completes ('' while a character is still incomplete). A fast (Rust) tokenizer decodes it
        in the DecodeStream, whose window moves as this one does (kept for `flush`); where that fails (a window whose
        text does not extend its prefix's), this request decodes in Python from then on."""
        if token_id in self._skip_ids:
            return ""
        self._window_ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id) or ""
            except Exception:  # pylint: disable=broad-except  (tokenizers raises its own errors as Exception)
                self._stream = None
                text = self._window_delta(allow_partial=False)
        else:
            text = self._window_delta(allow_partial=False)
        if text:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._window_ids)
        return text

    def _window_delta(self, allow_partial: bool) -> str:
        """Text of `ids[prefix:]` beyond that of `ids[prefix:read]`; '' if it ends mid-character."""
        ids = self._window_ids
        prefix_text = detokenize(self.tokenizer, ids[self._prefix_offset:self._read_offset],
                                 self.skip_special_tokens)
        new_text = detokenize(self.tokenizer, ids[self._prefix_offset:], self.skip_special_tokens)
        if len(new_text) <= len(prefix_text):
            return ""
        if not allow_partial and new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return new_text[len(prefix_text):]

    def _check_stop(self, check_from: int) -> str | None:
        """Find the first stop string ending after `check_from`; cut the text there."""
        if not self.stop or check_from >= self._text.length:
            return None
        window_start = max(0, check_from - max(map(len, self.stop)) + 1)
        match = find_stop_string(self._text.read(window_start), check_from - window_start, self.stop)
        if match is None:
            return None
        stop, start = match
        start += window_start
        self._text.truncate(start + len(stop) if self.include_stop_str_in_output else start)
        self.stop_reason = stop
        return stop


def _decode_stream(backend: Any, context: list[int], skip_special_tokens: bool):
    """A DecodeStream over `backend` (a `tokenizers.Tokenizer`) after the decode context, or None where there is no
    Rust tokenizer (a slow tokenizer) or no DecodeStream that takes context ids (tokenizers < 0.22)."""
    if DecodeStream is None or not isinstance(backend, tokenizers.Tokenizer):
        return None
    try:
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:
        return None


def find_stop_string(text: str, new_from: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """The stop string occurrence in `text` that ends first after `new_from`: (stop, start).

    text[:new_from] was searched before, so an occurrence must end past it (it may begin up
    to len(stop) - 1 characters earlier). The earliest-ending occurrence is the one a
    character-by-character stream meets first, so the answer does not depend on how the
    text was split into updates; of two ending at the same place the longer one wins.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stop:
        start = text.find(s, max(0, new_from - len(s) + 1))
        if start < 0:
            continue
        candidate = (start + len(s), start, s)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return None if best is None else (best[2], best[1])

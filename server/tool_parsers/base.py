"""What every tool-call format shares: the parse result, helpers, and the streaming reader.

A format's parser is one function, `split(text, final)`. With `final` it reads a whole output:
the calls found and the rest as content (malformed or unfinished call text stays content, never an
error). Without it, it reads an output still being generated and returns only what later text cannot
change: a prefix of the final content and a prefix of the final calls. `CallStream` turns that into
streamed content and calls, so the streamed pieces always reassemble to the non-streamed result.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Parsed:
    """Content text (possibly empty or whitespace) and calls [{"name", "arguments": JSON text}]."""

    content: str
    calls: tuple[dict[str, str], ...] = ()

    @property
    def message_content(self) -> str | None:
        """The message's `content`: None when there is no text besides whitespace."""
        return self.content if self.content.strip() else None


class ToolCallParser:
    """One format's reader; `tools` are the request's tools ([{"type": "function", "function": {...}}])."""

    name = ""

    def __init__(self, tools: tuple[dict[str, Any], ...] = ()):
        self.tools = {t["function"]["name"]: t["function"] for t in tools}

    def split(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        """A finished output's content and calls."""
        return self.split(text, True)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def make_call(name: Any, arguments: Any) -> dict[str, str] | None:
    """{"name", "arguments"} from a decoded call; None unless name is a string and arguments an object
    (or an object's JSON text, as some models write it)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to read
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return {"name": name, "arguments": dumps(arguments)}


def held_from(text: str, markers: tuple[str, ...]) -> int:
    """Where a possible start of one of `markers` begins at the end of `text` (len(text) if none):
    what lies after it must wait for more text."""
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        tail = text[start:]
        if any(m.startswith(tail) for m in markers):
            return start
    return len(text)


BlockReader = Callable[[str, int, bool], "tuple[list[dict[str, str]] | None, int] | None"]


def scan_marked(text: str, final: bool, marker: str, read_block: BlockReader) -> Parsed:
    """Formats whose calls each start with `marker` (hermes, qwen3_coder, mistral).

    Text before the first marker is content. `read_block(text, after_marker, final)` reads one block:
    None while it is unfinished (`final` False), else (calls, end) with calls None when the block is
    malformed (its text then becomes content). Text between blocks is content unless it is whitespace;
    so is the text after the last block, once the output is final.
    """
    first = text.find(marker)
    if first < 0:
        return Parsed(text if final else text[:held_from(text, (marker,))])
    content, calls, pos = text[:first], [], first
    while True:
        start = text.find(marker, pos)
        if start < 0:
            if final and text[pos:].strip():
                content += text[pos:]
            break
        if text[pos:start].strip():
            content += text[pos:start]
        block = read_block(text, start + len(marker), final)
        if block is None:  # unfinished: content if the output ended here, else wait
            if final:
                content += text[start:]
            break
        found, end = block
        if found is None:
            content += text[start:end]
        else:
            calls.extend(found)
        pos = end
    return Parsed(content, tuple(calls))


def whole_output(text: str, final: bool, may_start: Callable[[str], bool],
                 parse_all: Callable[[str], list[dict[str, str]]]) -> Parsed:
    """Formats whose output is either all calls or all content (llama3_json, pythonic).

    While the output may still be calls (`may_start` of its stripped start), nothing is released;
    once it cannot, it is content. Finished: the calls `parse_all` reads, or all of it as content."""
    if not final:
        return Parsed("" if may_start(text.lstrip()) else text)
    calls = parse_all(text.strip()) if may_start(text.lstrip()) else []
    return Parsed("", tuple(calls)) if calls else Parsed(text)


class CallStream:
    """One streamed output read by a parser: `feed` each text delta, get the new pieces.

    Pieces are ("content", text) and ("call", {"name", "arguments"}). Content waits until it holds
    something besides whitespace (the message's content is None otherwise); `parallel` False keeps
    the first call only, as the non-streamed reply does."""

    def __init__(self, parser: ToolCallParser, parallel: bool = True):
        self.parser, self.parallel = parser, parallel
        self.text, self.sent_chars, self.sent_calls = "", 0, 0

    def feed(self, delta: str, final: bool) -> list[tuple[str, Any]]:
        self.text += delta
        parsed = self.parser.split(self.text, final)
        pieces: list[tuple[str, Any]] = []
        if parsed.content.strip() and len(parsed.content) > self.sent_chars:
            pieces.append(("content", parsed.content[self.sent_chars:]))
            self.sent_chars = len(parsed.content)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        pieces += [("call", call) for call in calls[self.sent_calls:]]
        self.sent_calls = len(calls)
        return pieces


def parse_output(parser: ToolCallParser, text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, str]]]:
    """(message content, calls) of a finished output, as CallStream would stream it."""
    parsed = parser.parse(text)
    calls = list(parsed.calls if parallel else parsed.calls[:1])
    return parsed.message_content, calls

"""`mistral`: Mistral's tool calls after the [TOOL_CALLS] token, in either of its two spellings.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}      (v11+ tokenizers)

[TOOL_CALLS] is a special token, dropped when special tokens are skipped: an output that is nothing
but the JSON array of calls is read as calls too.
"""

from __future__ import annotations

import json
import re

from server.tool_parsers.base import Parsed, ToolCallParser, make_call, scan_marked, whole_output

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")
_DECODER = json.JSONDecoder()


def _array_calls(value) -> list[dict[str, str]] | None:
    if not isinstance(value, list) or not value:
        return None
    calls = [make_call(item.get("name"), item.get("arguments", {})) if isinstance(item, dict) else None
             for item in value]
    return None if any(c is None for c in calls) else calls


def _read_block(text: str, start: int, final: bool) -> tuple[list | None, int] | None:
    """One block after [TOOL_CALLS]: a JSON array of calls, or name[ARGS]{...}; None while unfinished."""
    pos = len(text) - len(text[start:].lstrip())
    if text.startswith("[", pos) and not text.startswith(ARGS, pos):
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to read
            return _unread(final, text)
        return _array_calls(value), end
    named = _NAME.match(text, start)
    if named is None:
        return _unread(final, text)
    try:
        value, end = _DECODER.raw_decode(text, named.end())
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to read
        return _unread(final, text)
    call = make_call(named.group(1), value)
    return ([call] if call else None), end


def _unread(final: bool, text: str) -> tuple[None, int] | None:
    """Not (yet) a block: wait for more text, or at the end, the rest is content."""
    return (None, len(text)) if final else None


def _bare_array(text: str) -> list[dict[str, str]]:
    try:
        value, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to read
        return []
    return (_array_calls(value) or []) if not text[end:].strip() else []


class MistralParser(ToolCallParser):
    name = "mistral"

    def split(self, text: str, final: bool) -> Parsed:
        stripped = text.lstrip()
        if MARKER not in text and stripped.startswith("[") and not MARKER.startswith(stripped[:len(MARKER)]):
            return whole_output(text, final, lambda s: s.startswith("["), _bare_array)
        if MARKER not in text and stripped and MARKER.startswith(stripped) and not final:
            return Parsed("")
        return scan_marked(text, final, MARKER, _read_block)

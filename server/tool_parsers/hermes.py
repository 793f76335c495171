"""`hermes`: Hermes 2 Pro / Qwen2.5 / Qwen3 tool calls, one JSON object per <tool_call> block.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several blocks may follow one another; text before them is the message's content.
"""

from __future__ import annotations

import json

from server.tool_parsers.base import Parsed, ToolCallParser, make_call, scan_marked

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def read_tagged(text: str, start: int, final: bool, body_call) -> tuple[list | None, int] | None:
    """A block from `start` (just past <tool_call>) to </tool_call>: its call by `body_call`, or None
    while the close tag has not come; a body that is not a call gives (None, end)."""
    close = text.find(CLOSE, start)
    if close < 0:
        return None
    call = body_call(text[start:close])
    return ([call] if call is not None else None), close + len(CLOSE)


def json_body_call(body: str) -> dict[str, str] | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to read
        return None
    if not isinstance(value, dict):
        return None
    return make_call(value.get("name"), value.get("arguments", value.get("parameters", {})))


class HermesParser(ToolCallParser):
    name = "hermes"

    def split(self, text: str, final: bool) -> Parsed:
        return scan_marked(text, final, OPEN, lambda t, s, f: read_tagged(t, s, f, json_body_call))

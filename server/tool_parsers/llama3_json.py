"""`llama3_json`: Llama 3.x's JSON tool calls, the whole output being the call(s).

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": 1}}

"arguments" is accepted for "parameters"; several calls are separated by ";".
"""

from __future__ import annotations

import json

from server.tool_parsers.base import Parsed, ToolCallParser, make_call, whole_output

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def may_start(text: str) -> bool:
    """Whether an output starting with `text` (stripped) may still be calls."""
    return text.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(text)


def _drop_tag(text: str) -> str:
    return text[len(PYTHON_TAG):].lstrip() if text.startswith(PYTHON_TAG) else text


def parse_all(text: str) -> list[dict[str, str]]:
    """Every call of a whole output; [] unless all of it is calls."""
    rest, calls = _drop_tag(text.strip()), []
    if not rest.startswith("{"):
        return []
    while rest:
        try:
            value, end = _DECODER.raw_decode(rest)
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to read
            return []
        if not isinstance(value, dict) or "parameters" not in value and "arguments" not in value:
            return []
        call = make_call(value.get("name"), value.get("parameters", value.get("arguments")))
        if call is None:
            return []
        calls.append(call)
        rest = rest[end:].strip()
        if rest.startswith(";"):
            rest = rest[1:].strip()
        rest = _drop_tag(rest)
    return calls


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"

    def split(self, text: str, final: bool) -> Parsed:
        return whole_output(text, final, may_start, parse_all)

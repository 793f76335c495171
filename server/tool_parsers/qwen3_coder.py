"""`qwen3_coder`: Qwen3-Coder's XML-style tool calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text: it is kept as a string where the tool's schema says string (or does not
know the parameter), else read as JSON (numbers, booleans, objects, arrays), falling back to the text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.tool_parsers.base import Parsed, ToolCallParser, dumps, scan_marked
from server.tool_parsers.hermes import OPEN, read_tagged

_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"

    def split(self, text: str, final: bool) -> Parsed:
        return scan_marked(text, final, OPEN, lambda t, s, f: read_tagged(t, s, f, self._call))

    def _call(self, body: str) -> dict[str, str] | None:
        match = _FUNCTION.fullmatch(body)
        if match is None:
            return None
        name, inner = match.groups()
        properties = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        arguments, pos = {}, 0
        for param in _PARAMETER.finditer(inner):
            if inner[pos:param.start()].strip():  # stray text between parameters: not this format
                return None
            key, raw = param.groups()
            arguments[key] = _value(_trim_newline(raw), properties.get(key))
            pos = param.end()
        if inner[pos:].strip():
            return None
        return {"name": name, "arguments": dumps(arguments)}


def _trim_newline(raw: str) -> str:
    """The value without the one newline the format puts on each side of it."""
    raw = raw.removeprefix("\n")
    raw = raw.removesuffix("\n")
    return raw


def _value(raw: str, schema: dict[str, Any] | None) -> Any:
    kind = (schema or {}).get("type", "string")
    if schema is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
        return raw
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to read
        return raw

"""`pythonic`: Llama 3.2 / Llama 4 style calls, the whole output being a Python list of calls.

    [get_weather(city="Paris", unit="celsius"), get_time()]

Llama 4 may wrap it in <|python_start|> ... <|python_end|>. Arguments are keyword arguments whose
values are Python literals (JSON's true / false / null are read too).
"""

from __future__ import annotations

import ast
from typing import Any

from server.tool_parsers.base import Parsed, ToolCallParser, dumps, whole_output

START, END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


def may_start(text: str) -> bool:
    return text.startswith(("[", START)) or START.startswith(text)


def _unwrap(text: str) -> str:
    if text.startswith(START):
        text = text[len(START):]
        text = text.removesuffix(END)
    return text.strip()


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _call(node: ast.AST) -> dict[str, str]:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments")
    name = ast.unparse(node.func)  # a name, or a dotted one
    if not all(part.isidentifier() for part in name.split(".")):
        raise ValueError("not a function name")
    arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
    if len(arguments) != len(node.keywords):
        raise ValueError("**kwargs")
    return {"name": name, "arguments": dumps(arguments)}


def parse_all(text: str) -> list[dict[str, str]]:
    try:
        tree = ast.parse(_unwrap(text), mode="eval").body
        if not isinstance(tree, ast.List):
            return []
        return [_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return []


class PythonicParser(ToolCallParser):
    name = "pythonic"

    def split(self, text: str, final: bool) -> Parsed:
        return whole_output(text, final, may_start, parse_all)

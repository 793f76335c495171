"""Tool-call parsers by vLLM's `--tool-call-parser` names, and `auto`: the one a model's family writes.

One module per format (hermes, mistral, llama3_json, pythonic, qwen3_coder); base.py holds what they
share, among it the streaming reader (CallStream).
"""

from __future__ import annotations

from typing import Any

from server.tool_parsers.base import CallStream, Parsed, ToolCallParser, parse_output
from server.tool_parsers.hermes import HermesParser
from server.tool_parsers.llama3_json import Llama3JsonParser
from server.tool_parsers.mistral import MistralParser
from server.tool_parsers.pythonic import PythonicParser
from server.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (
    HermesParser, MistralParser, Llama3JsonParser, PythonicParser, Qwen3CoderParser)}
AUTO = "auto"

# What a chat template writes tells the format best; checked in this order (Qwen3-Coder's template
# has <tool_call> as hermes' does, and <function= besides).
_TEMPLATE_MARKS = (("qwen3_coder", ("<tool_call>", "<function=")), ("hermes", ("<tool_call>",)),
                   ("mistral", ("[TOOL_CALLS]",)), ("pythonic", ("<|python_start|>",)),
                   ("llama3_json", ("<|python_tag|>",)))
# Else the architecture family, where it has one format (Llama's and Gemma's have several).
_FAMILY = {"qwen2": "hermes", "qwen3": "hermes", "mistral": "mistral"}

__all__ = ["AUTO", "PARSERS", "CallStream", "Parsed", "ToolCallParser", "make_parser", "parse_output",
           "resolve_parser_name"]


def make_parser(name: str, tools: tuple[dict[str, Any], ...] = ()) -> ToolCallParser:
    """A parser of the named format for one request's tools; KeyError for an unknown name."""
    return PARSERS[name](tools)


def resolve_parser_name(name: str | None, chat_template: str | None, family: str | None) -> str | None:
    """The parser to serve: `name`, or for "auto" the format the chat template or family shows;
    ValueError when auto cannot tell or the name is unknown."""
    if name is None or name in PARSERS:
        return name
    if name != AUTO:
        raise ValueError(f"--tool-call-parser {name!r}: choose auto or one of {', '.join(PARSERS)}")
    template = chat_template or ""
    for parser, marks in _TEMPLATE_MARKS:
        if all(mark in template for mark in marks):
            return parser
    if family in _FAMILY:
        return _FAMILY[family]
    raise ValueError(f"--tool-call-parser auto: the {family or 'unknown'} family's chat template shows no "
                     f"tool-call format; name one of {', '.join(PARSERS)}")

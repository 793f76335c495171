"""OpenAI tool calling: tool_choice -> an output constraint, history turns, parsing and streaming calls.

    tool_choice "none"      -> plain generation (the tools are still rendered, as vLLM does)
    tool_choice "auto"      -> plain generation; the output is parsed (--tool-call-parser llama3_json:
                               Llama 3.x's `{"name": ..., "parameters": ...}`, optionally after
                               <|python_tag|>, several separated by ";") into calls, else it is content
    tool_choice "required"  -> constrained to a JSON array of {"name", "parameters"} (one item unless
                               parallel_tool_calls), each item's parameters by that tool's schema
    tool_choice {function}  -> constrained to the named function's parameters schema

A call's `arguments` is a JSON string. Streaming sends each call as OpenAI does: first its index, id,
type and name with empty arguments, then argument fragments (a named call's arguments stream as they are
generated; "required" and "auto" calls once their JSON is complete).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxpaged.sampling_params import StructuredOutputsParams
from server.config import TOOL_CALL_PARSERS  # noqa: F401  (re-exported: the parsers this module implements)
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, ChatMessage

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_FRAGMENT_CHARS = 16  # a completed call's arguments stream in pieces of this many characters
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools and tool_choice ask for."""

    mode: str  # "none" (no tools or tool_choice none), "auto", "required" or "named"
    tools: tuple[dict[str, Any], ...] = ()  # for the chat template: [{"type": "function", "function": {...}}]
    name: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None
    parallel: bool = True  # parallel_tool_calls: False keeps one call (the schema's, or auto's first)

    @property
    def calls_tools(self) -> bool:
        return self.mode in ("auto", "required", "named")

    @property
    def forced(self) -> bool:
        """The output IS the call(s) (named / required): no free text to stream."""
        return self.mode in ("required", "named")


def plan_tools(body: ChatCompletionRequest, auto_enabled: bool) -> ToolPlan:
    """Check tools and tool_choice (400s naming the field) and build the constraint they need."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    tools = _check_tools(body)
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
        if not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                              '"function": {"name": ...}}', "tool_choice")
        if name not in by_name:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                              f"({', '.join(by_name)})", "tool_choice")
        schema = by_name[name].get("parameters") or _EMPTY_PARAMETERS
        return ToolPlan("named", tools, name, StructuredOutputsParams(json=schema))
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        return ToolPlan("required", tools, None, StructuredOutputsParams(json=_required_schema(
            list(by_name.values()), body.parallel_tool_calls)))
    if choice == "auto":
        if not auto_enabled:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser',
                              "tool_choice")
        return ToolPlan("auto", tools, parallel=body.parallel_tool_calls)
    raise bad_request(f"tool_choice={choice!r}: must be none, auto, required or a named function", "tool_choice")


def _check_tools(body: ChatCompletionRequest) -> tuple[dict[str, Any], ...]:
    seen, tools = set(), []
    for i, tool in enumerate(body.tools):
        name = tool.function.name
        if tool.type != "function":
            raise bad_request(f"tools[{i}].type={tool.type!r}: only 'function' tools are supported", "tools")
        if not _NAME.match(name):
            raise bad_request(f"tools[{i}].function.name={name!r}: use 1-64 letters, digits, _ or -", "tools")
        if name in seen:
            raise bad_request(f"tools[{i}]: the function name {name!r} is used twice", "tools")
        if tool.function.parameters is not None and tool.function.parameters.get("type", "object") != "object":
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema of type object", "tools")
        seen.add(name)
        tools.append({"type": "function", "function": tool.function.model_dump(exclude_none=True)})
    return tuple(tools)


def _required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """[{"name": <a tool>, "parameters": <its arguments>}, ...]: one or more calls (exactly one unless parallel)."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                               "parameters": f.get("parameters") or _EMPTY_PARAMETERS},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- history turns -------------------------------------------------------------------


def history_fields(i: int, message: ChatMessage) -> dict[str, Any]:
    """The template fields of an assistant turn's tool_calls or a tool turn's tool_call_id."""
    fields: dict[str, Any] = {}
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", "messages")
        fields["tool_calls"] = [{"id": call.id or new_call_id(), "type": "function", "function": {
            "name": call.function.name, "arguments": _arguments_object(i, call.function.arguments)}}
            for call in message.tool_calls]
    if message.role == "tool":
        if not message.tool_call_id:
            raise bad_request(f"messages[{i}]: a tool message needs tool_call_id", "messages")
        fields["tool_call_id"] = message.tool_call_id
    return fields


def _arguments_object(i: int, arguments: str | dict[str, Any]) -> dict[str, Any]:
    """Templates (Llama 3.x's among them) render arguments with `tojson`: give them the object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        raise bad_request(f"messages[{i}]: tool_calls arguments must be a JSON object string", "messages") from None
    if not isinstance(value, dict):
        raise bad_request(f"messages[{i}]: tool_calls arguments must be a JSON object string", "messages")
    return value


# ---- the model's output -> calls ---------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, str]]]:
    """(content, [{"name", "arguments"}]) of a finished output; no calls: the text is the content."""
    if plan.mode == "named":
        return None, [{"name": plan.name, "arguments": text}]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut short (finish_reason "length"): no complete call
            return text, []
        return None, [{"name": it["name"], "arguments": _dumps(it["parameters"])} for it in items]
    if plan.mode == "auto":
        calls = parse_llama3_json(text)
        return (None, calls if plan.parallel else calls[:1]) if calls else (text, [])
    return text, []


def parse_llama3_json(text: str) -> list[dict[str, str]]:
    """Llama 3.x JSON tool calls: `[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]*`; [] if not."""
    rest = text.strip()
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG):].lstrip()
    if not rest.startswith("{"):
        return []
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except ValueError:
            return []
        arguments = value.get("parameters", value.get("arguments")) if isinstance(value, dict) else None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
            return []
        calls.append({"name": value["name"], "arguments": _dumps(arguments)})
        rest = rest[end:].strip()
        if rest.startswith(";"):
            rest = rest[1:].strip()
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG):].lstrip()
    return calls


def looks_like_call(text: str) -> bool | None:
    """Streaming "auto": True/False once the output's start tells; None while it is only whitespace."""
    rest = text.lstrip()
    if not rest:
        return None
    if PYTHON_TAG.startswith(rest[:len(PYTHON_TAG)]) and len(rest) < len(PYTHON_TAG):
        return None
    return rest.startswith("{") or rest.startswith(PYTHON_TAG)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def message_calls(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The non-streamed message's tool_calls."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]


def call_head_delta(index: int, name: str) -> dict[str, Any]:
    """The first delta of a streamed call: index, id, type, name and empty arguments."""
    return {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def arguments_delta(index: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def call_deltas(first_index: int, calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Deltas of complete calls: per call its head, then its arguments in fragments."""
    deltas = []
    for offset, call in enumerate(calls):
        index = first_index + offset
        deltas.append(call_head_delta(index, call["name"]))
        args = call["arguments"]
        deltas += [arguments_delta(index, args[i:i + ARGUMENT_FRAGMENT_CHARS])
                   for i in range(0, len(args), ARGUMENT_FRAGMENT_CHARS)]
    return deltas

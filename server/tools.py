"""OpenAI tool calling: tool_choice -> an output constraint, history turns, tool calls as deltas.

    tool_choice "none"      -> plain generation (the tools are still rendered, as vLLM does)
    tool_choice "auto"      -> plain generation (or the request's own structured output); the output is read
                               by the --tool-call-parser format (server/tool_parsers) into content and calls
    tool_choice "required"  -> constrained to a JSON array of {"name", "parameters"} (one item unless
                               parallel_tool_calls), each item's parameters by that tool's schema
    tool_choice {function}  -> constrained to the named function's parameters schema

Forced calls ("required", named) are the same JSON whatever the parser: the constraint, not the model's
own format, shapes them, so they are schema-true with every parser. A function with `strict: true` must
have a closed schema, as OpenAI requires (every object's additionalProperties false, all its properties
required). A call's `arguments` is a JSON string. Streaming sends each call as OpenAI does: first its index,
id, type and name with empty arguments, then argument fragments (a named call's arguments stream as they
are generated; "required" calls once their JSON is complete, "auto" calls once the parser has read them).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxpaged.sampling_params import StructuredOutputsParams
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, ChatMessage
from server.tool_parsers import ToolCallParser, make_parser, parse_output

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
    parser: ToolCallParser | None = None  # "auto": the --tool-call-parser format, for these tools

    @property
    def calls_tools(self) -> bool:
        return self.mode in ("auto", "required", "named")

    @property
    def forced(self) -> bool:
        """The output IS the call(s) (named / required): no free text to stream."""
        return self.mode in ("required", "named")


def plan_tools(body: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """Check tools and tool_choice (400s naming the field) and build the constraint they need.

    `parser`: the served --tool-call-parser (None: "auto" is not served)."""
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
        if parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser',
                              "tool_choice")
        return ToolPlan("auto", tools, parallel=body.parallel_tool_calls, parser=make_parser(parser, tools))
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
        if tool.function.strict:
            _check_closed(tool.function.parameters or {}, f"tools[{i}].function.parameters")
        seen.add(name)
        tools.append({"type": "function", "function": tool.function.model_dump(exclude_none=True)})
    return tuple(tools)


def _check_closed(schema: Any, where: str) -> None:
    """strict: true, as OpenAI: every object schema closed (additionalProperties false) and all its
    properties required; a 400 naming the first place that is not."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _check_closed(item, f"{where}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    properties = schema.get("properties")
    if schema.get("type") == "object" or isinstance(properties, dict):
        if schema.get("additionalProperties") is not False:
            raise bad_request(f"{where}: strict function schemas must set additionalProperties: false on every "
                              "object", "tools")
        missing = sorted(set(properties or {}) - set(schema.get("required") or ()))
        if missing:
            raise bad_request(f"{where}: strict function schemas must list every property in required "
                              f"(missing {', '.join(missing)})", "tools")
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            for name, sub in value.items():
                _check_closed(sub, f"{where}.{key}.{name}")
        elif key in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "not", "additionalProperties"):
            _check_closed(value, f"{where}.{key}")


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
        return required_calls(text)
    if plan.mode == "auto":
        return parse_output(plan.parser, text, plan.parallel)
    return text, []


def required_calls(text: str) -> tuple[str | None, list[dict[str, str]]]:
    """"required"'s JSON array as calls; cut short (finish_reason "length"): no call, the text as content."""
    try:
        items = json.loads(text)
    except ValueError:
        return text, []
    return None, [{"name": it["name"], "arguments": _dumps(it["parameters"])} for it in items]


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

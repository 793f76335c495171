"""server/tools.py without a model: tool_choice planning, strict schemas, the llama3_json parser, streamed
call deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server.chat import _ChoiceChunks
from server.chat_output import OutputPlan, StreamReader
from server.choices import Delta
from server.config import ServerConfig
from server.errors import OpenAIError
from server.protocol import ChatCompletionRequest
from server.tool_parsers.llama3_json import parse_all as parse_llama3_json
from server.tools import call_deltas, parse_calls, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_plan_tools_checks_and_constrains():
    assert plan_tools(body(), None).mode == "none"
    named = plan_tools(body(tools=[WEATHER, CLOCK], tool_choice={"type": "function",
                                                                 "function": {"name": "get_weather"}}), None)
    assert named.mode == "named" and named.constraint.json == WEATHER["function"]["parameters"]
    required = plan_tools(body(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False), None)
    schema = required.constraint.json
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel_tool_calls
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # city is required
    assert plan_tools(body(tools=[WEATHER], tool_choice="auto"), "llama3_json").mode == "auto"
    for kw, auto, match in [
        (dict(tool_choice="required"), None, "needs tools"),
        (dict(tools=[WEATHER]), None, "enable-auto-tool-choice"),  # auto is the default with tools
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "hermes", "nope"),
        (dict(tools=[WEATHER, WEATHER], tool_choice="none"), "hermes", "used twice"),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "hermes", "must be none"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}], tool_choice="none"), "hermes",
         "letters"),
    ]:
        with pytest.raises(OpenAIError, match=match) as err:
            plan_tools(body(**kw), auto)
        assert err.value.status == 400 and err.value.param in ("tool_choice", "tools")


def test_auto_tool_choice_needs_a_parser():
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(served_model_names=("m",), enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="llama3_json"):
        ServerConfig(served_model_names=("m",), tool_call_parser="hermes2")
    with pytest.raises(ValueError, match="deepseek_r1"):
        ServerConfig(served_model_names=("m",), reasoning_parser="r1")


@pytest.mark.parametrize("text, calls", [
    ('{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
    ('<|python_tag|>{"name": "f", "arguments": {"a": "x"}}', [("f", {"a": "x"})]),
    ('  {"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1, 2]}}',
     [("f", {}), ("g", {"b": [1, 2]})]),
    ("Hello there!", []),
    ('{"name": "f"}', []),  # no arguments object: not a call
    ('{"name": "f", "parameters": {"a": 1}', []),  # cut short
    ('{"name": "f", "parameters": {}} and then some text', []),
])
def test_llama3_json_parser(text, calls):
    parsed = parse_llama3_json(text)
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed] == calls


def test_auto_without_parallel_tool_calls_keeps_the_first_call():
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    for parallel, names in ((True, ["get_time", "get_weather"]), (False, ["get_time"])):
        plan = plan_tools(body(tools=[WEATHER, CLOCK], tool_choice="auto", parallel_tool_calls=parallel),
                          "llama3_json")
        assert [c["name"] for c in parse_calls(plan, text)[1]] == names


def _stream(plan, pieces, finish="stop") -> list[dict]:
    state, head, chunks = _ChoiceChunks(StreamReader(OutputPlan(plan))), {"id": "x"}, []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunks += state.chunks(head, 0, Delta(piece, [], None, finish if last else None, None), None)
    return chunks


@pytest.mark.parametrize("mode_kw, text", [
    (dict(tool_choice="required"), '[{"name": "get_weather", "parameters": {"city": "a very long city name"}}]'),
    (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}), '{"city": "Paris, France"}'),
    (dict(tool_choice="auto"), '{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                               '"parameters": {"city": "Rome"}}'),
    (dict(tool_choice="auto"), "  Just a plain answer, no call."),
])
def test_streamed_deltas_reassemble_to_the_parsed_calls(mode_kw, text):
    plan = plan_tools(body(tools=[WEATHER, CLOCK], **mode_kw), "llama3_json")
    content, calls = parse_calls(plan, text)
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    chunks = _stream(plan, pieces)
    got: dict[int, dict] = {}
    streamed_content = ""
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        streamed_content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            if "id" in tc:
                got[tc["index"]] = {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
            else:
                got[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert [got[i] for i in sorted(got)] == calls
    assert streamed_content == (content or "")
    assert chunks[-1]["choices"][0]["finish_reason"] == ("tool_calls" if calls else "stop")
    assert all(len(c["arguments"]) > 0 for c in calls) or not calls


def test_complete_calls_stream_name_first_then_fragments():
    deltas = call_deltas(0, [{"name": "f", "arguments": '{"x": "' + "y" * 40 + '"}'}])
    head = deltas[0]["tool_calls"][0]
    assert head["id"].startswith("call_") and head["function"] == {"name": "f", "arguments": ""}
    assert len(deltas) > 2 and all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[1:])


CLOSED = {"type": "object", "properties": {"city": {"type": "string"}, "where": {
    "type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"], "additionalProperties": False}},
          "required": ["city", "where"], "additionalProperties": False}


def _strict(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "strict": True, "parameters": parameters}}


def test_strict_functions_need_closed_schemas():
    assert plan_tools(body(tools=[_strict(CLOSED)], tool_choice="required"), None).mode == "required"
    open_inner = json.loads(json.dumps(CLOSED))
    del open_inner["properties"]["where"]["additionalProperties"]
    not_required = {**CLOSED, "required": ["city"]}
    for schema, match in [({**CLOSED, "additionalProperties": True}, r"tools\[0\].function.parameters: strict"),
                          (open_inner, r"parameters.properties.where: strict"),
                          (not_required, "missing where")]:
        with pytest.raises(OpenAIError, match=match) as err:
            plan_tools(body(tools=[_strict(schema)], tool_choice="none"), None)
        assert err.value.param == "tools"
    loose = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert plan_tools(body(tools=[loose], tool_choice="none"), None).mode == "none"  # not strict: not checked


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Checking.<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": '
               '"get_weather", "arguments": {"city": "Rome"}}</tool_call>'),
    ("pythonic", '[get_time(), get_weather(city="Rome")]'),
    ("qwen3_coder", "<tool_call><function=get_weather><parameter=city>Rome</parameter></function></tool_call>"),
])
def test_every_parser_streams_through_the_chat_chunks(parser, text):
    plan = plan_tools(body(tools=[WEATHER, CLOCK], tool_choice="auto"), parser)
    content, calls = parse_calls(plan, text)
    chunks = _stream(plan, [text[i:i + 7] for i in range(0, len(text), 7)])
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    names = [tc["function"]["name"] for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []
             if "id" in tc]
    assert streamed == (content or "") and names == [c["name"] for c in calls] and calls
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

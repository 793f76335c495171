"""Every tool-call format and the reasoning parser through the real server on the real SmolLM2 (CPU).

SmolLM2 writes none of these formats on its own, so a regex structured output forces each format's text
(tools and a constraint together: the constraint shapes the text, the parser reads it). Nor does it think
on its own: the reasoning tests give it an earlier turn that thinks in <think> tags, which it copies, and
their constraint shapes the answer after its reasoning. One engine, one app per --tool-call-parser over it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import re
import types

import httpx
import jsonschema
import pytest

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged import EngineArgs, LLMEngine
from jaxpaged.sampling_params import StructuredOutputsParams
from server.app import build_app
from server.chat import render_chat
from server.config import ServerConfig
from server.errors import OpenAIError
from server.protocol import ChatMessage
from server.reasoning import ReasoningParser, after_reasoning
from tests.server.conftest import LiveServer, serve
from tests.server.test_structured_outputs import ASK, TIME_TOOL, WEATHER_TOOL, _reassemble, chat, stream_chunks

MODEL = "smollm2"
TOOLS = [WEATHER_TOOL, TIME_TOOL]
PARSERS = ("hermes", "mistral", "llama3_json", "pythonic", "qwen3_coder")
CITY, UNIT, ZONE = "[A-Z][a-z]{2,9}", "(celsius|fahrenheit)", "[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}"


def _lit(text: str) -> str:
    """`text` as a literal in llguidance's (Rust) regex syntax; < and > stay bare (\\< is a word boundary)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$-&~#" else c for c in text)


def _json_args() -> str:
    return _lit('{"city": "') + CITY + _lit('", "unit": "') + UNIT + _lit('"}')


ZONE_ARGS = _lit('{"timezone": "') + ZONE + _lit('"}')
# Each format's text for a weather call then a time call (several calls in one message).
FORMATS = {
    "hermes": _lit('<tool_call>\n{"name": "get_weather", "arguments": ') + _json_args() + _lit('}\n</tool_call>\n')
    + _lit('<tool_call>\n{"name": "get_time", "arguments": ') + ZONE_ARGS + _lit('}\n</tool_call>'),
    "mistral": _lit('[TOOL_CALLS][{"name": "get_weather", "arguments": ') + _json_args()
    + _lit('}, {"name": "get_time", "arguments": ') + ZONE_ARGS + _lit('}]'),
    "llama3_json": _lit('{"name": "get_weather", "parameters": ') + _json_args()
    + _lit('}; {"name": "get_time", "parameters": ') + ZONE_ARGS + _lit("}"),
    "pythonic": _lit('[get_weather(city="') + CITY + _lit('", unit="') + UNIT + _lit('"), get_time(timezone="')
    + ZONE + _lit('")]'),
    "qwen3_coder": _lit("<tool_call>\n<function=get_weather>\n<parameter=city>\n") + CITY
    + _lit("\n</parameter>\n<parameter=unit>\n") + UNIT + _lit("\n</parameter>\n</function>\n</tool_call>\n")
    + _lit("<tool_call>\n<function=get_time>\n<parameter=timezone>\n") + ZONE
    + _lit("\n</parameter>\n</function>\n</tool_call>"),
}


@pytest.fixture(scope="module")
def servers(smollm2):
    """{parser: LiveServer} over one engine; "reasoning": hermes with --reasoning-parser qwen3; "r1":
    --reasoning-parser deepseek_r1 (its outputs start inside the reasoning: SmolLM2's never closes it)."""
    engine = LLMEngine(EngineArgs(model="unused", max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=128,
                                  num_pages=600, compilation_cache_dir=None), loaded=smollm2)
    llm = AsyncLLM(engine)
    configs = {p: ServerConfig(served_model_names=(MODEL,), enable_auto_tool_choice=True, tool_call_parser=p)
               for p in PARSERS}
    configs["reasoning"] = ServerConfig(served_model_names=(MODEL,), enable_auto_tool_choice=True,
                                        tool_call_parser="hermes", reasoning_parser="qwen3")
    configs["r1"] = ServerConfig(served_model_names=(MODEL,), reasoning_parser="deepseek_r1")
    try:
        with contextlib.ExitStack() as stack:
            yield {name: LiveServer(stack.enter_context(serve(build_app(llm, c))), llm, MODEL)
                   for name, c in configs.items()}
    finally:
        llm.shutdown()


def _calls(message: dict) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]


def _check_schema_true(calls: list[dict]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


@pytest.mark.parametrize("parser", PARSERS)
def test_each_format_forced_by_a_regex_is_parsed_whole_and_streamed(servers, parser):
    live = servers[parser]
    body = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=150, structured_outputs={"regex": FORMATS[parser]})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole_future = pool.submit(chat, live, **body)
        chunks = stream_chunks(live, "/chat/completions", body)
        whole = whole_future.result()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None, whole
    calls = _calls(whole["message"])
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    _check_schema_true(calls)
    streamed, finish, contents = _reassemble(chunks)
    assert streamed == calls and finish == "tool_calls" and contents <= {None, ""}


def test_parallel_tool_calls_false_yields_one_call(servers):
    body = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=150, parallel_tool_calls=False,
                structured_outputs={"regex": FORMATS["hermes"]})
    whole = chat(servers["hermes"], **body)["choices"][0]
    assert [c["name"] for c in _calls(whole["message"])] == ["get_weather"]
    streamed, finish, _ = _reassemble(stream_chunks(servers["hermes"], "/chat/completions", body))
    assert streamed == _calls(whole["message"]) and finish == "tool_calls"


def test_malformed_format_text_is_plain_content(servers):
    regex = _lit('<tool_call>\n{"name": "get_weather", "arguments": {"city": ') + "[a-z]{3,8}" + _lit("\n</tool_call>")
    body = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=80, structured_outputs={"regex": regex})
    whole = chat(servers["hermes"], **body)["choices"][0]
    assert whole["message"]["content"].startswith("<tool_call>") and whole["message"]["tool_calls"] == []
    assert whole["finish_reason"] == "stop"
    chunks = stream_chunks(servers["hermes"], "/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["message"]["content"]


@pytest.mark.parametrize("parser", PARSERS)
def test_forced_calls_are_schema_true_with_every_parser(servers, parser):
    live = servers[parser]
    named = dict(messages=ASK, tools=TOOLS, temperature=1.0, seed=3, max_tokens=100,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    required = dict(messages=ASK, tools=TOOLS, temperature=1.0, seed=5, max_tokens=150, tool_choice="required",
                    parallel_tool_calls=False)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda b: chat(live, **b)["choices"][0], [named, required]))
    for reply in replies:
        if reply["finish_reason"] == "length":  # sampled at temperature 1 and cut short: no call to check
            continue
        assert reply["finish_reason"] == "tool_calls"
        _check_schema_true(_calls(reply["message"]))
    assert len(_calls(replies[1]["message"])) <= 1


# An earlier turn that thinks in <think> tags: SmolLM2 never thinks on its own, but it copies the pattern
# and writes a reasoning span of its own before the answer (greedy: the same span every run). The request's
# constraint shapes only the answer after it, so a constraint that cannot start with "<" still lets the
# model reason first: reasoning in a reply below shows the constraint was not applied to the span.
THINKING_TURN = [{"role": "user", "content": "What is 2 + 2?"},
                 {"role": "assistant", "content": "<think>\nThe user asks about arithmetic.\n</think>\n\nFour."}]
SENTENCE = "[A-Z][a-z ,]{5,40}\\."


def test_reasoning_split_whole_and_streamed_with_usage(servers):
    live = servers["reasoning"]
    body = dict(messages=THINKING_TURN + ASK, temperature=0, max_tokens=120, structured_outputs={"regex": SENTENCE},
                stream_options={"include_usage": True})
    whole = chat(live, **{k: v for k, v in body.items() if k != "stream_options"})
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] and message["reasoning_content"].strip(), message
    assert "<think>" not in message["reasoning_content"] and "</think>" not in message["reasoning_content"]
    assert message["reasoning"] == message["reasoning_content"]
    assert re.fullmatch(SENTENCE, message["content"]), message  # the regex shaped the answer alone
    usage = whole["usage"]
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
    chunks = stream_chunks(live, "/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:])  # reasoning first, then the answer
    assert chunks[-1]["usage"] == usage


def test_reasoning_then_a_tool_call(servers):
    body = dict(messages=THINKING_TURN + ASK, tools=TOOLS, temperature=0, max_tokens=150,
                structured_outputs={"regex": FORMATS["hermes"]})
    choice = chat(servers["reasoning"], **body)["choices"][0]
    assert choice["message"]["reasoning_content"] and choice["message"]["content"] is None, choice
    assert [c["name"] for c in _calls(choice["message"])] == ["get_weather", "get_time"]
    chunks = stream_chunks(servers["reasoning"], "/chat/completions", body)
    assert "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]) == \
        choice["message"]["reasoning_content"]
    streamed, finish, _ = _reassemble(chunks)
    assert streamed == _calls(choice["message"]) and finish == "tool_calls"


@pytest.mark.parametrize("constraint, answer", [
    ({"grammar": 'start: "It is " WORD "."\nWORD: /[a-z]+/'}, r"It is [a-z]+\."),  # Lark
    ({"grammar": 'root ::= "It is " [a-z]+ "."'}, r"It is [a-z]+\."),  # GBNF
    ({"choice": ["sunny", "rainy"]}, "sunny|rainy"),
])
def test_grammars_and_choices_shape_the_answer_after_the_reasoning(servers, constraint, answer):
    body = dict(messages=THINKING_TURN + ASK, temperature=0, max_tokens=60, structured_outputs=constraint)
    message = chat(servers["reasoning"], **body)["choices"][0]["message"]
    assert message["reasoning_content"] and re.fullmatch(answer, message["content"]), message


@pytest.mark.parametrize("body, param, match", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}}}],
        tool_choice="none"), "tools", r"tools\[0\]\.function\.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]), "tools",
     "additionalProperties"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "book_flight"}}), "tool_choice",
     "book_flight"),
    (dict(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs", "tokenize"),
])
def test_bad_tool_input_is_a_400_naming_the_field(servers, body, param, match):
    r = httpx.post(servers["hermes"].v1 + "/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5,
                                                                     **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(match, error["message"]), error


def test_chat_template_kwargs_reach_the_template(servers):
    tokenizer = copy.deepcopy(servers["hermes"].engine.tokenizer)
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                               "{% endif %}{{ messages[0]['content'] }}")
    ctx = types.SimpleNamespace(tokenizer=tokenizer)
    messages = [ChatMessage(role="user", content="hi")]
    assert render_chat(ctx, messages)["prompt"] == "hi"
    assert render_chat(ctx, messages, template_kwargs={"enable_thinking": False})["prompt"].startswith("<think>")
    with pytest.raises(OpenAIError, match="add_generation_prompt"):
        render_chat(ctx, messages, template_kwargs={"add_generation_prompt": False})
    r = httpx.post(servers["hermes"].url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user",
                   "content": "hi"}], "chat_template_kwargs": {"tools": []}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def _events(live: LiveServer, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", live.v1 + "/responses", json={"model": MODEL, "stream": True, **body}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def test_responses_put_the_reasoning_in_its_own_output_item(servers):
    body = dict(input="Why is the sky blue?", max_output_tokens=12, temperature=0)
    r = httpx.post(servers["r1"].v1 + "/responses", json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, r.text
    response = r.json()
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    thought = reasoning["content"][0]["text"]
    assert reasoning["content"][0]["type"] == "reasoning_text" and thought.strip()
    assert message["type"] == "message" and message["content"][0]["text"] == ""  # cut short while reasoning
    usage = response["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == usage["output_tokens"] == 12
    events = _events(servers["r1"], body)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.reasoning_text.delta"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["type"]) for e in done] == [(0, "reasoning"), (1, "message")]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["usage"]["output_tokens_details"] == \
        usage["output_tokens_details"]
    assert [(item["type"], item["content"][0]["text"]) for item in final["output"]] == \
        [("reasoning", thought), ("message", "")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_reasoning_parser_leaves_answers_without_a_think_span_alone(servers):
    choice = chat(servers["reasoning"], messages=ASK, temperature=0, max_tokens=12)["choices"][0]
    assert choice["message"]["reasoning_content"] is None and choice["message"]["content"]


POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"],
         "additionalProperties": False}


@pytest.mark.parametrize("spec, answer, wrong", [
    (StructuredOutputsParams(json=POINT), '{"x": 1, "y": 2}', '{"x": "1"'),
    (StructuredOutputsParams(choice=["yes", "no"]), "no", "maybe"),
    # a / (bare and escaped) and a line break: what a Lark regex terminal must escape
    (StructuredOutputsParams(regex="[0-9]+/[0-9]+\n\\/"), "3/4\n/", "3-4"),
    # braces in its strings and a rule named like the reasoning span's: the nested grammar keeps its own names
    (StructuredOutputsParams(grammar='start: "{" thought "}"\nthought: /[a-z]+/'), "{abc}", "{ABC}"),
    (StructuredOutputsParams(grammar='root ::= "x" [0-9]+'), "x12", "y1"),  # GBNF, converted to Lark
])
def test_every_constraint_kind_follows_the_free_reasoning_span(servers, spec, answer, wrong):
    """The constraint shapes the answer; the <think> span before it is free (the engine's own matcher)."""
    live = servers["reasoning"]
    manager = live.engine.engine.structured_outputs
    applied = after_reasoning(spec, ReasoningParser("qwen3", False))
    tokenizer = live.engine.tokenizer

    def accepts(text: str) -> tuple[bool, bool]:
        matcher = manager.matcher(manager.compile(applied).result())
        ok = all(matcher.accept(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])
        return ok, ok and matcher.ll_matcher.is_accepting()

    assert accepts('<think>\nAny {text} at all, "x": "no" /\n</think>\n\n' + answer) == (True, True)
    assert accepts(answer) == (True, True)  # no reasoning span: the answer alone
    assert accepts("<think>free</think>" + wrong) == (False, False)  # the answer still obeys the constraint
    assert accepts("<think>a</think> b</think>" + answer) == (False, False)  # the span ends at </think>
    r1 = manager.matcher(manager.compile(after_reasoning(spec, ReasoningParser("deepseek_r1", True))).result())
    assert all(r1.accept(t) for t in tokenizer("Free.</think>" + answer, add_special_tokens=False)["input_ids"])
    assert r1.ll_matcher.is_accepting()  # deepseek_r1: the output starts inside the span


def test_structured_outputs_apply_after_the_reasoning(servers):
    live = servers["reasoning"]
    body = dict(messages=[{"role": "user", "content": "Give a point."}], temperature=0, max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}})
    message = chat(live, **body)["choices"][0]["message"]
    jsonschema.validate(json.loads(message["content"]), POINT)
    less_than = live.engine.tokenizer("<", add_special_tokens=False)["input_ids"]
    assert len(less_than) == 1
    forced = chat(live, **{**body, "max_tokens": 12, "logit_bias": {str(less_than[0]): 100}})["choices"][0]
    assert forced["finish_reason"] == "length" and forced["message"]["content"] is None  # cut inside the span
    assert forced["message"]["reasoning_content"]  # free text: not the schema's


def _refusal(live: LiveServer, constraint: dict) -> dict:
    r = httpx.post(live.v1 + "/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5,
                                                       "structured_outputs": constraint}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs", error
    return error


@pytest.mark.parametrize("constraint, match", [
    ({"regex": "(a"}, r"^invalid regex constraint"),  # compiled on its own first: its own kind and text
    ({"grammar": 'start: "a"\n}\nmore: %lark {\nstart: "b"'}, r"^invalid grammar constraint"),  # valid only nested
])
def test_a_bad_regex_or_grammar_is_a_400_about_itself(servers, constraint, match):
    error = _refusal(servers["reasoning"], constraint)
    assert re.search(match, error["message"]), error


def test_a_grammar_that_fits_the_size_limit_only_without_the_reasoning_span_is_a_400(servers):
    live = servers["reasoning"]
    head = 'start: "a"\n// '
    limit = live.engine.engine.structured_outputs.config.max_spec_bytes
    grammar = head + "x" * (limit - len(head))
    error = _refusal(live, {"grammar": grammar})
    assert re.search(r"the grammar cannot be applied after the reasoning: .*too large", error["message"]), error
    r = httpx.post(servers["hermes"].v1 + "/chat/completions", json={  # no reasoning parser: it fits
        "model": MODEL, "messages": ASK, "max_tokens": 5, "structured_outputs": {"grammar": grammar}}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "a", r.text

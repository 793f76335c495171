"""Structured outputs and tool calling through the real server on the real SmolLM2 (CPU).

The default run keeps a fast subset; the full 22-schema sweep (greedy and sampled) is `-m slow`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import threading
import time

import httpx
import jsonschema
import pydantic
import pytest

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from server.app import build_app
from server.config import ServerConfig
from tests.server.conftest import LiveServer, serve
from tests.server.json_schemas import SCHEMAS
from tests.test_engine import count_traces

MODEL = "smollm2"
FAST = ("person", "order", "contact_anyof", "tree_ref")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def smol(smollm2) -> LiveServer:
    engine = LLMEngine(EngineArgs(model="unused", max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=128,
                                  num_pages=600, compilation_cache_dir=None), loaded=smollm2)
    llm = AsyncLLM(engine)
    config = ServerConfig(served_model_names=(MODEL,), enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    try:
        with serve(build_app(llm, config)) as url:
            yield LiveServer(url, llm, MODEL)
    finally:
        llm.shutdown()


def post(live: LiveServer, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(live.v1 + path, json={"model": MODEL, **body}, timeout=timeout)


def chat(live: LiveServer, **body) -> dict:
    r = post(live, "/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(live: LiveServer, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", live.v1 + path, json={"model": MODEL, "stream": True, **body}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert not any("error" in c for c in chunks), chunks
    return chunks


def schema_request(name: str, prompt: str, schema: dict, sampled: bool, seed: int) -> dict:
    sampling = dict(temperature=1.0, top_p=0.95, seed=seed) if sampled else dict(temperature=0)
    return dict(messages=[{"role": "user", "content": f"{prompt} Answer in JSON."}], max_tokens=400,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                        "strict": True}}, **sampling)


def check_schemas(live: LiveServer, names) -> None:
    cases = [(n, p, s, sampled, i) for i, (n, p, s) in enumerate(SCHEMAS) if n in names for sampled in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda c: chat(live, **schema_request(*c)), cases))
    for (name, _, schema, sampled, _), reply in zip(cases, replies):
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", (name, sampled, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_schemas_greedy_and_sampled(smol):
    check_schemas(smol, FAST)


@pytest.mark.slow
def test_json_schema_sweep_greedy_and_sampled(smol):
    assert len(SCHEMAS) >= 20
    check_schemas(smol, [n for n, _, _ in SCHEMAS])


def test_regex_choice_grammar_and_every_request_spelling(smol):
    prompt = "The date of the moon landing is"
    out = post(smol, "/completions", dict(prompt=prompt, max_tokens=30, temperature=0,
                                           structured_outputs={"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})).json()
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", out["choices"][0]["text"])
    assert out["choices"][0]["finish_reason"] == "stop"
    out = post(smol, "/completions", dict(prompt=prompt, max_tokens=30, temperature=0.9, seed=1, n=2,
                                           guided_regex=r"(July|June) [0-9]{1,2}, 19[0-9]{2}")).json()
    assert all(re.fullmatch(r"(July|June) [0-9]{1,2}, 19[0-9]{2}", c["text"]) for c in out["choices"])
    choices = ["positive", "negative", "neutral"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        reply = chat(smol, messages=[{"role": "user", "content": "Sentiment of 'great film!'?"}], max_tokens=10,
                     temperature=0, **body)
        assert reply["choices"][0]["message"]["content"] in choices
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/'
    gbnf = 'root ::= "The answer is " [1-9] [0-9]? "."'
    for body in ({"structured_outputs": {"grammar": lark}}, {"guided_grammar": gbnf}):
        reply = chat(smol, messages=[{"role": "user", "content": "What is 6 times 7?"}], max_tokens=20,
                     temperature=0.7, seed=3, **body)
        assert re.fullmatch(r"The answer is [1-9][0-9]?\.", reply["choices"][0]["message"]["content"])
    out = post(smol, "/completions", dict(prompt="A JSON object describing a cat:", max_tokens=120, temperature=0,
                                           response_format={"type": "json_object"})).json()
    assert isinstance(json.loads(out["choices"][0]["text"]), dict)
    schema = SCHEMAS[0][2]
    out = post(smol, "/completions", dict(prompt="A person:", max_tokens=100, temperature=0,
                                           guided_json=schema)).json()
    jsonschema.validate(json.loads(out["choices"][0]["text"]), schema)


def test_streamed_constrained_output_equals_non_streamed(smol):
    name, prompt, schema = next(s for s in SCHEMAS if s[0] == "order")
    body = {**schema_request(name, prompt, schema, True, 7), "n": 2, "logprobs": True, "top_logprobs": 2,
            "stop": ["\n\n"]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one batch: half the wall time
        whole_future = pool.submit(chat, smol, **body)
        chunks = stream_chunks(smol, "/chat/completions", body)
        whole = whole_future.result()
    for choice in whole["choices"]:
        parts = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        text = "".join(p["delta"].get("content") or "" for p in parts)
        assert text == choice["message"]["content"]
        jsonschema.validate(json.loads(text), schema)
        streamed_lp = [t for p in parts if p["logprobs"] for t in p["logprobs"]["content"]]
        assert [t["token"] for t in streamed_lp] == [t["token"] for t in choice["logprobs"]["content"]]
        assert parts[-1]["finish_reason"] == "stop"
    assert whole["choices"][0]["message"]["content"] != whole["choices"][1]["message"]["content"]


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=120)
    address: Address


def test_openai_sdk_parse_returns_a_pydantic_object(smol):
    client = smol.openai()
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person who lives in Rome."}],
        response_format=Person, temperature=0, max_tokens=200)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)


def test_tool_call_round_trip_named_and_required(smol):
    client = smol.openai()
    tools = [WEATHER_TOOL, TIME_TOOL]
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, temperature=0, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                              parallel_tool_calls=False, temperature=0.8, seed=2, max_tokens=150)
    (rcall,) = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls"
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[rcall.function.name]
    jsonschema.validate(json.loads(rcall.function.arguments), spec)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert not answer.choices[0].message.tool_calls


def _reassemble(chunks: list[dict]) -> tuple[list[dict], str | None, set]:
    calls: dict[int, dict] = {}
    finish, contents = None, set()
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            contents.add(delta.get("content"))
            for tc in delta.get("tool_calls") or []:
                if "id" in tc:  # a call's first delta: id, type, name, empty arguments
                    assert tc["type"] == "function" and tc["function"]["arguments"] == "" and tc["index"] not in calls
                    calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                    calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return [calls[i] for i in sorted(calls)], finish, contents


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_streamed_tool_call_deltas_equal_the_non_streamed_call(smol, tool_choice):
    body = dict(messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice, temperature=0,
                max_tokens=150)
    whole = chat(smol, **body)["choices"][0]
    expected = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in whole["message"]["tool_calls"]]
    calls, finish, contents = _reassemble(stream_chunks(smol, "/chat/completions", body))
    assert calls == expected and finish == whole["finish_reason"] == "tool_calls"
    assert contents == {None}  # no text content in a forced call
    assert len(expected) >= 1 and whole["message"]["content"] is None


def test_auto_tool_choice_returns_content_or_parsed_calls(smol):
    reply = chat(smol, messages=[{"role": "user", "content": "Say hello to Bob."}], tools=[WEATHER_TOOL],
                 temperature=0, max_tokens=20)
    message = reply["choices"][0]["message"]
    if message["tool_calls"]:
        assert reply["choices"][0]["finish_reason"] == "tool_calls"
    else:
        assert message["content"] and reply["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("body, param, match", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
     "response_format", "Invalid type"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["n"]}}}), "response_format", "Unsatisfiable"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"field_{i}": {"type": "string", "description": "d" * 100}
                                         for i in range(8000)}}}}), "response_format", "too large"),
    (dict(structured_outputs={"grammar": 'start: "a" (\n'}), "structured_outputs", "Expected"),
    (dict(guided_regex="(unclosed"), "guided_regex", "regex"),
    (dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "book_flight"}}),
     "tool_choice", "book_flight"),
    (dict(guided_choice=["a"], guided_regex="a"), "guided_choice", "one output constraint"),
    (dict(response_format={"type": "xml"}), "response_format", "not supported"),
])
def test_bad_constraints_are_fast_400s_and_the_server_keeps_serving(smol, body, param, match):
    background: dict = {}
    worker = threading.Thread(target=lambda: background.update(chat(smol, messages=ASK, max_tokens=24, temperature=0,
                                                                    ignore_eos=True)))
    worker.start()
    start = time.perf_counter()
    r = post(smol, "/chat/completions", dict(messages=ASK, max_tokens=10, **body))
    elapsed = time.perf_counter() - start
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "BadRequestError"
    assert error["param"] == param and re.search(match, error["message"]), error
    # the bound is 1 s (every case met it here); 2 s leaves room for a machine shared by other builds
    # (the 1 MB schema took 1.3 s at load average 14 on 2 cores: parsing the body, not compiling)
    assert elapsed < 2.0, elapsed
    worker.join(120)
    assert background["choices"][0]["finish_reason"] == "length"
    assert smol.wait_idle()["num_requests_running"] == 0


def test_a_constraint_slower_to_compile_than_the_limit_is_a_400_and_the_server_keeps_serving(smol):
    manager = smol.engine.engine.structured_outputs
    config = manager.config
    slow = {"type": "object", "properties": {
        f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 7 + 40}}}"} for i in range(400)}}
    manager.config = dataclasses.replace(config, compile_timeout_s=1e-4)
    try:
        r = post(smol, "/chat/completions", dict(messages=ASK, max_tokens=10, response_format={
            "type": "json_schema", "json_schema": {"name": "slow", "schema": slow}}))
    finally:
        manager.config = config
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "took longer than" in error["message"], error
    assert chat(smol, messages=ASK, max_tokens=4, temperature=0, ignore_eos=True)["choices"][0]["finish_reason"] == "length"
    assert smol.wait_idle()["num_requests_running"] == 0


def test_no_compilation_after_warmup_with_constrained_requests(smol):
    check_schemas(smol, FAST[:1])  # compiles its grammar
    bodies = [schema_request(*SCHEMAS[0][:3], True, 1), dict(messages=ASK, max_tokens=12, temperature=0.7),
              dict(messages=ASK, max_tokens=30, guided_choice=["yes", "no"], logprobs=True, top_logprobs=3),
              dict(messages=ASK, max_tokens=30, repetition_penalty=1.2, structured_outputs={"regex": "[a-z ]{5,20}"}),
              dict(messages=ASK, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=80, n=2, seed=4)]
    with count_traces() as traces:
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: chat(smol, **b), bodies))
    assert traces == []
    assert all(r["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls") for r in replies)


def test_readme_structured_output_examples_run(smol):
    """The README's two examples, as printed, against this server."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Structured outputs and tool calling", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:2]
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        code = block.replace("http://localhost:8000/v1", smol.v1).replace('"smollm2-135m-instruct"', f'"{MODEL}"')
        exec(compile(code, "README.md", "exec"), namespace)
    assert type(namespace["completion"].choices[0].message.parsed).__name__ == "City"
    assert namespace["choice"].choices[0].message.content in ("yes", "no")
    assert namespace["call"].function.name == "get_weather" and namespace["final"].choices[0].message.content

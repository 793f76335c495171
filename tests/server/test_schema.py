"""/openapi.json states the limits the server enforces: each bound the schema publishes for a request field
is the bound validation applies (a value just outside is a 400 in OpenAI's shape naming the field; the bound
itself passes the body model), because both come from the request models' declarations."""

from __future__ import annotations

import httpx
import pytest

from server.protocol import MAX_LOGIT_BIAS_ENTRIES, ChatCompletionRequest, CompletionRequest
from tests.server.conftest import MODEL_NAME

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
ENDPOINTS = [("/v1/chat/completions", "ChatCompletionRequest", CHAT, ChatCompletionRequest),
             ("/v1/completions", "CompletionRequest", CMPL, CompletionRequest)]


@pytest.fixture(scope="module")
def openapi(live) -> dict:
    return httpx.get(live.url + "/openapi.json", timeout=10).json()


def properties(openapi: dict, model: str) -> dict[str, dict]:
    return openapi["components"]["schemas"][model]["properties"]


def alternatives(prop: dict) -> list[dict]:
    """The property's schema and its anyOf members (an optional field is anyOf [..., null])."""
    return [prop, *prop.get("anyOf", [])]


def numeric_bounds(prop: dict) -> list[tuple[str, float, bool]]:
    """(keyword, bound, integer) of each numeric bound the property publishes."""
    found = []
    for alt in alternatives(prop):
        for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if keyword in alt:
                found.append((keyword, alt[keyword], alt.get("type") == "integer"))
    return found


def outside(keyword: str, bound: float, integer: bool) -> float:
    step = 1 if integer else 0.5
    return {"minimum": bound - step, "exclusiveMinimum": bound, "maximum": bound + step,
            "exclusiveMaximum": bound}[keyword]


def bounded_fields(openapi: dict, model: str) -> dict[str, list]:
    return {name: bounds for name, prop in properties(openapi, model).items() if (bounds := numeric_bounds(prop))}


def test_the_schema_publishes_the_limits(openapi):
    chat, cmpl = properties(openapi, "ChatCompletionRequest"), properties(openapi, "CompletionRequest")
    for props in (chat, cmpl):
        bounds = {name: {k: v for k, v, _ in numeric_bounds(p)} for name, p in props.items()}
        assert bounds["temperature"] == {"minimum": 0}
        assert bounds["top_p"] == {"exclusiveMinimum": 0, "maximum": 1}
        assert bounds["n"] == {"minimum": 1, "maximum": 128}
        assert bounds["presence_penalty"] == bounds["frequency_penalty"] == {"minimum": -2, "maximum": 2}
        assert bounds["top_k"] == {"minimum": -1} and bounds["min_p"] == {"minimum": 0, "maximum": 1}
        assert bounds["repetition_penalty"] == {"exclusiveMinimum": 0, "maximum": 10}
        bias = next(a for a in alternatives(props["logit_bias"]) if a.get("type") == "object")
        assert bias["maxProperties"] == MAX_LOGIT_BIAS_ENTRIES and list(bias["patternProperties"]) == ["^[0-9]+$"]
    assert chat["messages"]["minItems"] == 1
    message = openapi["components"]["schemas"]["ChatMessage"]["properties"]
    assert message["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]
    assert {k: v for k, v, _ in numeric_bounds(chat["top_logprobs"])} == {"minimum": 0, "maximum": 20}
    prompt_forms = alternatives(cmpl["prompt"])[1:]
    assert {f.get("minLength") or f.get("minItems") for f in prompt_forms} == {1}
    tokens = properties(openapi, "DetokenizeRequest")["tokens"]
    assert tokens["items"]["minimum"] == 0
    response_format = openapi["components"]["schemas"]["ResponseFormat"]["properties"]["type"]
    assert response_format["enum"] == ["text", "json_object", "json_schema"]


@pytest.mark.parametrize("path, model, base, request_model", ENDPOINTS, ids=["chat", "completions"])
def test_each_published_bound_is_the_one_enforced(live, openapi, path, model, base, request_model):
    fields = bounded_fields(openapi, model)
    assert len(fields) >= 12, sorted(fields)
    with httpx.Client(base_url=live.url, timeout=30) as client:
        for name, bounds in fields.items():
            for keyword, bound, integer in bounds:
                value = outside(keyword, bound, integer)
                response = client.post(path, json={**base, name: value})
                assert response.status_code == 400, (name, value, response.text)
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["param"] == name, error
                if not keyword.startswith("exclusive"):  # the bound itself is inside
                    request_model.model_validate({**base, name: int(bound) if integer else bound})


def test_a_role_or_format_outside_the_enum_is_a_400_naming_the_field(live):
    with httpx.Client(base_url=live.url, timeout=30) as client:
        role = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "wizard", "content": "x"}]})
        fmt = client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "xml"}})
        empty = client.post("/v1/chat/completions", json={**CHAT, "messages": []})
    assert (role.status_code, role.json()["error"]["param"]) == (400, "messages")
    assert "'wizard' is not supported" in role.json()["error"]["message"]
    assert (fmt.status_code, fmt.json()["error"]["param"]) == (400, "response_format")
    assert "'xml' is not supported" in fmt.json()["error"]["message"]
    assert (empty.status_code, empty.json()["error"]["param"]) == (400, "messages")


def test_a_union_field_error_names_what_is_wrong_once(live):
    """A value failing every member of a union (str | list[str]) gets the error of the member it matched in
    shape, not one "not a string" per other member."""
    with httpx.Client(base_url=live.url, timeout=30) as client:
        stop = client.post("/v1/completions", json={**CMPL, "stop": ["a", ""]}).json()["error"]
        prompt = client.post("/v1/completions", json={**CMPL, "prompt": [[1], [-1]]}).json()["error"]
    assert (stop["param"], stop["message"]) == ("stop", "stop.1: String should have at least 1 character")
    assert (prompt["param"], prompt["message"]) == ("prompt", "prompt.1.0: Input should be greater than or equal to 0")

"""Fuzzing: schemathesis over the server's own OpenAPI schema (every operation), and hypothesis over the
request models and SamplingParams. No 5xx, no hang, every error in OpenAI's shape."""

from __future__ import annotations

import math

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from pydantic import ValidationError

from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tests.reliability.sse import assert_error_shape

CALL_TIMEOUT = 30.0  # seconds per fuzzed request: a hang fails the case
FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def api_schema(rel):
    return schemathesis.openapi.from_url(rel.url + "/openapi.json")


def check_response(response) -> None:
    """No 5xx, never a 422 (bad input is a 400); every non-2xx in OpenAI's error shape; a 2xx stream ends
    with [DONE]."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    assert response.status_code != 422, response.text[:500]
    if response.status_code >= 400:
        assert_error_shape(response.json())
    elif "text/event-stream" in str(response.headers.get("content-type", "")):
        check_stream_end(response.text)


# schemathesis reads an event stream only up to this many events (its DEFAULT_MAX_STREAM_EVENTS), then stops
CLIENT_MAX_STREAM_EVENTS = 20
RESPONSES_TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


def check_stream_end(text: str) -> None:
    """A whole stream ends with its terminal event: `data: [DONE]` (chat, completions) or a terminal
    `response.*` / `error` event (Responses, which sends no [DONE]). A stream the client cut at its event
    limit only has to be well framed so far."""
    events = [e for e in text.strip().split("\n\n") if e]
    if len(events) >= CLIENT_MAX_STREAM_EVENTS:
        # SSE's line ends are \n, \r and \r\n only: str.splitlines() would also split the JSON text of a
        # token that decodes to U+0085, U+2028 or U+2029, which json.dumps(ensure_ascii=False) leaves as is
        assert all(line.startswith(("data: ", "event: ")) for e in events for line in e.split("\n")), text[-300:]
    elif events and events[0].startswith("event: "):
        assert events[-1].split("\n")[0].removeprefix("event: ") in RESPONSES_TERMINAL, text[-300:]
    else:
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]


def fuzz_every_operation(api_schema, max_examples: int) -> list[str]:
    """Positive and negative cases for every operation of the schema (hypothesis-driven, bounded)."""
    from schemathesis import GenerationMode

    labels = []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=max_examples, **FUZZ_SETTINGS)
            def run(case):
                check_response(case.call(timeout=CALL_TIMEOUT))

            try:
                run()
            except Unsatisfiable:  # negative cases of an operation without parameters or body do not exist
                assert mode == GenerationMode.NEGATIVE, operation.label
    return labels


def test_schemathesis_every_operation(api_schema, rel):
    labels = fuzz_every_operation(api_schema, max_examples=25)
    assert len(labels) >= 8, labels
    rel.wait_pages_free(timeout=30)


@pytest.mark.slow
def test_schemathesis_every_operation_long(api_schema, rel):
    fuzz_every_operation(api_schema, max_examples=200)
    rel.wait_pages_free(timeout=60)


def test_schema_covers_every_route(api_schema):
    paths = {op.ok().path for op in api_schema.get_all_operations()}
    assert paths >= {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                     "/health", "/version", "/metrics"}


# ---- hypothesis over the request models and SamplingParams -------------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | finite | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=6)


@given(st.dictionaries(st.sampled_from(["prompt", "max_tokens", "n", "temperature", "stop", "logprobs", "echo",
                                        "logit_bias", "seed", "stream", "stop_token_ids", "model", "top_k"]),
                       json_values, max_size=6))
@settings(max_examples=300, **FUZZ_SETTINGS)
def test_completion_request_accepts_or_names_the_field(body):
    try:
        request = CompletionRequest.model_validate(body)
    except ValidationError as err:
        assert all(e["loc"] and e["loc"][0] in body or e["type"] == "missing" for e in err.errors()), err
        return
    assert request.n >= 1 and (request.logprobs is None or request.logprobs >= 0)


@given(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"])},
                                      optional={"content": st.text(max_size=20) | st.none()}), max_size=4),
       st.integers(-5, 50) | st.none())
@settings(max_examples=200, **FUZZ_SETTINGS)
def test_chat_request_round_trips(messages, top_logprobs):
    """Valid bodies round-trip; no messages, an unknown role or top_logprobs outside [0, MAX_LOGPROBS] is
    refused naming the field (the limits the published schema declares)."""
    body = {"messages": messages, "top_logprobs": top_logprobs}
    invalid = {"messages"} if not messages or any(m["role"] == "x" for m in messages) else set()
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        invalid.add("top_logprobs")
    if invalid:
        with pytest.raises(ValidationError) as err:
            ChatCompletionRequest.model_validate(body)
        assert {e["loc"][0] for e in err.value.errors()} == invalid, err.value
        return
    request = ChatCompletionRequest.model_validate(body)
    assert [m.role for m in request.messages] == [m["role"] for m in messages]


@given(st.lists(st.integers(), max_size=5) | json_values)
@settings(max_examples=150, **FUZZ_SETTINGS)
def test_detokenize_and_tokenize_requests(tokens):
    try:
        DetokenizeRequest.model_validate({"tokens": tokens})
    except ValidationError as err:
        assert err.errors()[0]["loc"][0] == "tokens"
    TokenizeRequest.model_validate({"prompt": "x", "junk": tokens})  # unknown fields are ignored


VALID = dict(
    n=st.integers(1, 8), temperature=st.floats(0, 5), top_p=st.floats(0.01, 1), top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1), presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.01, 10), max_tokens=st.integers(1, 1000) | st.none(),
    logprobs=st.integers(0, MAX_LOGPROBS) | st.none(), seed=st.integers(-2**63, 2**64) | st.none())
INVALID = dict(
    n=st.integers(max_value=0), temperature=st.floats(max_value=-1e-6) | st.just(math.inf) | st.just(math.nan),
    top_p=st.floats(max_value=0) | st.floats(min_value=1.0001), top_k=st.integers(max_value=-2),
    min_p=st.floats(max_value=-1e-6) | st.floats(min_value=1.0001), presence_penalty=st.floats(min_value=2.0001),
    frequency_penalty=st.floats(max_value=-2.0001), repetition_penalty=st.floats(max_value=0) | st.just(math.nan),
    max_tokens=st.integers(max_value=0), min_tokens=st.integers(max_value=-1),
    logprobs=st.integers(min_value=MAX_LOGPROBS + 1), stop=st.just(("",)), stop_token_ids=st.just((-1,)))


@given(st.fixed_dictionaries({}, optional=VALID))
@settings(max_examples=300, **FUZZ_SETTINGS)
def test_sampling_params_accepts_valid_values(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


@given(st.sampled_from(sorted(INVALID)).flatmap(lambda f: st.tuples(st.just(f), INVALID[f])))
@settings(max_examples=300, **FUZZ_SETTINGS)
def test_sampling_params_rejects_invalid_values_naming_the_field(field_value):
    field, value = field_value
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**{field: value})


@given(st.sampled_from(sorted(INVALID)).flatmap(lambda f: st.tuples(st.just(f), INVALID[f])))
@settings(max_examples=40, **FUZZ_SETTINGS)
def test_invalid_sampling_values_are_400s_naming_the_field(rel, field_value):
    field, value = field_value
    if isinstance(value, float) and not math.isfinite(value):
        return  # not JSON
    wire = {"logprobs": "logprobs", "stop": "stop", "stop_token_ids": "stop_token_ids"}.get(field, field)
    body = {"prompt": "hi", "max_tokens": 4, wire: list(value) if isinstance(value, tuple) else value}
    response = httpx.post(rel.url + "/v1/completions", json=body, timeout=CALL_TIMEOUT)
    assert response.status_code == 400, (body, response.text)
    assert assert_error_shape(response.json())["param"] == field, (body, response.json())

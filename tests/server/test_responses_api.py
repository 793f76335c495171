"""/v1/responses through the openai SDK (client.responses.create), streamed and not; stateless."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME

INPUT = [{"role": "user", "content": "Say something"}]


def test_responses_create_matches_chat_and_reports_usage(live):
    client = live.openai()
    r = client.responses.create(model=MODEL_NAME, input=INPUT, instructions="Be brief.", max_output_tokens=6,
                                temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=6, temperature=0,
                                          messages=[{"role": "system", "content": "Be brief."}, *INPUT])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    live.wait_idle()


def test_responses_stream_event_sequence(live):
    client = live.openai()
    kw = dict(model=MODEL_NAME, input="hello there", max_output_tokens=8, temperature=0.7, top_p=0.9,
              extra_body={"seed": 5})
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{full.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == full.output_text == events[-4].text
    assert events[-1].response.output_text == full.output_text
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens
    live.wait_idle()


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
])
def test_unsupported_or_bad_fields_are_400(live, body, param):
    r = httpx.post(live.v1 + "/responses", json={"model": MODEL_NAME, "input": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_previous_response_id_via_sdk_is_a_bad_request(live):
    with pytest.raises(openai.BadRequestError, match="stateless"):
        live.openai().responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_1")

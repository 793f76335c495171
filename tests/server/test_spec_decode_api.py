"""The OpenAI API tests of test_openai_api.py, run again against a server whose engine speculates (n-gram).

Speculation changes only the time: the imported tests (seeded streams, n = 2, logprobs, stop strings, greedy
parity with a plain engine) must pass as they do without it, while steps emit several tokens at once. The
tests below check, against a plain server over the same checkpoint, that streams give its text, usage and
stop strings while drafts are accepted over HTTP.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.sse import stream
from tests.server.conftest import MODEL_NAME, live_server
from tests.server.test_openai_api import (  # collected here too, over this module's fixtures
    test_chat_completion, test_chat_logprobs, test_completion_logprobs, test_greedy_over_http_equals_the_engine,
    test_n_two, test_seeded_request_repeats, test_stop_string, test_stop_strings_held_back_matched_and_included,
    test_streaming_chat_equals_non_streamed_for_a_seed, test_streaming_completion_equals_non_streamed)

__all__ = ["test_chat_completion", "test_chat_logprobs", "test_completion_logprobs",
           "test_greedy_over_http_equals_the_engine", "test_n_two", "test_seeded_request_repeats", "test_stop_string",
           "test_stop_strings_held_back_matched_and_included", "test_streaming_chat_equals_non_streamed_for_a_seed",
           "test_streaming_completion_equals_non_streamed"]
# (__all__: the imported tests are used; pytest collects them from this module)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPEATING = "one two three four five, one two three four five, one two three four five, one two"
# The tiny tokenizer is bytes without merges: printable ASCII only, so every token is one streamed character.
ASCII_ONLY = {str(i): -100 for i in [*range(32), *range(127, 260)]}
GREEDY = dict(prompt=REPEATING, max_tokens=40, temperature=0, logit_bias=ASCII_ONLY, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def live(tiny_checkpoints):
    with live_server(str(tiny_checkpoints["gqa4"]), speculative_config=SPEC) as server:
        yield server


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    with live_server(str(tiny_checkpoints["gqa4"])) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return live.openai()


def _stream(client, **kw) -> tuple[list[str], str, int]:
    """A streamed completion's text pieces, its finish reason and its usage's completion tokens."""
    chunks = list(client.completions.create(model=MODEL_NAME, stream=True, stream_options={"include_usage": True},
                                            **kw))
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return pieces, finish[-1], chunks[-1].usage.completion_tokens


def test_streams_equal_a_plain_servers_with_drafts_accepted(live, plain, client):
    """Greedy streams over a prompt the model copies from: the same text, finish reason and usage as a plain
    server's, in fewer pieces (a piece per step), while the engine accepted drafts; no page leaks."""
    before = live.engine.stats()
    pieces, finish, used = _stream(client, **GREEDY)
    plain_pieces, plain_finish, plain_used = _stream(plain.openai(), **GREEDY)
    assert ("".join(pieces), finish, used) == ("".join(plain_pieces), plain_finish, plain_used)
    assert used == 40 and len(plain_pieces) == 40
    after = live.wait_idle()
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted > 0 and len(pieces) <= 40 - accepted
    assert after["kv_cache_usage"] == 0.0


def test_stop_strings_in_steps_with_accepted_drafts(live, plain, client):
    """A stop string in text whose steps accept drafts ends the text where a plain server ends it (tokens
    accepted after it are dropped), streamed or not, with the plain server's usage."""
    kw = GREEDY
    full = "".join(_stream(plain.openai(), **kw)[0])
    stop = full[len(full) // 2:len(full) // 2 + 3]
    for c in (client, plain.openai()):
        r = c.completions.create(model=MODEL_NAME, stop=[stop], **kw)
        assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    before = live.engine.stats()["spec_decode_num_accepted_tokens"]
    pieces, finish, used = _stream(client, stop=[stop], **kw)
    plain_used = _stream(plain.openai(), stop=[stop], **kw)[2]
    assert ("".join(pieces), finish, used) == (full[:full.index(stop)], "stop", plain_used)
    after = live.wait_idle()
    assert after["spec_decode_num_accepted_tokens"] > before and after["kv_cache_usage"] == 0.0


def test_clients_that_leave_overlapped_verifications_free_every_page(tiny_checkpoints, plain):
    """The GPU's engine behind the API (verification steps overlapped, every step kept in flight) in a pool too
    small for the batch: 12 greedy streams at once over prompts the model copies from, every other one dropped
    after a few pieces (its request aborted between steps, with steps of its in flight), the rest read to the
    end. Those give a plain server's text and usage; drafts were accepted, requests were preempted, and every
    page comes back."""
    prompts = [f"{i} {REPEATING[i:]}" for i in range(12)]
    bodies = [dict(model=MODEL_NAME, prompt=p, max_tokens=40, temperature=0, logit_bias=ASCII_ONLY, ignore_eos=True,
                   stream_options={"include_usage": True}) for p in prompts]
    expected = [plain.openai().completions.create(model=MODEL_NAME, **{**GREEDY, "prompt": p}) for p in prompts]
    with live_server(str(tiny_checkpoints["gqa4"]), speculative_config=SPEC, overlap_verification=True,
                     async_scheduling_max_tokens=1024, num_pages=40) as server:
        async def clients():
            async with httpx.AsyncClient(base_url=server.v1, timeout=60) as client:
                return await asyncio.gather(*(stream(client, "/completions", body, max_events=3 if i % 2 else None)
                                              for i, body in enumerate(bodies)))

        results = asyncio.run(clients())
        stats = server.wait_idle(timeout=20)
        for i in range(0, len(prompts), 2):
            assert results[i].done and not results[i].errors
            assert results[i].text(chat=False) == expected[i].choices[0].text
            assert results[i].usage["completion_tokens"] == expected[i].usage.completion_tokens == 40
        assert all(not results[i].done for i in range(1, len(prompts), 2))
        assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0
        assert stats["kv_cache_usage"] == 0.0

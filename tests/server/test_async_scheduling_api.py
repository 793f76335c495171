"""The OpenAI API tests of test_openai_api.py, run again against a server whose engine has async scheduling on.

The imported tests take this module's `live` and `client` fixtures; test_greedy_over_http_equals_the_engine
compares the overlapped server with a synchronous engine.
"""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL_NAME, live_server
from tests.server.test_openai_api import (  # collected here too, over this module's fixtures
    test_chat_completion, test_completion_logprobs, test_greedy_over_http_equals_the_engine, test_n_two,
    test_seeded_request_repeats, test_stop_string, test_stop_strings_held_back_matched_and_included,
    test_streaming_chat_equals_non_streamed_for_a_seed, test_streaming_completion_equals_non_streamed)

__all__ = ["test_chat_completion", "test_completion_logprobs", "test_greedy_over_http_equals_the_engine", "test_n_two",
           "test_seeded_request_repeats", "test_stop_string", "test_stop_strings_held_back_matched_and_included",
           "test_streaming_chat_equals_non_streamed_for_a_seed", "test_streaming_completion_equals_non_streamed"]
# (__all__: the imported tests are used; pytest collects them from this module)


@pytest.fixture(scope="module")
def live(tiny_checkpoints):
    with live_server(str(tiny_checkpoints["gqa4"]), async_scheduling=True) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return live.openai()


def test_the_engine_runs_the_overlapped_loop(live, client):
    assert live.engine.engine.async_scheduling
    r = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    stats = live.wait_idle()
    assert stats["kv_cache_usage"] == 0.0

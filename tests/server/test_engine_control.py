"""POST /update_weights_from_disk, /sleep, /wake_up and GET /is_sleeping (server/engine_control.py) on a live
server with an API key: the weights swap between requests, sleep refuses generation with an OpenAI-shaped 503."""

from __future__ import annotations

import httpx
import pytest

from jaxpaged.config import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.engine.llm_engine import LLMEngine
from server.app import build_app
from server.config import ServerConfig
from tests.conftest import make_tiny_checkpoint
from tests.server.conftest import API_KEY, ENGINE_ARGS, MODEL_NAME, serve

AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETION = dict(model=MODEL_NAME, prompt=[5, 9, 200, 31, 7, 64], max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tmp_path_factory):
    """(url, engine, checkpoint A, checkpoint B of the same shapes, another model's checkpoint)."""
    a = tiny_checkpoints["gqa4"]
    b = make_tiny_checkpoint(tmp_path_factory.mktemp("b") / "gqa4-b", "gqa4", seed=11)
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(a), **ENGINE_ARGS)))
    try:
        with serve(build_app(llm, ServerConfig(served_model_names=(MODEL_NAME,), api_key=API_KEY))) as url:
            yield url, llm, a, b, tiny_checkpoints["mha"]
    finally:
        llm.shutdown()


def complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=60)


def tokens(url: str) -> str:
    response = complete(url)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.parametrize("method, path", [("POST", "/update_weights_from_disk"), ("POST", "/sleep"),
                                          ("POST", "/wake_up"), ("GET", "/is_sleeping")])
def test_routes_need_the_api_key(server, method, path):
    url = server[0]
    response = httpx.request(method, url + path, json={"model_path": str(server[3])})
    assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(url + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}


def test_update_weights_from_disk_swaps_between_requests(server):
    url, _, a, b, other = server
    before = tokens(url)
    response = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(b)}, headers=AUTH, timeout=60)
    assert response.status_code == 200 and response.json()["success"] is True, response.text
    changed = tokens(url)
    assert changed != before
    for body, param in [({"model_path": str(other)}, "model_path"), ({"model_path": "/no/such/folder"}, "model_path"),
                        ({}, "model_path"), ({"model_path": str(a), "flush": True}, "flush")]:
        response = httpx.post(url + "/update_weights_from_disk", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param and response.json()["error"]["type"] == "BadRequestError"
    assert tokens(url) == changed  # the refused updates changed nothing
    assert httpx.post(url + "/update_weights_from_disk", json={"model_path": str(a)}, headers=AUTH,
                      timeout=60).status_code == 200
    assert tokens(url) == before


def test_sleep_refuses_requests_with_503_until_wake_up(server):
    url, llm, *_ = server
    before = tokens(url)
    assert httpx.post(url + "/sleep?level=3", headers=AUTH).status_code == 400
    for level in ("1", "2"):
        assert httpx.post(url + f"/sleep?level={level}", headers=AUTH, timeout=60).status_code == 200
        assert httpx.get(url + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
        response = complete(url)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and error["code"] == "engine_asleep"
        assert "wake_up" in error["message"]
        streamed = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": True}, headers=AUTH, timeout=60)
        assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "engine_asleep"
        assert llm.stats()["num_requests_waiting"] == 0
        again = httpx.post(url + "/sleep", headers=AUTH)
        assert again.status_code == 409 and "already asleep" in again.json()["error"]["message"]
        assert httpx.post(url + "/wake_up", headers=AUTH, timeout=60).status_code == 200
        assert httpx.get(url + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
        assert tokens(url) == before

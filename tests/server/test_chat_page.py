"""The chat page at / in a real headless browser (Debian's chromium, driven by selenium + chromedriver):
asks for the API key, streams a reply, stops one (the request is aborted in the engine), shows tokens/s;
a screenshot is saved as a test artifact (test-artifacts/chat_page.png). And --disable-chat-page."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from server.app import build_app
from server.config import ServerConfig
from tests.server.conftest import API_KEY, ENGINE_ARGS, MODEL_NAME, serve

ARTIFACTS = Path(__file__).parents[2] / "test-artifacts"
STEP_SECONDS = 0.15  # each engine step is slowed down so a reply streams for seconds


class SlowSteps:
    """Engine fault hook: sleeps each step (so a reply can be watched and stopped), never picks EOS,
    and records what the page asked for."""

    def __init__(self, eos_ids):
        self.eos_ids = list(eos_ids)
        self.seen = []  # (prompt token ids, SamplingParams)

    def __call__(self, entries, logits):
        time.sleep(STEP_SECONDS)
        self.seen += [(list(e.prompt_token_ids), e.sampling_params) for e in entries]
        return logits.at[:, np.asarray(self.eos_ids)].set(-1e9)


@pytest.fixture(scope="module")
def page_server(tiny_checkpoints):
    from tests.conftest import tiny_tokenizer
    hook = SlowSteps(tiny_tokenizer().all_special_ids)
    engine = LLMEngine(EngineArgs(model=str(tiny_checkpoints["gqa4"]), **ENGINE_ARGS), fault_injector=hook)
    llm = AsyncLLM(engine)
    app = build_app(llm, ServerConfig(served_model_names=(MODEL_NAME,), api_key=API_KEY))
    with serve(app) as url:
        yield url, llm, hook, engine.tokenizer
    llm.shutdown()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver")
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1200,800",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    yield chrome
    chrome.quit()


def wait_for(condition, timeout: float = 60.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or condition}")


def set_field(browser, element_id: str, value: str) -> None:
    element = browser.find_element("id", element_id)
    element.clear()
    element.send_keys(value)


def wait_idle(llm: AsyncLLM, timeout: float = 30.0) -> None:
    wait_for(lambda: llm.stats()["num_requests_running"] == 0 and llm.stats()["num_requests_waiting"] == 0,
             timeout, "the engine to be idle")


def test_chat_page_key_stream_stop_and_screenshot(page_server, browser):
    url, llm, hook, tokenizer = page_server
    by_id = lambda i: browser.find_element("id", i)  # noqa: E731
    browser.get(url + "/")
    wait_for(lambda: by_id("keybox").is_displayed(), what="the API key box")  # /v1/models said 401
    assert not by_id("send").is_enabled()
    set_field(browser, "apikey", API_KEY)
    by_id("savekey").click()
    wait_for(lambda: by_id("send").is_enabled() and by_id("model").text == MODEL_NAME, what="the key accepted")
    assert not by_id("keybox").is_displayed()

    set_field(browser, "system", "You are a pirate.")
    set_field(browser, "max_tokens", "80")
    set_field(browser, "temperature", "0")
    by_id("input").send_keys("hello page\n")  # Enter sends
    reply = lambda: browser.find_elements("css selector", ".msg.assistant")[-1].text  # noqa: E731
    first = wait_for(lambda: len(reply()) > 0 and reply(), what="streamed text")
    wait_for(lambda: len(reply()) > len(first) + 2, what="more streamed text")
    assert by_id("stop").is_enabled() and not by_id("send").is_enabled()
    assert "tokens/s" in by_id("speed").text
    by_id("stop").click()
    wait_for(lambda: by_id("status").text == "Stopped.", what="the stopped status")
    stopped = reply()
    wait_idle(llm)  # the server aborted the request when the page's fetch went away
    time.sleep(4 * STEP_SECONDS)
    assert reply() == stopped and 0 < len(stopped)
    prompt, params = hook.seen[-1]
    text = tokenizer.decode(prompt)
    assert "You are a pirate." in text and "hello page" in text
    assert params.max_tokens == 80 and params.temperature == 0.0
    assert hook.seen and sum(1 for p, _ in hook.seen if p == prompt) < 80  # stopped well before max_tokens

    set_field(browser, "max_tokens", "4")
    by_id("input").send_keys("again\n")
    wait_for(lambda: by_id("status").text == "Done.", what="the second reply")
    assert len(browser.find_elements("css selector", ".msg.assistant")) == 2
    assert "again" in tokenizer.decode(hook.seen[-1][0]) and "hello page" in tokenizer.decode(hook.seen[-1][0])
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "chat_page.png"))
    assert (ARTIFACTS / "chat_page.png").stat().st_size > 1000
    wait_idle(llm)


def test_chat_page_static_files_and_the_disable_flag(live):
    for path, kind in (("/", "text/html"), ("/static/chat.js", "javascript"), ("/static/chat.css", "text/css")):
        r = httpx.get(live.url + path, timeout=10)
        assert r.status_code == 200 and kind in r.headers["content-type"], path
    assert "http://" not in httpx.get(live.url + "/", timeout=10).text  # nothing from elsewhere
    app = build_app(live.engine, ServerConfig(served_model_names=(MODEL_NAME,), enable_chat_page=False))
    with serve(app) as url:
        assert httpx.get(url + "/", timeout=10).status_code == 404
        assert httpx.get(url + "/static/chat.js", timeout=10).status_code == 404
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200


def test_disable_chat_page_flag_parses():
    from server.__main__ import build_parser, server_config
    assert server_config(build_parser().parse_args(["--disable-chat-page"])).enable_chat_page is False
    assert server_config(build_parser().parse_args([])).enable_chat_page is True

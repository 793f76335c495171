"""Security: the API key guards every non-public route, bodies are capped, no request field reaches a file,
a shell or eval, and chat templates render in transformers' sandbox."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import jinja2.exceptions
import pytest
from fastapi.routing import APIRoute

import server
from server.middleware import PUBLIC_PATHS
from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tests.reliability.conftest import API_KEY, MODEL_NAME

ROOT = Path(server.__file__).resolve().parents[1]
BYPASS_PATHS = ["/v1/models/", "/v1//models", "/v1/models?x=1", "/%76%31/models", "/v1/./models",
                "/v1/../v1/models", "/v1", "/nonexistent", "/tokenize/", "/metrics/"]
FORBIDDEN_NAMES = {"eval", "exec", "compile", "open", "__import__"}  # builtins called by bare name
FORBIDDEN_ATTRS = {"system", "popen", "Popen", "check_output", "check_call", "execv", "execvp", "spawnv",
                   "read_text", "read_bytes", "from_file", "open"}  # os.*, subprocess.*, Path.*, io.*
# Operator inputs, never request fields: (file relative to the repository, call) -> why it is allowed.
ALLOWED = {
    ("server/__main__.py", "read_text"): "--chat-template FILE",
    ("jaxpaged/checkpoint.py", "read_text"): "jaxpaged_config.json of the --model checkpoint",
    ("jaxpaged/models/loader.py", "read_text"): "config.json of the --model folder",
    ("jaxpaged/models/weights.py", "read_text"): "the safetensors index of the --model folder",
    ("jaxpaged/tokenizer.py", "read_text"): "--generation-config / the model's generation_config.json",
    ("jaxpaged/models/model_cache.py", "read_bytes"): "jaxpaged's own loader sources (part of the cache key)",
    ("jaxpaged/models/model_cache.py", "read_text"): "meta.json of the GGUF cache entry (the server's cache dir)",
    # safetensors reads no F8_E4M3 tensor into numpy: its header is read here to map the bytes (read-only)
    ("jaxpaged/models/fp8_checkpoint.py", "open"): "the FP8 tensors of the --model folder's safetensors files",
    # the data-parallel launcher starts its replicas and the router from the operator's command line
    ("server/data_parallel.py", "import subprocess"): "python -m server --data-parallel-size N: the replicas",
    ("server/data_parallel.py", "Popen"): "the replicas' and the router's command lines, built from the CLI's",
}
SCANNED = ("jaxpaged", "server")  # every .py file below these, recursively (files added later too)
MALICIOUS_TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
]


def _routes(app) -> list[tuple[str, str]]:
    return [(method, route.path) for route in app.routes if isinstance(route, APIRoute)
            for method in sorted(route.methods)]


def test_every_non_public_route_needs_the_key(rel_keyed):
    from server.app import build_app
    from server.config import ServerConfig

    app = build_app(rel_keyed.engine, ServerConfig(served_model_names=(MODEL_NAME,), api_key=API_KEY))
    routes = _routes(app)
    assert {p for _, p in routes} >= {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                                      "/detokenize", "/metrics", "/health", "/version"}
    with httpx.Client(base_url=rel_keyed.url, timeout=30) as client:
        for method, path in routes:
            if path in PUBLIC_PATHS:
                assert client.request(method, path).status_code == 200, path
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                            {"Authorization": f"Basic {API_KEY}"}, {"X-Api-Key": API_KEY}):
                response = client.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"]["type"] == "AuthenticationError"
            keyed = client.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"}, json={})
            assert keyed.status_code != 401, (method, path)


def test_path_tricks_do_not_bypass_the_key(rel_keyed):
    """Deny by default: every path but the public ones is a 401 first, before routing (never a 404/405 that
    tells a caller what exists, never a 200)."""
    with httpx.Client(base_url=rel_keyed.url, timeout=10) as client:
        for path in BYPASS_PATHS:
            for method in ("GET", "POST"):
                response = client.request(method, path)
                assert response.status_code == 401, (method, path, response.status_code)
                assert response.json()["error"]["type"] == "AuthenticationError"


def _raw_status(url: str, method: str, target: str) -> int:
    """The status of a request whose target is sent byte for byte (httpx would normalize dot segments)."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url)
    with socket.create_connection((host.hostname, host.port), timeout=10) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        head = sock.recv(4096).decode("latin-1")
    return int(head.split(" ", 2)[1])


RAW_TARGETS = ["/health/../v1/models", "/health/%2e%2e/v1/models", "/health%2F..%2Fv1%2Fmodels", "//health",
               "/HEALTH", "/health/", "/version/../metrics", "/openapi.json/../tokenize", "/./v1/models",
               "/v1/models/.", "/v1/models%00", "/v1%2fmodels", "/metrics;x", "http://x/v1/models",
               "/admin", "/docs", "/redoc", "/health%3F"]


def test_raw_path_tricks_do_not_bypass_the_key(rel_keyed):
    """Dot segments, encoded slashes, case, absolute-form targets reach the server unnormalized: all 401."""
    for target in RAW_TARGETS:
        for method in ("GET", "POST"):
            status = _raw_status(rel_keyed.url, method, target)
            assert status == 401, (method, target, status)


def test_a_route_added_later_needs_the_key(rel_keyed):
    """Deny by default covers routes the app gains after the middleware was written."""
    from fastapi.testclient import TestClient

    from server.app import build_app
    from server.config import ServerConfig

    app = build_app(rel_keyed.engine, ServerConfig(served_model_names=(MODEL_NAME,), api_key=API_KEY))

    @app.get("/internal/added-later")
    async def added_later():
        return {"secret": 42}

    with TestClient(app) as client:
        assert client.get("/internal/added-later").status_code == 401
        keyed = client.get("/internal/added-later", headers={"Authorization": f"Bearer {API_KEY}"})
        assert keyed.status_code == 200 and keyed.json() == {"secret": 42}


def test_request_bodies_are_capped(rel_keyed):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    big = b'{"model": "tiny", "prompt": "' + b"x" * (70 * 1024) + b'"}'

    def chunked():
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    with httpx.Client(base_url=rel_keyed.url, timeout=10) as client:
        declared = client.post("/v1/completions", content=big, headers=headers)
        streamed = client.post("/v1/completions", content=chunked(), headers=headers)  # no Content-Length
    for response in (declared, streamed):
        assert response.status_code == 413 and response.json()["error"]["type"] == "RequestTooLargeError"


def test_a_huge_declared_body_is_refused_before_it_is_read(rel_keyed):
    """A Content-Length over the cap is a 413 at once, from the headers alone: nothing waits for 10 GB."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(rel_keyed.url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10 ** 10}\r\n\r\n{{\"prompt\": ")
    with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
        sock.sendall(head.encode())
        try:
            answer = sock.recv(4096).decode("latin-1")
        except TimeoutError:
            answer = "(no answer within 5 s)"
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert "RequestTooLargeError" in answer


@pytest.mark.parametrize("body, param", [
    (dict(prompt="x" * 300, max_tokens=1), "prompt"),
    (dict(prompt="hi", max_tokens=129), "prompt"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    (dict(prompt="hi", stop_token_ids=[10**9], min_tokens=1), "stop_token_ids"),
    (dict(prompt="hi", stop_token_ids=list(range(40)), min_tokens=1), "stop_token_ids"),
    (dict(prompt="hi", stop=[f"s{i}" for i in range(40)]), "stop"),
    (dict(prompt="hi", n=10**6), "n"),
])
def test_limits_are_400s_naming_the_field(rel, body, param):
    response = httpx.post(rel.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_logit_bias_is_capped_for_a_real_vocabulary():
    """The tiny model's 260 ids cannot make 301 valid entries (the HTTP case above could trip the engine's
    vocabulary check); 301 entries with ids valid for SmolLM2's 49152 must still be refused by the HTTP
    layer's body model (a 400 naming logit_bias), before they reach the engine or the sampler's table."""
    from pydantic import ValidationError

    from server.params import MAX_LOGIT_BIAS_ENTRIES, build_sampling_params

    def params(entries: int):
        body = CompletionRequest(prompt="x", logit_bias={str(i): 1.0 for i in range(entries)})
        return build_sampling_params(body, {}, max_tokens=4, logprobs=None)

    assert len(params(MAX_LOGIT_BIAS_ENTRIES).logit_bias) == MAX_LOGIT_BIAS_ENTRIES
    with pytest.raises(ValidationError) as err:
        params(MAX_LOGIT_BIAS_ENTRIES + 1)
    assert [e["loc"][0] for e in err.value.errors()] == ["logit_bias"]


def _forbidden_calls(path: Path) -> list[str]:
    found, rel = [], path.relative_to(ROOT).as_posix()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            attr = isinstance(func, ast.Attribute)
            name = func.attr if attr else getattr(func, "id", "")
            if name in (FORBIDDEN_ATTRS if attr else FORBIDDEN_NAMES) and (rel, name) not in ALLOWED:
                found.append(f"{rel}:{node.lineno} {name}()")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [f"{rel}:{node.lineno} import {n}" for n in names
                      if n.split(".")[0] in ("subprocess", "pickle", "shelve", "marshal")
                      and (rel, f"import {n}") not in ALLOWED]
    return found


def test_no_request_field_reaches_a_file_a_shell_or_eval():
    """Static: jaxpaged/ and server/ (every file, recursively) call no eval/exec/open/subprocess; the few
    file reads are of operator inputs (ALLOWED, each still present)."""
    files = sorted(path for top in SCANNED for path in (ROOT / top).rglob("*.py"))
    assert len(files) > 30 and ROOT / "jaxpaged" / "models" / "llama.py" in files
    assert not [hit for path in files for hit in _forbidden_calls(path)]
    for rel, name in ALLOWED:  # an allowance whose call is gone is removed, not kept "just in case"
        assert (name if name.startswith("import ") else f".{name}(") in (ROOT / rel).read_text(), (rel, name)
    for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest):
        # chat_template_kwargs (vLLM's): variables for the model's own template, never a template (a request
        # naming "chat_template" among them is a 400: test_a_chat_template_in_the_request_is_ignored)
        risky = {f for f in model.model_fields if any(w in f for w in ("template", "path", "file", "url", "dir"))
                 and f != "chat_template_kwargs"}
        assert not risky, (model.__name__, risky)


def test_a_chat_template_in_the_request_is_ignored(rel):
    body = dict(model=MODEL_NAME, temperature=0, max_tokens=6, messages=[{"role": "user", "content": "hi"}])
    with httpx.Client(base_url=rel.url, timeout=30) as client:
        plain = client.post("/v1/chat/completions", json=body).json()
        for template in MALICIOUS_TEMPLATES:
            evil = client.post("/v1/chat/completions", json={**body, "chat_template": template,
                                                              "chat_template_kwargs": {"x": template}})
            assert evil.status_code == 200
            assert evil.json()["choices"] == plain["choices"]
            # template variables, yes; the template itself through them, no
            swapped = client.post("/v1/chat/completions",
                                  json={**body, "chat_template_kwargs": {"chat_template": template}})
            assert swapped.status_code == 400 and swapped.json()["error"]["param"] == "chat_template_kwargs"
        tokens = client.post("/tokenize", json={"messages": body["messages"], "chat_template": "{{ 1/0 }}"})
        assert tokens.status_code == 200 and tokens.json()["count"] > 0


@pytest.mark.parametrize("template", MALICIOUS_TEMPLATES)
def test_chat_templates_render_in_a_sandbox(rel, template):
    """transformers renders chat templates in jinja2's ImmutableSandboxedEnvironment."""
    tokenizer = rel.engine.engine.tokenizer
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template, tokenize=False)


def test_a_malicious_model_template_is_a_400_over_http(rel):
    """The chat endpoint renders the model's own template in the sandbox too: a template reaching for Python
    internals is refused (400), never rendered."""
    tokenizer = rel.engine.engine.tokenizer
    body = dict(model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    saved = tokenizer.chat_template
    try:
        for template in MALICIOUS_TEMPLATES:
            tokenizer.chat_template = template
            response = httpx.post(rel.url + "/v1/chat/completions", json=body, timeout=30)
            assert response.status_code == 400, (template, response.text[:300])
            assert "chat template" in response.json()["error"]["message"]
    finally:
        tokenizer.chat_template = saved


def test_transformers_compiles_templates_in_the_immutable_sandbox():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils import chat_template_utils

    compiled = chat_template_utils._compile_jinja_template("{{ 1 }}")
    assert isinstance(compiled.environment, ImmutableSandboxedEnvironment)

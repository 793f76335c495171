"""`python -m server` starting up as a user meets it, in real processes: `--help` at once (no JAX imported), each
failure a user can fix in one `error: ...` line without a traceback, fast (the port is bound before the model
loads), and the CPU context cap said at start-up and in `--help`."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.__main__ import CPU_MAX_MODEL_LEN, STARTUP_ERROR, USAGE_ERROR
from tests.conftest import make_tiny_checkpoint
from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
HELP_SECONDS = 3.0
FAIL_SECONDS = 15.0  # the bound for a failure found before the model loads, counting the imports
LOADED_FAIL_SECONDS = 60.0  # a setting the loaded model refuses: the model (and JAX's backend) load first
PROGRESS = re.compile(r"\d+/\d+ \[")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) [\w.]+: ")


# XDG_CACHE_HOME of the servers that start: their compilation cache persists between test runs
CACHE_HOME = Path.home() / ".cache" / "jaxpaged" / "server-tests" / "startup"


def server_env(tmp_path: Path, cache_home: Path | None = None) -> dict:
    """CPU, no network for the hub, caches of this test's own (or `cache_home`)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
            "XDG_CACHE_HOME": str(cache_home or tmp_path / "cache")}


def run_server(tmp_path: Path, *args: str, python_flags: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess,
                                                                                       float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *python_flags, "-m", "server", *args], cwd=ROOT, env=server_env(tmp_path),
                          capture_output=True, text=True, timeout=120, check=False)
    return proc, time.monotonic() - start


def assert_one_line_failure(proc: subprocess.CompletedProcess, seconds: float, status: int, says: str,
                            within: float = FAIL_SECONDS) -> None:
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == status, proc.stderr
    assert lines and lines[-1].startswith("error: ") and says in lines[-1], proc.stderr
    # the rest: log lines and the loader's progress bars (tqdm's), no other output
    assert all(LOG_LINE.match(line) or PROGRESS.search(line) or not line.strip() for line in lines[:-1]), proc.stderr
    assert "serving" not in proc.stderr, proc.stderr
    assert seconds < within, f"{seconds:.1f} s: {proc.stderr}"


def help_entries(text: str) -> dict[str, str]:
    """--help's text per option ("--flag": its help), joined across wrapped lines."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        match = re.match(r"^  (-{1,2}[\w-]+)", line)
        if match:
            flag = match.group(1)
            entries[flag] = line
        elif flag and line.startswith("    "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def test_help_is_fast_imports_no_jax_and_states_each_default_once(tmp_path):
    proc, seconds = run_server(tmp_path, "--help", python_flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "server.__main__" in imported or "server" in imported  # the import log is read right
    assert not {"jax", "jaxpaged", "uvicorn", "fastapi"} & imported
    entries = help_entries(proc.stdout)
    assert len(entries) > 40
    for text in entries.values():
        assert len(re.findall(r"\bdefault\b", text)) <= 1, text
    assert "(default: 8000)" in entries["--port"] and "(default: True)" in entries["--enable-prefix-caching"]
    assert f"on CPU at most {CPU_MAX_MODEL_LEN}" in entries["--max-model-len"]
    proc, seconds = run_server(tmp_path, "--help")  # timed without the import log's own cost
    assert proc.returncode == 0 and seconds < HELP_SECONDS, (seconds, proc.stderr)


def test_building_the_parser_imports_no_jax():
    code = ("import sys; from server.__main__ import build_parser; build_parser().parse_args([]); "
            "print(sorted(m for m in ('jax', 'jaxpaged', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("args, status, says", [
    (["--no-such-flag"], USAGE_ERROR, "unrecognized arguments: --no-such-flag"),
    (["--port", "eighty"], USAGE_ERROR, "argument --port: invalid int value: 'eighty'"),
    (["--enable-auto-tool-choice"], USAGE_ERROR, "needs a tool_call_parser"),
    (["--tensor-parallel-size", "0"], USAGE_ERROR, "tensor_parallel_size=0 must be a positive integer"),
    (["--model", "no-such-model"], STARTUP_ERROR, "'no-such-model' is not a built-in model"),
    (["--model", "no-such-org/no-such-model"], STARTUP_ERROR, "is not in the Hugging Face cache"),
    (["--host", "no-such-host.invalid"], STARTUP_ERROR, "cannot listen on no-such-host.invalid:"),
])
def test_a_bad_command_line_or_unknown_model_is_one_line(tmp_path, args, status, says):
    proc, seconds = run_server(tmp_path, "--host", "127.0.0.1", "--port", str(free_port()), *args)
    assert_one_line_failure(proc, seconds, status, says)


def test_missing_weights_is_one_line(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tiny")
    for weights in folder.glob("*.safetensors*"):
        weights.unlink()
    proc, seconds = run_server(tmp_path, "--model", str(folder), "--host", "127.0.0.1", "--port", str(free_port()))
    assert_one_line_failure(proc, seconds, STARTUP_ERROR, "neither model.safetensors nor")


def test_a_setting_the_model_refuses_is_one_line(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tiny")  # its context: 256 tokens
    proc, seconds = run_server(tmp_path, "--model", str(folder), "--max-model-len", "999", "--num-pages", "64",
                               "--host", "127.0.0.1", "--port", str(free_port()))
    assert_one_line_failure(proc, seconds, STARTUP_ERROR, "max_model_len=999 exceeds the model's context length 256",
                            within=LOADED_FAIL_SECONDS)


def test_a_busy_port_fails_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, seconds = run_server(tmp_path, "--host", "127.0.0.1", "--port", str(port))
    assert_one_line_failure(proc, seconds, STARTUP_ERROR, f"cannot listen on 127.0.0.1:{port}: Address already in use")
    assert proc.stderr.strip().count("\n") == 0  # nothing else: no engine was started
    assert seconds < HELP_SECONDS  # no JAX imported before the bind


def test_the_cpu_context_cap_is_logged_and_serving_is_said_once_listening(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tiny")
    config = json.loads((folder / "config.json").read_text())
    model_len = 2 * CPU_MAX_MODEL_LEN
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": model_len}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--model", str(folder), "--host", "127.0.0.1", "--port",
                             str(port), "--num-pages", "160", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"],
                            cwd=ROOT, env=server_env(tmp_path, CACHE_HOME / "cap"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:  # bound but not yet listening: refused, as when nothing is there
                time.sleep(0.2)
        models = httpx.get(url + "/v1/models", timeout=10).json()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert models["data"][0]["max_model_len"] == CPU_MAX_MODEL_LEN
    lines = stderr.splitlines()
    cap = [i for i, line in enumerate(lines) if "capped on CPU" in line]
    serving = [i for i, line in enumerate(lines) if f"serving {folder} as {folder}" in line]
    ready = [i for i, line in enumerate(lines) if "jaxpaged ready in" in line]
    assert len(cap) == 1 and len(serving) == 1 and len(ready) == 1, stderr[-3000:]
    assert (f"max_model_len {CPU_MAX_MODEL_LEN}: the model's context is {model_len}" in lines[cap[0]]
            and "--max-model-len" in lines[cap[0]])
    assert ready[0] < serving[0] and lines[serving[0]].endswith(f"on http://127.0.0.1:{port}")



def test_a_port_taken_while_the_model_loads_is_one_line(tmp_path):
    """The early bind is a bind, not a listen: another socket may bind the port too (SO_REUSEADDR, neither
    listening) and listen first; the server then fails to listen once ready, in one line."""
    from server.lifecycle import bind_socket

    folder = make_tiny_checkpoint(tmp_path / "tiny")
    with bind_socket("127.0.0.1", 0) as other:
        port = other.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "server", "--model", str(folder), "--host", "127.0.0.1",
                                 "--port", str(port), "--max-model-len", "128", "--num-pages", "64"],
                                cwd=ROOT, env=server_env(tmp_path, CACHE_HOME / "taken"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            first = proc.stderr.readline()  # logged once its socket is bound, before the model loads
            assert "starting process 0 of 1" in first, first
            other.listen()
            stderr = first + proc.communicate(timeout=300)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
    lines = stderr.strip().splitlines()
    assert proc.returncode == STARTUP_ERROR and "Traceback" not in stderr, stderr[-3000:]
    assert lines[-1] == (f"error: cannot listen on 127.0.0.1:{port}: Address already in use (another process took "
                         "the port while the model loaded); choose another with --port"), stderr[-3000:]
    assert "serving" not in stderr


class _GatedHub(http.server.BaseHTTPRequestHandler):
    """The hub's answer to a gated repo asked for without an accepted licence: 401 with X-Error-Code GatedRepo."""

    asked: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.asked.append(self.path)
        body = b'{"error": "Access to model meta-llama/Meta-Llama-3-8B-Instruct is restricted."}'
        self.send_response(401)
        self.send_header("X-Error-Code", "GatedRepo")
        self.send_header("X-Error-Message", "Access to model is restricted and you are not in the authorized list.")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_the_introduction_command_resolves_its_alias_and_a_gated_model_says_what_it_needs(tmp_path):
    """`--model meta-llama/Llama-3-8B-Instruct` (how the engine is introduced) asks the hub for its repo,
    meta-llama/Meta-Llama-3-8B-Instruct; the hub (here a local one) refuses a gated model: one line says what to do."""
    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GatedHub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    env = {**server_env(tmp_path), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}",
           "HF_TOKEN": "", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "server", "--model", "meta-llama/Llama-3-8B-Instruct", "--host",
                               "127.0.0.1", "--port", str(free_port())], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120, check=False)
    finally:
        hub.shutdown()
    assert_one_line_failure(proc, time.monotonic() - start, STARTUP_ERROR,
                            "'meta-llama/Meta-Llama-3-8B-Instruct' is a gated model: accept its licence on "
                            "https://huggingface.co/meta-llama/Meta-Llama-3-8B-Instruct")
    assert "set HF_TOKEN" in proc.stderr.splitlines()[-1]
    assert "meta-llama/Llama-3-8B-Instruct is the hub's meta-llama/Meta-Llama-3-8B-Instruct" in proc.stderr
    models = [path for path in _GatedHub.asked if path.startswith("/api/models/")]
    assert models and all(p.startswith("/api/models/meta-llama/Meta-Llama-3-8B-Instruct/") for p in models), models

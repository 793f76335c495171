"""Start-up time of `python -m server`: a cold start (empty caches), then warm ones, with a breakdown.

    python scripts/bench_startup.py                        # the default model, 1 cold + 2 warm starts
    python scripts/bench_startup.py --tree /old/checkout --tree . --warm-runs 1   # before/after, one table
    python scripts/bench_startup.py --warm-runs 3 -- --max-model-len 1024

Each start runs `python -m server` (from --tree, default this checkout; several --tree run one after
the other) as a subprocess with XDG_CACHE_HOME pointing at a fresh folder per tree (so the compilation
cache and the model cache start empty, as on a fresh machine, and are warm for the later starts), polls
GET /health until it answers 200, then stops the server (SIGTERM) and waits for it to exit. Arguments
after `--` go to the server.

The breakdown comes from the server's own log lines (stderr), timed as they arrive:
  imports       spawn -> the server's "starting" line (interpreter, jax, transformers, server imports)
  load ... sampler  the engine's phases, from its "jaxpaged ready in ... (load x s, ...)" line
  engine other  the rest of the engine's construction (JAX backend start, configuration)
  http          "jaxpaged ready" line -> /health 200 (app build, uvicorn start)
A tree whose server does not log these lines (e.g. an older checkout) gets only the total.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"jaxpaged ready in ([\d.]+) s \(([^)]*)\)")
PHASE = re.compile(r"(\w+) ([\d.]+) s")
STARTING = "python -m server: starting"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_lines(stream, lines: list[tuple[float, str]]) -> None:
    for line in stream:
        lines.append((time.perf_counter(), line.rstrip("\n")))


def start_once(tree: Path, cache_home: Path, server_args: list[str], timeout: float) -> dict:
    """One start: seconds to /health 200 and the phases found in the log."""
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home), "PYTHONPATH": str(tree)}
    spawned = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port),
                             *server_args], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=read_lines, args=(proc.stderr, lines), daemon=True)
    reader.start()
    try:
        total = wait_healthy(f"http://127.0.0.1:{port}/health", proc, spawned, timeout)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(5)
    if total is None:
        tail = "\n".join(line for _, line in lines[-30:])
        raise RuntimeError(f"the server did not answer /health (exit {proc.returncode}):\n{tail}")
    return {"total": total, **phases(lines, spawned, spawned + total), "exit": proc.returncode,
            "log": [line for _, line in lines]}


def wait_healthy(url: str, proc: subprocess.Popen, spawned: float, timeout: float) -> float | None:
    """Seconds from spawn to /health 200, polled every 50 ms through one client: `httpx.get` builds a
    client (and its SSL context) per call, ~27 ms of CPU, which at this rate took a third of a core from
    the start it measured (sessions 24-27; its effect on their figures was within the machine's drift)."""
    with httpx.Client(timeout=1) as client:
        while time.perf_counter() - spawned < timeout and proc.poll() is None:
            try:
                if client.get(url).status_code == 200:
                    return time.perf_counter() - spawned
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    return None


def phases(lines: list[tuple[float, str]], spawned: float, healthy: float) -> dict[str, float]:
    found: dict[str, float] = {}
    starting = next((t for t, line in lines if STARTING in line), None)
    if starting is not None:
        found["imports"] = starting - spawned
    ready = next(((t, m) for t, line in lines if (m := READY.search(line))), None)
    if ready is not None:
        t_ready, match = ready
        engine = {name: float(v) for name, v in PHASE.findall(match.group(2))}
        found.update(engine)
        found["engine other"] = float(match.group(1)) - sum(engine.values())
        found["http"] = healthy - t_ready
    return found


def table(runs: list[tuple[str, dict]]) -> str:
    names: list[str] = []
    for _, run in runs:
        names += [k for k in run if k not in ("total", "exit", "log") and k not in names]
    head = "| phase (s) | " + " | ".join(label for label, _ in runs) + " |"
    rows = [head, "|---|" + "---:|" * len(runs)]
    for name in names + ["total"]:
        cells = [f"{run[name]:.1f}" if name in run else "-" for _, run in runs]
        rows.append(f"| {'**total to /health 200**' if name == 'total' else name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", type=Path, action="append", help="checkout whose `python -m server` is started "
                   "(repeat to compare checkouts; default: this one)")
    p.add_argument("--warm-runs", type=int, default=2, help="starts after the cold one")
    p.add_argument("--timeout", type=float, default=900, help="seconds one start may take")
    p.add_argument("--show-log", action="store_true", help="print each start's server log")
    args = p.parse_args(own)
    trees = [t.resolve() for t in args.tree or [REPO]]
    runs = []
    for n, tree in enumerate(trees):
        prefix = f"{tree.name} " if len(trees) > 1 else ""
        with tempfile.TemporaryDirectory(prefix="jaxpaged-startup-") as cache_home:
            for i in range(1 + args.warm_runs):
                label = prefix + ("cold" if i == 0 else f"warm {i}")
                run = start_once(tree, Path(cache_home), server_args, args.timeout)
                print(f"{label}: {run['total']:.1f} s to /health 200 (exit {run['exit']}), load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
                if args.show_log:
                    print("\n".join("    " + line for line in run["log"]))
                runs.append((label, run))
    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, trees {', '.join(map(str, trees))}, server args "
          f"{server_args or '(defaults)'}, load average {os.getloadavg()[0]:.1f}")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

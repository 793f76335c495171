"""`python -m server --data-parallel-size N`: N engine replicas behind vLLM's router, started and supervised.

This module owns the launcher: it turns the data-parallel flags into a `DataParallelConfig`, starts one
`python -m server` process per local replica (each on 127.0.0.1, on its own devices) and the router
(`vllm-router`, a Rust, cache-aware router from PyPI: `pip install vllm-router`) on the public host and port,
restarts whichever exits unexpectedly, and on SIGTERM/SIGINT drains them all. It routes nothing itself.

Every child runs in its own session (process group), so a signal to the group reaches its descendants too,
and is asked by the kernel (PR_SET_PDEATHSIG) to stop if the launcher dies without draining it.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time

logger = logging.getLogger(__name__)

# vllm-router's policies that need nothing but the workers' URLs (kv_aware needs KV events from the engine).
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")
ROUTER_MODULE = "vllm_router.launch_router"
DEVICE_VISIBILITY_ENV = "CUDA_VISIBLE_DEVICES"  # one disjoint GPU subset per replica
# The router checks the replicas' /health this often: a restarted replica rejoins within ~2 intervals
# (vllm-router's default, 60 s, would leave it out for minutes).
HEALTH_CHECK_SECONDS = 2
# A replica whose requests failed (its circuit breaker open) gets trial requests again after this long: in
# step with the launcher, which restarts it within seconds (vllm-router's default is 60 s).
CIRCUIT_OPEN_SECONDS = 5
# How long the router waits at start-up for the replicas to become healthy (a cold start compiles).
WORKER_STARTUP_SECONDS = 3600
RESTART_BACKOFF_SECONDS = (1.0, 30.0)  # first and longest wait before restarting a child that exited
STABLE_SECONDS = 60.0  # a child up this long that exits is restarted after the first backoff again
# A child that keeps exiting sooner than STABLE_SECONDS this many times in a row (a model that does not load,
# a port taken) will not come up by itself: the launcher stops the fleet and exits 1.
MAX_EARLY_EXITS = 5
KILL_MARGIN_SECONDS = 15.0  # beyond the replicas' drain time, before what is left is killed
_POLL_SECONDS = 0.2
_LOOPBACK = "127.0.0.1"

# Flags the launcher consumes; every other flag is passed on to each replica unchanged.
_LAUNCHER_FLAGS = dict(host=str, port=int, api_key=str, data_parallel_size=int, data_parallel_size_local=int,
                       data_parallel_rank=int, data_parallel_base_port=int, router_policy=str,
                       router_metrics_port=int)


def add_data_parallel_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="engine replicas in all, each "
                   "a whole model on its own devices, behind vllm-router on --host:--port (1: no router)")
    g.add_argument("--data-parallel-size-local", type=int, default=None, help="of those, the replicas this "
                   "command starts on this host (default: all); the others are named by --data-parallel-worker-urls")
    g.add_argument("--data-parallel-worker-urls", nargs="+", default=None, help="base URLs of the replicas "
                   "running elsewhere (each a `python -m server`, possibly itself multi-host)")
    g.add_argument("--data-parallel-rank", type=int, default=None, help="this replica's rank: set by the "
                   "launcher on each replica it starts; labels its metrics replica=<rank>")
    g.add_argument("--data-parallel-base-port", type=int, default=None, help="local replica i listens on "
                   "127.0.0.1:(this + i) (default: --port + 1)")
    g.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES, help="vllm-router's "
                   "policy: cache_aware sends a request where its prompt's longest prefix went before (so the "
                   "replicas' prefix caches hit), unless the load is too uneven")
    g.add_argument("--router-metrics-port", type=int, default=None, help="port of the router's Prometheus "
                   "/metrics, on --host (default: the port after the last local replica's)")


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    """The fleet one launcher runs: `size_local` replicas here, `remote_urls` elsewhere, one router."""

    size: int
    host: str = "0.0.0.0"
    port: int = 8000
    size_local: int | None = None  # None: size
    remote_urls: tuple[str, ...] = ()
    base_port: int | None = None  # None: port + 1
    router_metrics_port: int | None = None  # None: after the last local replica's port
    policy: str = "cache_aware"
    devices_per_replica: int = 1  # the replicas' --tensor-parallel-size
    visible_devices: tuple[str, ...] | None = None  # the host's devices to split (None: 0, 1, 2, ...)
    drain_seconds: float = 30.0  # the replicas' --shutdown-timeout
    log_level: str = "info"

    def __post_init__(self):
        local = self.size if self.size_local is None else self.size_local
        base = self.port + 1 if self.base_port is None else self.base_port
        metrics = base + local if self.router_metrics_port is None else self.router_metrics_port
        object.__setattr__(self, "size_local", local)
        object.__setattr__(self, "base_port", base)
        object.__setattr__(self, "router_metrics_port", metrics)
        object.__setattr__(self, "remote_urls", tuple(self.remote_urls))
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"--data-parallel-size={self.size!r}: must be >= 1")
        if not 1 <= local <= self.size:
            raise ValueError(f"--data-parallel-size-local={local}: must be in [1, --data-parallel-size]")
        if len(self.remote_urls) != self.size - local:
            raise ValueError(f"--data-parallel-worker-urls: {self.size - local} URL(s) needed for the replicas "
                             f"not on this host, got {len(self.remote_urls)}")
        ports = [self.port, metrics, *range(base, base + local)]
        if any(not 0 < p < 65536 for p in ports) or len(set(ports)) != len(ports):
            raise ValueError(f"ports {ports}: the public port, the router's metrics port and the replicas' "
                             "ports must be distinct and in [1, 65535]")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"--router-policy={self.policy!r}: choose one of {', '.join(ROUTER_POLICIES)}")
        if self.devices_per_replica < 1:
            raise ValueError("devices per replica (--tensor-parallel-size) must be >= 1")
        needed = local * self.devices_per_replica
        if self.visible_devices is not None and len(self.visible_devices) < needed:
            raise ValueError(f"{DEVICE_VISIBILITY_ENV} lists {len(self.visible_devices)} device(s); {local} "
                             f"replica(s) x {self.devices_per_replica} need {needed}")

    @property
    def local_urls(self) -> tuple[str, ...]:
        return tuple(f"http://{_LOOPBACK}:{self.base_port + i}" for i in range(self.size_local))

    def replica_devices(self, rank: int) -> str:
        """The device-visibility value of local replica `rank`: its own disjoint slice of the host's devices."""
        devices = self.visible_devices or tuple(str(i) for i in range(self.size_local * self.devices_per_replica))
        return ",".join(devices[rank * self.devices_per_replica:(rank + 1) * self.devices_per_replica])

    def router_command(self) -> list[str]:
        return [sys.executable, "-m", ROUTER_MODULE, "--host", self.host, "--port", str(self.port),
                "--worker-urls", *self.local_urls, *self.remote_urls, "--policy", self.policy,
                "--prometheus-host", self.host, "--prometheus-port", str(self.router_metrics_port),
                "--health-check-interval-secs", str(HEALTH_CHECK_SECONDS),
                "--cb-timeout-duration-secs", str(CIRCUIT_OPEN_SECONDS),
                "--worker-startup-timeout-secs", str(WORKER_STARTUP_SECONDS),
                "--worker-startup-check-interval", "1", "--log-level", self.log_level]


def config_from_args(ns: argparse.Namespace) -> DataParallelConfig:
    visible = os.environ.get(DEVICE_VISIBILITY_ENV)
    return DataParallelConfig(
        size=ns.data_parallel_size, host=ns.host, port=ns.port, size_local=ns.data_parallel_size_local,
        remote_urls=tuple(ns.data_parallel_worker_urls or ()), base_port=ns.data_parallel_base_port,
        router_metrics_port=ns.router_metrics_port, policy=ns.router_policy,
        devices_per_replica=ns.tensor_parallel_size, drain_seconds=ns.shutdown_timeout, log_level=ns.log_level,
        visible_devices=tuple(d for d in visible.split(",") if d) if visible else None)


def replica_args(argv: list[str]) -> list[str]:
    """`argv` without the launcher's own flags (those of _LAUNCHER_FLAGS and the worker URLs), in order."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, kind in _LAUNCHER_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind)
    p.add_argument("--data-parallel-worker-urls", nargs="+")
    p.add_argument("-dp", type=int)
    return p.parse_known_args(argv)[1]


@dataclasses.dataclass
class Child:
    """One supervised process: what starts it, the running process, and when it may be restarted."""

    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = RESTART_BACKOFF_SECONDS[0]
    restart_at: float | None = None
    early_exits: int = 0  # in a row, each sooner than STABLE_SECONDS after its start

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True, preexec_fn=_die_with_parent)
        self.started, self.restart_at = time.monotonic(), None
        logger.info("started %s (pid %d%s)", self.name, self.proc.pid,
                    f", restart {self.restarts}" if self.restarts else "")

    def signal_group(self, sig: int) -> None:
        """`sig` to the child's whole process group (what it started too); gone already is fine."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it (it then drains) when the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except OSError:  # not glibc Linux: the launcher's own drain still stops its children
        pass


class Launcher:
    """Starts the replicas and the router, restarts what exits, drains everything on SIGTERM/SIGINT."""

    def __init__(self, config: DataParallelConfig, replica_argv: list[str], env: dict[str, str] | None = None):
        self.config, self.stopping = config, threading.Event()
        base_env = dict(os.environ if env is None else env)
        self.children = [self._replica(rank, replica_argv, base_env) for rank in range(config.size_local)]
        self.children.append(Child("router", config.router_command(), base_env))

    def _replica(self, rank: int, replica_argv: list[str], env: dict[str, str]) -> Child:
        port = self.config.base_port + rank
        argv = [sys.executable, "-m", "server", *replica_argv, "--host", _LOOPBACK, "--port", str(port),
                "--data-parallel-rank", str(rank)]
        return Child(f"replica {rank} ({_LOOPBACK}:{port})", argv,
                     {**env, DEVICE_VISIBILITY_ENV: self.config.replica_devices(rank)})

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; then drain. 0 when every child exited cleanly."""
        if importlib.util.find_spec(ROUTER_MODULE.split(".")[0]) is None:
            logger.error("--data-parallel-size needs the router: pip install vllm-router")
            return 2
        previous = {sig: signal.signal(sig, lambda *_: self.stopping.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for child in self.children:
                child.start()
            c = self.config
            logger.info("serving %d replica(s) (%d here) behind vllm-router (%s) on http://%s:%d; router "
                        "metrics on :%d", c.size, c.size_local, c.policy, c.host, c.port, c.router_metrics_port)
            failed = False
            while not failed and not self.stopping.wait(_POLL_SECONDS):
                failed = not self.supervise()
            code = self.drain()
            return 1 if failed else code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def supervise(self) -> bool:
        """Restart children that exited, each after its backoff (doubling while it keeps failing early);
        False once one failed early MAX_EARLY_EXITS times in a row."""
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    child.start()
                continue
            code = child.proc.poll()
            if code is None:
                continue
            child.signal_group(signal.SIGKILL)  # whatever it left behind in its group
            if now - child.started >= STABLE_SECONDS:
                child.backoff, child.early_exits = RESTART_BACKOFF_SECONDS[0], 0
            else:
                child.early_exits += 1
            if child.early_exits >= MAX_EARLY_EXITS:
                logger.error("%s exited with status %s, %d times in a row within %.0f s of its start: stopping",
                             child.name, code, child.early_exits, STABLE_SECONDS)
                child.proc = None
                return False
            logger.warning("%s exited with status %s; restarting it in %.0f s", child.name, code, child.backoff)
            child.restart_at = now + child.backoff
            child.backoff = min(child.backoff * 2, RESTART_BACKOFF_SECONDS[1])
        return True

    def drain(self) -> int:
        """SIGTERM every child's group at once (each replica finishes its in-flight requests, the router its
        connections), wait, then SIGKILL what is left."""
        logger.info("draining %d replica(s) and the router", self.config.size_local)
        running = [c for c in self.children if c.proc is not None and c.restart_at is None]
        for child in running:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_seconds + KILL_MARGIN_SECONDS
        codes = {}
        for child in running:
            try:
                codes[child.name] = child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("%s did not stop in time: killing it", child.name)
                codes[child.name] = None
            child.signal_group(signal.SIGKILL)
            if codes[child.name] is None:
                child.proc.wait()
        bad = {name: code for name, code in codes.items() if code != 0}
        if bad:
            logger.warning("children that did not exit cleanly: %s", bad)
        return 0 if not bad else 1


def main(ns: argparse.Namespace, argv: list[str]) -> int:
    """The launcher for parsed flags `ns` (from `argv`); 2 on a configuration error."""
    try:
        config = config_from_args(ns)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if ns.api_key:  # to the replicas through the environment, not their command lines (ps shows those)
        env["JAXPAGED_API_KEY"] = ns.api_key
    return Launcher(config, replica_args(argv), env).run()

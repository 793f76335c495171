"""The server's lifecycle. Start-up: the listening socket is bound before the model loads (`bind_socket`: a
busy port fails at once, not after the warm-up) and "serving ... on URL" is logged once the server listens.
Graceful shutdown: on SIGTERM/SIGINT stop accepting, let in-flight requests finish for a grace period,
abort the rest (their streams end with a 503 error chunk and `[DONE]`), then exit 0.

uvicorn's own handling re-raises the captured signal after shutting down (the
process then dies *by* SIGTERM, exit status -15) and cancels streams mid-way
after `timeout_graceful_shutdown`; `GracefulServer` replaces both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import signal
import socket
import time
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:  # the engine imports JAX; `python -m server` imports this module before it needs JAX
    from jaxpaged.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 2.0  # after the engine stopped: time for handlers to send their last bytes
_POLL_SECONDS = 0.05


@dataclasses.dataclass(frozen=True)
class ShutdownConfig:
    """grace_seconds: how long in-flight requests may run on after the signal before they are aborted."""

    grace_seconds: float = 30.0

    def __post_init__(self):
        if not isinstance(self.grace_seconds, (int, float)) or not 0 <= self.grace_seconds <= 3600:
            raise ValueError(f"ShutdownConfig.grace_seconds={self.grace_seconds!r}: must be in [0, 3600]")


class ListenError(OSError):
    """The bound socket could not listen once the engine was ready (another process bound the same port in
    the meantime: SO_REUSEADDR lets two sockets bind a port while neither listens)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (until the server starts, a client's connect is
    refused, as when nothing is there); an address that cannot be had is an OSError saying so in a line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn's own bind
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's listeners on POSIX
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        hint = "; choose another with --port" if err.errno == errno.EADDRINUSE else ""
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}{hint}") from None
    return sock


def socket_url(host: str, sock: socket.socket) -> str:
    """http://host:port of a bound socket (its real port when 0 was asked)."""
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains the engine before it stops, and exits normally on SIGTERM.

    served: what is served, for the "serving ... on URL" line logged once the server listens."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown: ShutdownConfig, served: str = ""):
        super().__init__(config)
        self.engine, self.shutdown_config, self.served = engine, shutdown, served

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Listen on the bound sockets (here, so a failure is ours to report: uvloop's server would close the
        socket and go on), uvicorn's start-up, then the "serving" line (uvicorn logs none on given sockets)."""
        for sock in sockets or ():
            try:
                sock.listen(self.config.backlog)
            except OSError as err:
                raise ListenError(f"cannot listen on {self.config.host}:{sock.getsockname()[1]}: "
                                  f"{err.strerror or err} (another process took the port while the model "
                                  "loaded); choose another with --port") from None
        await super().startup(sockets)
        if self.started:
            listeners = sockets or [s for server in self.servers for s in server.sockets]
            logger.info("serving %s on %s", self.served or "the app", socket_url(self.config.host, listeners[0]))

    def handle_exit(self, sig: int, frame) -> None:
        """Like uvicorn's, without recording the signal (which uvicorn re-raises after the shutdown)."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting first (uvicorn's shutdown repeats this harmlessly)
            server.close()
        await self._drain(self.shutdown_config.grace_seconds)
        await asyncio.to_thread(self.engine.shutdown)  # what still runs ends with EngineShutdownError
        await super().shutdown(sockets)

    async def _drain(self, grace_seconds: float) -> None:
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and not self.force_exit:
            stats = self.engine.stats()
            if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
                return
            await asyncio.sleep(_POLL_SECONDS)
        stats = self.engine.stats()
        logger.warning("shutdown grace period (%.1f s) over: aborting %d running and %d waiting requests",
                       grace_seconds, stats["num_requests_running"], stats["num_requests_waiting"])

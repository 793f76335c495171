"""Graceful shutdown: on SIGTERM/SIGINT stop accepting, let in-flight requests finish for a grace period,
abort the rest (their streams end with a 503 error chunk and `[DONE]`), then exit 0.

uvicorn's own handling re-raises the captured signal after shutting down (the
process then dies *by* SIGTERM, exit status -15) and cancels streams mid-way
after `timeout_graceful_shutdown`; `GracefulServer` replaces both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time

import uvicorn

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


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains the engine before it stops, and exits normally on SIGTERM."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown: ShutdownConfig):
        super().__init__(config)
        self.engine, self.shutdown_config = engine, shutdown

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

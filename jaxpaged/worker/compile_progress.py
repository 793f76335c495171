"""What a warm-up says while it compiles: a line per step shape as its programs finish (compiled, or loaded from
the persistent compilation cache), a line every few seconds while the pool is busy, and the totals at the end.

A step shape's line comes when the compile pool finishes its programs, never when they are handed to it, so the
count is the truth; cache hits are counted from JAX's monitoring events (`/jax/compilation_cache/cache_hits`),
listened to only while the warm-up runs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Hashable

import jax

logger = logging.getLogger("jaxpaged.worker.compilation")

HEARTBEAT_SECONDS = 4.0  # the longest a warm-up stays silent: a large model's single compile can take a minute
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileProgress:
    """Counts one warm-up's programs as the pool finishes them and logs the count.

    `submit(pool, lowered, options, shape)` hands a program to the pool (shape: the step shape (T, S, P) it
    belongs to, or None for the other programs); `wait()` blocks until all finish, logging a heartbeat when no
    line came for HEARTBEAT_SECONDS. Used as a context manager, so the cache-hit listener is always removed."""

    def __init__(self, num_shapes: int, workers: int):
        self.num_shapes, self.workers = num_shapes, workers
        self.start = time.perf_counter()
        self._lock = threading.Lock()
        self._compiling = threading.local()  # per pool thread: whether its current compile hit the cache
        self._futures: list[concurrent.futures.Future] = []
        self._pending: dict[Hashable, list[int]] = {}  # step shape -> [its programs not finished, cache misses]
        self._shapes_done = self._programs_done = self._cache_hits = 0
        self._last_line = self.start

    def __enter__(self) -> CompileProgress:
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT_EVENT:  # JAX records it in the thread that compiles
            self._compiling.hit = True

    def submit(self, pool: concurrent.futures.Executor, lowered: jax.stages.Lowered, options: dict | None,
               shape: Hashable | None) -> concurrent.futures.Future:
        """The future of `lowered.compile(compiler_options=options)` on the pool, counted when it finishes."""
        with self._lock:
            if shape is not None:
                self._pending.setdefault(shape, [0, 0])[0] += 1
        future = pool.submit(self._compile, lowered, options, shape)
        self._futures.append(future)
        return future

    def _compile(self, lowered: jax.stages.Lowered, options: dict | None,
                 shape: Hashable | None) -> jax.stages.Compiled:
        self._compiling.hit = False
        program = lowered.compile(compiler_options=options) if options else lowered.compile()
        self._finished(shape, hit=self._compiling.hit)
        return program

    def _finished(self, shape: Hashable | None, hit: bool) -> None:
        with self._lock:
            self._programs_done += 1
            self._cache_hits += hit
            if shape is None:
                return
            counts = self._pending[shape]
            counts[0] -= 1
            counts[1] += not hit
            if counts[0]:
                return
            self._shapes_done += 1
            done, self._last_line = self._shapes_done, time.perf_counter()
            how = "compiled" if counts[1] else "loaded from the cache"
        logger.info("step shape %d/%d %s: (T, S, P) = %s (%.1f s)", done, self.num_shapes, how,
                    ", ".join(map(str, shape[:3])), self._last_line - self.start)

    def wait(self) -> None:
        """Until every program submitted has finished; raises the first failure."""
        pending = set(self._futures)
        while pending:
            quiet = time.perf_counter() - self._last_line  # wake when a heartbeat is due, not HEARTBEAT_SECONDS on
            done, pending = concurrent.futures.wait(pending, timeout=max(HEARTBEAT_SECONDS - quiet, 0.01),
                                                    return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in done:
                future.result()
            now = time.perf_counter()
            with self._lock:
                silent = bool(pending) and now - self._last_line >= HEARTBEAT_SECONDS
                if silent:
                    self._last_line = now
                    line = (self._programs_done, len(self._futures), self._shapes_done, self.num_shapes,
                            now - self.start)
            if silent:
                logger.info("compiling: %d/%d programs done (%d/%d step shapes), %.0f s", *line)

    def summary(self) -> str:
        """'N programs in X s on W threads (H loaded from the persistent cache)'."""
        hits = f", {self._cache_hits} loaded from the persistent cache" if self._cache_hits else ""
        return (f"{len(self._futures)} programs in {time.perf_counter() - self.start:.1f} s on {self.workers} "
                f"thread{'s' if self.workers > 1 else ''}{hits}")

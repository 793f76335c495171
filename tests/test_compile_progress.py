"""CompileProgress: a line per step shape when the pool has finished its programs, in the order they finish,
"loaded from the cache" when every one of them was a persistent-cache hit, a heartbeat while the pool is busy."""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.worker import compile_progress
from jaxpaged.worker.compile_progress import CompileProgress

LINE = re.compile(r"step shape (\d)/(\d) (compiled|loaded from the cache): \(T, S, P\) = (\d+, \d+, \d+)")


@pytest.fixture
def cache_everything():
    """Persist every program, however fast it compiles (the suite's cache keeps only those over 0.5 s)."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def lowered_programs(salt: float, depth: int = 1) -> list[jax.stages.Lowered]:
    """Four programs no earlier run has compiled (salt is in their constants), `depth` dots deep each."""
    def program(scale):
        def f(x):
            for _ in range(depth):
                x = jnp.tanh(x @ x.T * scale + salt)
            return x
        return jax.jit(f).lower(jnp.ones((8, 8), jnp.float32))
    return [program(float(k)) for k in range(4)]


def run_warmup(programs: list[jax.stages.Lowered]) -> str:
    """Two step shapes of two and one programs, and one other program, through a two-thread pool."""
    shapes = [(1, 1, 16), (1, 1, 16), (2, 4, 16), None]
    with concurrent.futures.ThreadPoolExecutor(2) as pool, CompileProgress(2, 2) as progress:
        futures = [progress.submit(pool, lowered, None, shape) for lowered, shape in zip(programs, shapes)]
        progress.wait()
    assert all(isinstance(f.result(), jax.stages.Compiled) for f in futures)
    return progress.summary()


def test_a_line_per_step_shape_as_its_programs_finish_then_from_the_cache(caplog, cache_everything):
    salt = time.time_ns() % 10_000_000 / 7.0
    caplog.set_level(logging.INFO, logger="jaxpaged.worker.compilation")
    summary = run_warmup(lowered_programs(salt))
    lines = [LINE.search(r.getMessage()).groups() for r in caplog.records if LINE.search(r.getMessage())]
    assert [(done, total, how) for done, total, how, _ in lines] == [("1", "2", "compiled"), ("2", "2", "compiled")]
    assert {shape for *_, shape in lines} == {"1, 1, 16", "2, 4, 16"}
    assert summary.startswith("4 programs in ") and summary.endswith("on 2 threads")
    caplog.clear()
    summary = run_warmup(lowered_programs(salt))  # the same programs again: the persistent cache has them
    lines = [LINE.search(r.getMessage()).groups() for r in caplog.records if LINE.search(r.getMessage())]
    assert [how for _, _, how, _ in lines] == ["loaded from the cache"] * 2
    assert summary.endswith("on 2 threads, 4 loaded from the persistent cache")


def test_a_heartbeat_while_the_pool_is_busy(caplog, monkeypatch):
    monkeypatch.setattr(compile_progress, "HEARTBEAT_SECONDS", 0.01)
    caplog.set_level(logging.INFO, logger="jaxpaged.worker.compilation")
    run_warmup(lowered_programs(time.time_ns() % 10_000_000 / 3.0, depth=40))
    beats = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling: ")]
    assert beats and all(re.fullmatch(r"compiling: \d/4 programs done \(\d/2 step shapes\), \d+ s", b) for b in beats)


def test_a_failed_compile_is_raised_and_the_listener_removed():
    from jax._src import monitoring  # the listeners registered now (not in jax.monitoring's public names)

    listeners = len(monitoring.get_event_listeners())
    bad = jax.jit(lambda x: x).lower(jnp.ones(2))
    with pytest.raises(TypeError):
        with concurrent.futures.ThreadPoolExecutor(1) as pool, CompileProgress(1, 1) as progress:
            progress.submit(pool, bad, {"not_an_xla_option": object()}, (1, 1, 16))
            assert len(monitoring.get_event_listeners()) == listeners + 1
            progress.wait()
    assert len(monitoring.get_event_listeners()) == listeners

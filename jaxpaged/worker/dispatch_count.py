"""Dispatch counting: which device programs a step launches, and how many (test and benchmark instrumentation).

`count_dispatches(runner)` wraps the runner's compiled and jitted step programs and every jitted function of
jaxpaged.worker.model_runner and jaxpaged.sample.sampler (the runner calls them through those modules' globals)
for the duration of a `with` block, then restores them. Never used while serving.
"""

from __future__ import annotations

import collections
import contextlib

from jaxpaged.sample import sampler
from jaxpaged.worker import model_runner
from jaxpaged.worker.model_runner import ModelRunner


class _Counted:
    """A device program that counts its calls (count_dispatches); other attributes are the program's."""

    def __init__(self, program, name: str, counts: collections.Counter):
        self._program, self._name, self._counts = program, name, counts

    def __call__(self, *args, **kwargs):
        self._counts[self._name] += 1
        return self._program(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._program, attr)


@contextlib.contextmanager
def count_dispatches(runner: ModelRunner):
    """Count the device programs launched while inside: yields a Counter {program: calls}, the step programs
    as "fused_step" / "paged_forward", the others by function name."""
    counts: collections.Counter = collections.Counter()
    modules = (model_runner, sampler)
    saved = [(m, name, f) for m in modules for name, f in vars(m).items() if hasattr(f, "_cache_size")]
    for module, name, f in saved:
        setattr(module, name, _Counted(f, name, counts))
    attrs = {"_step": runner._step, "_fused_step": runner._fused_step, "_compiled": runner._compiled,
             "_compiled_fused": runner._compiled_fused}
    runner._step = _Counted(runner._step, "paged_forward", counts)
    runner._fused_step = _Counted(runner._fused_step, "fused_step", counts)
    runner._compiled = {k: _Counted(p, "paged_forward", counts) for k, p in runner._compiled.items()}
    runner._compiled_fused = {k: _Counted(p, "fused_step", counts) for k, p in runner._compiled_fused.items()}
    try:
        yield counts
    finally:
        for module, name, f in saved:
            setattr(module, name, f)
        for attr, value in attrs.items():
            setattr(runner, attr, value)

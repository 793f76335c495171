"""LLMEngine's weight updates and sleep/wake (`WeightControl`): the engine's side of jaxpaged/worker/live_weights.py.

Their contract is docs/rl.md's ("Weight updates", "Sleep and wake"). The engine's part: updates and sleep happen
between steps, an update drops the prefix cache (pages still held by running requests are never cached again),
and while asleep `add_request` raises EngineSleepingError (nothing is queued; the server answers 503).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxpaged.models.weights import WeightLoadError, _open, _read, safetensors_files
from jaxpaged.worker.live_weights import WeightUpdateError, hf_slots

logger = logging.getLogger(__name__)


class EngineSleepingError(RuntimeError):
    """The engine is asleep (`LLMEngine.sleep`): it takes no request until `wake_up()`; nothing was queued."""


class WeightControl:
    """LLMEngine's methods for weight updates and sleep/wake: they share its state (see LLMEngine.__init__)."""

    @property
    def sleep_level(self) -> int:
        """0 awake; 1 the KV cache freed; 2 the weights too."""
        return self.runner.sleep_level

    @property
    def is_sleeping(self) -> bool:
        return self.runner.sleep_level > 0

    def check_awake(self) -> None:
        """EngineSleepingError while asleep (add_request calls it before queueing anything)."""
        if self.is_sleeping:
            raise EngineSleepingError(f"the engine is asleep (level {self.sleep_level}): call wake_up() (POST "
                                      "/wake_up) before sending requests")

    def get_weights(self) -> dict[str, Any]:
        """The current weights under their Hugging Face names (host numpy copies in the engine's dtype);
        update_weights(get_weights()) changes nothing."""
        if self.sleep_level == 2:
            raise EngineSleepingError("the weights are asleep (level 2): wake_up() first")
        return self.runner.get_weights()

    def update_weights(self, weights: Mapping[str, Any]) -> float:
        """Replace weights by Hugging Face name (docs/rl.md; WeightUpdateError, nothing changed, for a bad dict);
        EngineSleepingError at sleep level 2. Returns the seconds it took (a step dispatched after it runs on the
        new weights)."""
        start = time.perf_counter()
        if self.sleep_level == 2:
            raise EngineSleepingError("the weights are asleep (level 2): wake_up() before updating them")
        count = self.runner.update_weights(weights)
        self.model = dataclasses.replace(self.model, params=self.runner.params)
        self.scheduler.pool.drop_prefix_cache(list(self.scheduler.running) + list(self.scheduler.waiting))
        seconds = time.perf_counter() - start
        logger.info("updated %d weight tensors in %.3f s; prefix cache dropped", count, seconds)
        return seconds

    def update_weights_from_disk(self, model_path: str | Path) -> float:
        """update_weights with every tensor of a Hugging Face safetensors folder (single file or sharded) of this
        model's architecture and shapes; tensors the engine does not hold (e.g. rotary tables) are skipped.
        WeightLoadError for a folder that is not one, WeightUpdateError as update_weights. Returns seconds."""
        folder = Path(model_path).expanduser()
        if not folder.is_dir():
            raise WeightLoadError(f"model_path={str(model_path)!r}: not a folder of safetensors files")
        files = safetensors_files(folder)
        names = hf_slots(self.model.config)
        missing = sorted(n for n in names if n not in files)
        if missing:
            raise WeightUpdateError(f"{folder}: lacks {len(missing)} of this model's {len(names)} tensors, e.g. "
                                    f"{missing[:3]} (another model?)")
        weights = {}
        for path in sorted({files[n] for n in names}):
            with _open(path) as f:  # WeightLoadError for a file that is missing or not safetensors
                weights.update((n, _read(f, n, path)) for n in names if files[n] == path)
        return self.update_weights(weights)

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool's device memory (level 1; the cached prefixes are forgotten) and, level 2, the
        weights' (kept on the host). Only with no unfinished request (RuntimeError otherwise: finish or abort
        them first); a step still in flight is waited for."""
        if self.has_unfinished_requests() or self.scheduler.has_unfinished_requests():
            raise RuntimeError("sleep() with unfinished requests: wait for them or abort them first")
        if self.is_sleeping:
            raise RuntimeError(f"the engine is already asleep (level {self.sleep_level})")
        if self._in_flight is not None:  # the last step's leftovers (requests that had already finished)
            flight, self._in_flight = self._in_flight, None
            flight.result()
        self.runner.sleep(level)
        if level == 2:
            self.model = dataclasses.replace(self.model, params=None)
        self.scheduler.pool.reset_prefix_cache()
        logger.info("asleep (level %d)", level)

    def wake_up(self) -> None:
        """Back from `sleep`: a fresh KV pool, the weights on their devices; serving goes on (no-op when awake)."""
        if not self.is_sleeping:
            return
        self.runner.wake_up()
        self.model = dataclasses.replace(self.model, params=self.runner.params)
        logger.info("awake")


__all__ = ["EngineSleepingError", "WeightControl", "WeightUpdateError"]

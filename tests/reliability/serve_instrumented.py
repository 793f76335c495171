"""`python -m server`, instrumented for the subprocess tests: run as

    python -m tests.reliability.serve_instrumented REPORT.json STEP_DELAY_S [server args...]

It runs the `server` package as `__main__` (exactly what `python -m server` runs) in this process, after two
test-only changes: every engine step that produced outputs sleeps STEP_DELAY_S more (so a request of N tokens
takes at least N * STEP_DELAY_S: shutdown tests can make one that cannot finish within the grace period), and
at exit REPORT.json gets the top-level modules the server imported (serving must never import torch).
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
import time


def _slow_steps(delay: float) -> None:
    from jaxpaged.engine.llm_engine import LLMEngine

    step = LLMEngine.step

    def slow_step(self):
        outputs = step(self)
        if outputs:
            time.sleep(delay)
        return outputs

    LLMEngine.step = slow_step


def _report(path: str) -> None:
    modules = sorted({name.split(".")[0] for name in list(sys.modules)})
    with open(path, "w") as f:
        json.dump({"modules": modules}, f)


def main() -> None:
    report, delay, *server_args = sys.argv[1:]
    if float(delay) > 0:
        _slow_steps(float(delay))
    atexit.register(_report, report)
    sys.argv = ["server", *server_args]
    runpy.run_module("server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""What importing jaxpaged does to the process: no root logging configured, no torch advice, no heavy extras.

Each check runs in a fresh interpreter (this pytest process has long imported everything).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    # torch hidden, as on a serving machine (it is a test-only dependency)
    code = "import sys; sys.modules['torch'] = None\n" + code
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_importing_jaxpaged_leaves_the_root_logger_alone():
    """A library must not configure logging: the server's (or a user's) basicConfig must still take effect."""
    proc = run_python(
        "import logging\n"
        "import jaxpaged, jaxpaged.engine.async_llm, server.app, server.__main__\n"
        "from jaxpaged import checkpoint\n"
        "with checkpoint._orbax() as ocp:\n"  # Orbax logs through absl, which would call basicConfig
        "    import absl.logging; absl.logging.info('absl speaks')\n"
        "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
        "logging.basicConfig(level='INFO')\n"
        "logging.getLogger('jaxpaged.engine.llm_engine').info('an INFO line reaches stderr')\n")
    assert "an INFO line reaches stderr" in proc.stderr


def test_no_pytorch_advice_from_transformers():
    proc = run_python("import jaxpaged\nfrom jaxpaged.tokenizer import PreTrainedTokenizerFast\n")
    assert "PyTorch was not found" not in proc.stderr, proc.stderr


def test_engine_imports_leave_out_orbax_and_flax():
    """Orbax (~1 s) and Flax (~0.5 s) are imported only when a checkpoint or the NNX module is used."""
    proc = run_python("import jaxpaged, jaxpaged.engine.async_llm, server.app, server.__main__\n"
                      "print(sorted({m.split('.')[0] for m in sys.modules} & {'orbax', 'flax', 'torch'}))\n")
    assert proc.stdout.strip() == "['torch']"  # the hidden placeholder only

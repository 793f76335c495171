"""The code in docs/research.md runs as printed (one namespace, blocks in order)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_research_examples_run():
    text = (DOCS / "research.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOCS / "research.md"), "exec"), namespace)

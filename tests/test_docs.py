"""The documentation as printed: the code in docs/research.md runs (one namespace, blocks in order), and every
link between README.md and docs/ reaches a file and heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
NAMED_DOC = re.compile(r"\bdocs/[\w.-]+\.md\b")  # a doc named in prose or code spans: `docs/kernels.md`


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors: a heading lower-cased, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", without_code_blocks(path.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_research_examples_run():
    text = (DOCS / "research.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOCS / "research.md"), "exec"), namespace)


def broken_links(files: list[Path], root: Path) -> list[str]:
    """Links in `files` whose file (relative to the linking file) or #heading does not exist, and `docs/*.md`
    names (relative to `root`) that do not exist."""
    broken = []
    for source in files:
        text = source.read_text()
        for target in LINK.findall(without_code_blocks(text)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            path = (source.parent / file_part).resolve() if file_part else source
            if not path.exists():
                broken.append(f"{source.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
                broken.append(f"{source.name}: {target} (no such heading)")
        for named in NAMED_DOC.findall(text):
            if not (root / named).exists():
                broken.append(f"{source.name}: {named} (no such file)")
    return sorted(set(broken))


def test_links_between_docs_resolve():
    assert broken_links(markdown_files(), ROOT) == []


def test_the_link_check_finds_missing_files_and_headings(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("# How to reproduce\n")
    page = tmp_path / "README.md"
    page.write_text("# Title\n\n[ok](docs/here.md#how-to-reproduce) [self](#title) [web](https://x.org/a.md)\n"
                    "[gone](docs/gone.md) [nowhere](docs/here.md#other) `docs/old.md`\n"
                    "```\n[in code](not/checked.md)\n```\n")
    assert broken_links([page], tmp_path) == [
        "README.md: docs/gone.md (no such file)", "README.md: docs/here.md#other (no such heading)",
        "README.md: docs/old.md (no such file)"]

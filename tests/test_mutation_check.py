"""scripts/mutation_check.py: every anchor still matches exactly once (fast: a refactor that moves a guarded
line must move its mutation too), and, slow, the full run: every guard-removed mutation is killed."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, load_script


def _harness():
    return load_script("scripts/mutation_check.py")


def test_every_anchor_matches_exactly_once():
    harness = _harness()
    assert harness.check_anchors() == []


def test_every_security_row_has_a_mutation():
    """Each guard row of docs/security.md's table is the `guard` of at least one mutation."""
    harness = _harness()
    text = (ROOT / "docs" / "security.md").read_text()
    table = text.split("## Guards", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| guard") and not line.startswith("|---")]
    guards = " / ".join(m.guard for m in harness.MUTATIONS)
    missing = [row for row in rows if row not in guards]
    assert rows and not missing, missing


def test_known_survivors_are_mutations():
    harness = _harness()
    assert set(harness.KNOWN_SURVIVORS) <= {m.name for m in harness.MUTATIONS}


def test_an_anchor_that_moved_is_reported_not_skipped(tmp_path):
    harness = _harness()
    (tmp_path / "guard.py").write_text("def f(x):\n    if x < 0:\n        raise ValueError(x)\n")
    moved = harness.Mutation("m", "g", "guard.py", "if x <= 0:", "if False:", ())
    twice = harness.Mutation("t", "g", "guard.py", "x", "y", ())
    problems = harness.check_anchors(tmp_path, (moved, twice))
    assert any("anchor not found" in p for p in problems) and any("found" in p and "times" in p for p in problems)


@pytest.mark.slow
def test_every_guard_removed_mutation_is_killed(tmp_path):
    """The full run (about half an hour on 2 busy cores): runs the named tests once unmutated, then once per
    mutation in a scratch copy."""
    harness = _harness()
    rows = harness.run(harness.MUTATIONS, timeout=600, baseline=True, log=print)
    survived = {r["mutation"].name for r in rows if not r["result"].startswith("killed")}
    assert survived == set(harness.KNOWN_SURVIVORS), harness.markdown(rows)

"""benchmarks/load_time.py (`micro.py load`) end to end on a tiny GGUF: both checkouts timed, medians and ratio
printed."""

from __future__ import annotations

import re

from tests.conftest import ROOT, load_script, make_tiny_gguf

load_time = load_script("benchmarks/load_time.py")


def test_two_checkouts_side_by_side(tmp_path, tiny_checkpoints, capsys):
    path = make_tiny_gguf(tiny_checkpoints["gqa4"], tmp_path / "tiny.gguf", "Q8_0")
    assert load_time.main(["--tree", str(ROOT), "--tree", str(ROOT), "--model", str(path), "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^round 1 .*: open_gguf [\d.]+ s, load_model [\d.]+ s$", out, flags=re.MULTILINE)) == 2
    for key in ("open_gguf", "load_model"):
        line = rf"^{key}, median \(range\) of 1: .*; the first / each other: [\d.]+x$"
        assert re.search(line, out, flags=re.MULTILINE)

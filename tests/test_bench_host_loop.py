"""benchmarks/micro.py host-loop and load end to end at smoke sizes: both sides measured, the side-by-side lines
printed."""

from __future__ import annotations

import re

from tests.conftest import ROOT, load_script, make_tiny_gguf

micro = load_script("benchmarks/micro.py")


def test_side_by_side_run_prints_both_trees_and_the_ratio(capsys):
    assert micro.main(["host-loop", "--batches", "4", "--prompt-len", "8", "--output-len", "12", "--repeats", "1",
                                 "--tree", str(ROOT), "--rounds", "1", "--phases"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(this|other)\s+b=4\s+step\s+([\d.]+) ms.*host\s+([\d.]+) ms.*\[(\d+) steady steps\]", out,
                      flags=re.M)
    assert sorted(side for side, *_ in rows) == ["other", "this"]
    assert all(float(host) > 0 and int(steps) > 0 for _, _, host, steps in rows)
    assert "scheduler.schedule" in out  # this tree's phases
    assert re.search(r"^b=4\s+host this\s+[\d.]+ ms, other\s+[\d.]+ ms: [\d.]+x", out, flags=re.M)


def test_emulated_timeline_reports_the_devices_idle_share(capsys):
    """--emulate-step-ms: each step program takes the emulated 20 ms (the steady step's wall time is at least that)
    and the row reports the share of the run that emulated device sat idle."""
    assert micro.main(["host-loop", "--batches", "4", "--prompt-len", "8", "--output-len", "12", "--repeats", "1",
                       "--emulate-step-ms", "20"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^this\s+b=4\s+step\s+([\d.]+) ms.*host not hidden ([\d.]+)% of the run", out, flags=re.M)
    assert row, out
    step, idle = map(float, row.groups())
    assert step > 19.0 and 0.0 <= idle < 100.0


def test_load_times_two_checkouts_side_by_side(tmp_path, tiny_checkpoints, capsys):
    path = make_tiny_gguf(tiny_checkpoints["gqa4"], tmp_path / "tiny.gguf", "Q8_0")
    assert micro.main(["load", "--tree", str(ROOT), "--tree", str(ROOT), "--model", str(path), "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^round 1 .*: open_gguf [\d.]+ s, load_model [\d.]+ s$", out, flags=re.MULTILINE)) == 2
    for key in ("open_gguf", "load_model"):
        line = rf"^{key}, median \(range\) of 1: .*; the first / each other: [\d.]+x$"
        assert re.search(line, out, flags=re.MULTILINE)

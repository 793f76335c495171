"""benchmarks/gpu_engine.py off the GPU: issue 17's speculation rows on an emulated device timeline (its smoke run on
the GPU check's own shapes is scripts/check_gpu_image_cpu.sh's)."""

from __future__ import annotations

import json

from tests.conftest import load_script

gpu_engine = load_script("benchmarks/gpu_engine.py")


def test_speculation_rows_on_an_emulated_timeline(tmp_path):
    """Each step program takes the emulated 4.4 ms, so the plain engine decodes at most 1000 / 4.4 tok/s whatever
    the CPU; speculation emits the plain tokens, and on the copying workloads the drafts are accepted."""
    out = tmp_path / "rows.jsonl"
    assert gpu_engine.main(["--smoke", "--spec-only", "--emulate-step-ms", "4.4", "--emulate-row-ms", "0.02",
                            "--prompt-len", "32", "--output-len", "32", "--spec-rounds", "1",
                            "--spec-temperature", "0", "--json", str(out)]) == 0
    rows = {r["workload"]: r for r in map(json.loads, out.read_text().splitlines()) if r["name"] == "spec decode"}
    assert set(rows) == {"grounded", "grounded-exact", "open"}
    assert all(r["same"] and r["off_tok_s"] <= 1000 / 4.4 * 1.01 for r in rows.values())
    assert rows["grounded-exact"]["accepted_tokens"] == rows["grounded-exact"]["draft_tokens"] > 0
    assert rows["grounded"]["accepted_tokens"] > 0


def test_emulation_is_refused_outside_the_smoke_spec_rows(capsys):
    try:
        gpu_engine.main(["--smoke", "--emulate-step-ms", "4.4"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("--emulate-step-ms without --spec-only was accepted")
    assert "--emulate-step-ms runs issue 17's rows on the tiny model" in capsys.readouterr().err

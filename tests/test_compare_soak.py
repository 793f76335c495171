"""benchmarks/serve.py soak --before-tree (benchmarks/soak.py): the rounds' order, the ratios and the table (the servers themselves: by hand)."""

from __future__ import annotations

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def compare_soak():
    return load_script("benchmarks/soak.py")


def report(tok_s: float, p50: float, errors: dict | None = None) -> dict:
    return {"requests_ok": 100, "errors": errors or {}, "output_tokens_per_s": tok_s,
            "latency_s": {"p50": p50, "p90": p50 * 1.4, "p99": p50 * 1.6}, "ttft_s": {"p50": p50 / 2},
            "rss_growth_mib": None}


def test_rounds_alternate_which_side_runs_first(compare_soak):
    assert [compare_soak.round_order(i) for i in range(4)] == [
        ("before", "this"), ("this", "before"), ("before", "this"), ("this", "before")]


def test_ratios_per_round_and_their_median(compare_soak):
    Run = compare_soak.SoakRun
    runs = [Run(0, "before", report(50.0, 70.0)), Run(0, "this", report(300.0, 14.0)),
            Run(1, "this", report(360.0, 12.5)), Run(1, "before", report(60.0, 75.0)),
            Run(2, "before", None, "failed: not ready"), Run(2, "this", report(330.0, 13.0))]
    ratios = compare_soak.round_ratios(runs)
    assert ratios[0] == {"p50_before_over_this": 5.0, "tok_s_this_over_before": 6.0}
    assert ratios[1] == {"p50_before_over_this": 6.0, "tok_s_this_over_before": 6.0}
    assert ratios[2] == {"p50_before_over_this": None, "tok_s_this_over_before": None}
    table = compare_soak.format_table(runs, {"before": "before (x)", "this": "this checkout"})
    assert "| 1 | before (x) | 100 | 0 | 50.0 | 70.00 | 98.00 | 112.00 | 35.00 | n/a |" in table
    assert "| 3 | before (x) | failed: not ready |" in table
    assert "round 1: p50 latency before / this 5.00x, output tok/s this / before 6.00x" in table
    assert "round 3: p50 latency before / this n/a, output tok/s this / before n/a" in table
    assert table.endswith("median over 2 round(s): p50 latency before / this 5.50x")


def test_errors_are_counted_in_the_table(compare_soak):
    runs = [compare_soak.SoakRun(0, "this", report(300.0, 14.0, {"http_500": 2, "ReadTimeout": 1}))]
    assert "| 1 | this checkout | 100 | 3 | 300.0 |" in compare_soak.format_table(runs, {"this": "this checkout"})


def test_bad_arguments_are_refused_before_any_server_starts(compare_soak, tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare_soak.trees_parse_args(["--before-tree", str(tmp_path)])
    assert "not a jaxpaged checkout" in capsys.readouterr().err
    (tmp_path / "server").mkdir()
    with pytest.raises(SystemExit):
        compare_soak.trees_parse_args(["--before-tree", str(tmp_path), "--rounds", "0"])
    assert "--rounds=0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_soak.main(["--before-tree", str(tmp_path), "--concurrency", "0"])
    assert "--concurrency=0" in capsys.readouterr().err

"""benchmarks/latency.py: its workloads and arguments (the engines themselves: docs/performance.md)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/latency.py")


def test_built_in_workloads(bench):
    args = bench.parse_args([])
    assert args.workloads == "grounded,open"
    assert {name: len(prompts) for name, prompts in args.prompts.items()} == \
        {"grounded": 6, "open": 6, "grounded-more": 20, "grounded-long": 6, "extract-json": 6}
    assert len(set(bench.GROUNDED + bench.GROUNDED_MORE + bench.GROUNDED_LONG)) == 32  # no prompt counted twice


def test_extract_json_requests_carry_their_schema(bench):
    """Each extract-json prompt's requests are constrained to its own schema (a valid one) on every side."""
    jsonschema = pytest.importorskip("jsonschema")
    args = bench.parse_args(["--workloads", "extract-json"])
    schemas = bench.SCHEMAS["extract-json"]
    assert len(schemas) == len(args.prompts["extract-json"]) and len({json.dumps(s) for s in schemas}) == 6
    for i, schema in enumerate(schemas):
        jsonschema.Draft202012Validator.check_schema(schema)
        params = bench.sampling(args, i, schema=schema)
        assert params.structured_outputs.json == schema and params.temperature == 0
    assert bench.sampling(args, 0).structured_outputs is None


def test_a_prompts_file_is_a_workload_named_by_its_stem(bench, tmp_path):
    path = tmp_path / "my_edits.json"
    path.write_text(json.dumps(["Fix: teh cat", "Copy: a b c"]))
    args = bench.parse_args(["--prompts-file", str(path), "--workloads", "my_edits,grounded"])
    assert args.prompts["my_edits"] == ["Fix: teh cat", "Copy: a b c"]
    assert args.prompts["grounded"] is bench.GROUNDED


@pytest.mark.parametrize("content, message", [
    (None, "No such file"),
    ("not json", "Expecting value"),
    ('{"a": "b"}', "a JSON list of non-empty prompt strings"),
    ("[]", "a JSON list of non-empty prompt strings"),
    ('["ok", 3]', "a JSON list of non-empty prompt strings"),
    ('["ok", ""]', "a JSON list of non-empty prompt strings"),
])
def test_bad_prompts_files_are_refused(bench, tmp_path, capsys, content, message):
    path = tmp_path / "w.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--prompts-file", str(path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_prompts_file_may_not_shadow_a_built_in_workload(bench, tmp_path, capsys):
    path = tmp_path / "grounded.json"
    path.write_text(json.dumps(["Fix: teh cat"]))
    with pytest.raises(SystemExit):
        bench.parse_args(["--prompts-file", str(path)])
    assert "'grounded' names a built-in workload" in capsys.readouterr().err


def test_unknown_workloads_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "grounded,nope"])
    assert "unknown workloads ['nope']" in capsys.readouterr().err


def test_mixed_batch_arguments(bench, capsys):
    args = bench.parse_args(["--workloads", "", "--mixed-batch", "8", "--disable-by-batch-size", "4"])
    assert (args.workload_names, args.mixed_batch) == ([], 8)
    assert args.speculative_config.disable_by_batch_size == 4
    assert bench.parse_args([]).speculative_config.disable_by_batch_size is None
    for argv, message in ((["--mixed-batch", "1"], "at least 2 requests"),
                          (["--workloads", ""], "nothing to run"),
                          (["--disable-by-batch-size", "1"], "disable_by_batch_size=1")):
        with pytest.raises(SystemExit) as exit_info:
            bench.parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_draft_length_sides(bench):
    default = bench.parse_args([])
    assert default.spec_sides == ("adaptive",) and default.speculative_config.adaptive_draft_length
    both = bench.parse_args(["--draft-length", "both", "--num-speculative-tokens", "3"])
    assert both.spec_sides == ("adaptive", "fixed")
    assert [c.adaptive_draft_length for c in both.speculative_configs.values()] == [True, False]
    assert {c.num_speculative_tokens for c in both.speculative_configs.values()} == {3}
    fixed = bench.parse_args(["--draft-length", "fixed"])
    assert fixed.spec_sides == ("fixed",) and not fixed.speculative_config.adaptive_draft_length
    assert [side for side, _ in bench.turns({"plain": 0, "adaptive": 1, "fixed": 2}, 4)] == \
        ["adaptive", "fixed", "plain"]  # run 4 of 3 sides starts with the second


def test_sampled_runs_seed_each_prompt_alike_on_every_side(bench, capsys):
    greedy = bench.parse_args([])
    assert bench.sampling(greedy, 3).temperature == 0.0 and bench.sampling(greedy, 3).seed is None
    assert bench.sampling_label(greedy) == "greedy"
    sampled = bench.parse_args(["--temperature", "0.7", "--seed", "10", "--max-tokens", "32"])
    params = bench.sampling(sampled, 3)
    assert (params.temperature, params.seed, params.max_tokens) == (0.7, 13, 32)
    assert bench.sampling(sampled, 3, "DELTA", max_tokens=8).max_tokens == 8
    assert bench.sampling_label(sampled) == "temperature 0.7 (seeds 10 + i)"
    for argv in (["--temperature", "-1"], ["--seed", "-2"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.parse_args(argv)
        assert exit_info.value.code == 2 and "both must be >= 0" in capsys.readouterr().err


def test_no_benchmark_shadows_an_installed_module():
    """python benchmarks/X.py puts benchmarks/ first on sys.path (and load_script does the same): a file there
    named like an installed package (benchmarks/kernels.py once hid HF's `kernels`, which transformers imports)
    would replace that package for everything the benchmark imports."""
    import importlib.util
    import sys

    from tests.conftest import ROOT
    folder = str(ROOT / "benchmarks")
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in (folder, "", ".")]
    try:
        for path in sorted((ROOT / "benchmarks").glob("*.py")):
            cached = sys.modules.pop(path.stem, None)
            try:
                spec = importlib.util.find_spec(path.stem)
            finally:
                if cached is not None:
                    sys.modules[path.stem] = cached
            assert spec is None, f"benchmarks/{path.name} shadows {spec.origin}"
    finally:
        sys.path[:] = saved

"""benchmarks/micro.py roofline (bandwidth probe, weight bytes) and serve.py peers' --roofline footer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.conftest import load_script




@pytest.fixture(scope="module")
def roofline():
    return load_script("benchmarks/micro.py")


def test_weight_bytes_count_every_smollm2_param_once(roofline, smollm2_path):
    """SmolLM2-135M has 134,515,008 params (its tied embedding once): 4 bytes each in float32, 2 in bfloat16."""
    assert roofline.weight_bytes(str(smollm2_path), "float32") == 4 * 134_515_008
    assert roofline.weight_bytes(str(smollm2_path), "bfloat16") == 2 * 134_515_008


def test_read_bandwidth_probes(roofline):
    bw = roofline.read_bandwidth(probe_mib=8, rounds=2, threads=2)
    assert set(bw) == {"numpy sum, 1 thread", "numpy sum, 2 threads", "numpy matvec", "jax matvec", "jax sum",
                       "best"}
    assert all(v > 0 for v in bw.values()) and bw["best"] == max(v for k, v in bw.items() if k != "best")


def test_compare_servers_prints_the_batch1_share_of_the_roofline():
    compare = load_script("benchmarks/serve.py")
    roof = {"bandwidth": {"numpy sum, 1 thread": 8e9, "best": 10e9}, "weight_bytes": 500_000_000, "dtype": "float32",
            "tok_s": 20.0, "loadavg": [1.0, 1.0, 1.0]}
    run = {"max_concurrency": 1, "sampling": "greedy", "median_tpot_ms": 62.5, "completed": 4, "failed": 0,
           "output_throughput": 15.0, "peak_output_throughput": 16.0, "median_ttft_ms": 100.0,
           "mean_output_tokens_per_request": 128.0, "output_token_mismatches": 0}
    busy = dict(run, max_concurrency=32, median_tpot_ms=10.0)
    results = [compare.PeerResult("jaxpaged", runs=[run, busy]), compare.PeerResult("llamacpp", status="failed: x")]
    table = compare.format_table(results, roof)
    assert "500 MB of float32 weights per token at 10.0 GB/s" in table and "**20.0 tok/s**" in table
    assert "| jaxpaged | greedy | 16.0 | 80% |" in table  # 1000 / 62.5 ms = 16 tok/s = 80% of 20
    assert table.count("% |") == 1  # concurrency 32 and the failed peer have no roofline row
    assert "roofline" not in compare.format_table(results)


def test_compare_servers_ratios_divide_by_the_chosen_peer():
    """--ratio-base names the peer whose figures the ratio columns divide (jaxpaged-int8 against llama-server's
    Q8_0); jaxpaged-int8 serves the same model with --quantization int8 appended to the jaxpaged flags."""
    compare = load_script("benchmarks/serve.py")
    run = {"max_concurrency": 1, "sampling": "greedy", "median_tpot_ms": 10.0, "completed": 4, "failed": 0,
           "output_throughput": 90.0, "peak_output_throughput": 100.0, "median_ttft_ms": 200.0,
           "mean_output_tokens_per_request": 128.0, "output_token_mismatches": 0}
    results = [compare.PeerResult("jaxpaged", runs=[dict(run, output_throughput=40.0)]),
               compare.PeerResult("jaxpaged-int8", runs=[run]),
               compare.PeerResult("llamacpp", runs=[dict(run, output_throughput=60.0, median_tpot_ms=20.0)])]
    table = compare.format_table(results, base="jaxpaged-int8")
    assert "jaxpaged-int8/peer tok/s" in table
    assert "| 2.25x | 1.00x | 1.00x |" in table  # jaxpaged's row: 90 / 40
    assert "| 1.50x | 1.00x | 0.50x |" in table  # llamacpp's row: 90 / 60, TPOT 10 / 20
    args = compare.peers_parse_args(["--peers", "jaxpaged-int8", "--ratio-base", "jaxpaged-int8"])
    spec = compare.servers.jaxpaged_int8_spec(args, 18000)
    assert spec.name == "jaxpaged-int8" and spec.command[-2:] == ["--quantization", "int8"]
    spec = compare.servers.SPEC_BUILDERS["jaxpaged-w8a8"](args, 18000)
    assert spec.name == "jaxpaged-w8a8" and spec.command[-2:] == ["--quantization", "w8a8"]


def test_compare_servers_sends_every_sampling_cut_so_no_server_default_applies():
    fields = load_script("benchmarks/serve.py").sampling_fields
    assert fields("greedy") == {"temperature": 0.0}
    # llama-server would add top_k 40 and min_p 0.05, transformers top_k 50: every cut is named
    assert fields("t0.8-p0.95") == {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "min_p": 0.0}
    assert fields("t0.7-k40-m0.05") == {"temperature": 0.7, "top_p": 1.0, "top_k": 40, "min_p": 0.05}
    for bad in ("p0.9", "t0.8-x3", "t0.8--p0.9"):
        with pytest.raises(ValueError):
            fields(bad)


def test_compare_servers_leaves_unset_cuts_out_for_transformers():
    compare = load_script("benchmarks/serve.py")
    spec = compare.servers.ServerSpec("transformers", [], 1, "m", ignore_eos=False, cut_fields=False)
    args = compare.peers_parse_args(["--peers", "transformers"])
    argv = compare.bench_argv(args, spec, Path("out.json"), compare.sampling_fields("t0.8-p0.95"))
    body = json.loads(argv[argv.index("--extra-body") + 1])
    assert body == {"top_p": 0.95} and argv[argv.index("--temperature") + 1] == "0.8"
    argv = compare.bench_argv(args, dataclasses.replace(spec, cut_fields=True), Path("out.json"),
                              compare.sampling_fields("t0.8-p0.95"))
    assert json.loads(argv[argv.index("--extra-body") + 1]) == {"top_p": 0.95, "top_k": 0, "min_p": 0.0}


def test_compare_servers_draws_fresh_prompts_for_each_run():
    """Every (sampling, concurrency) run on a server gets its own dataset seed, so none times prompts the run
    before left in the server's prefix cache; every server runs the same list."""
    compare = load_script("benchmarks/serve.py")
    args = compare.peers_parse_args(["--concurrency", "1,32", "--sampling", "greedy,t0.8-p0.95", "--seed", "5"])
    runs = compare.bench_runs(args)
    assert [(setting, c, seed) for setting, _, c, seed in runs] == [
        ("greedy", "1", 5), ("greedy", "32", 6), ("t0.8-p0.95", "1", 7), ("t0.8-p0.95", "32", 8)]
    spec = compare.servers.ServerSpec("jaxpaged", [], 1, "m", ignore_eos=True, cut_fields=True)
    argv = compare.bench_argv(args, spec, Path("out.json"), runs[3][1], runs[3][2], runs[3][3])
    assert argv[argv.index("--seed") + 1] == "8" and argv[argv.index("--max-concurrency") + 1] == "32"


def test_compare_servers_runs_a_prompts_workload_once(capsys, tmp_path, monkeypatch):
    """--dataset prompts passes its path on; it is one list for every run, so a second run (which would time
    the first one's prompts from the prefix cache) is refused, as is a missing path."""
    compare = load_script("benchmarks/serve.py")
    args = compare.peers_parse_args(["--dataset", "prompts", "--dataset-path", "grounded-more", "--num-prompts", "20",
                               "--concurrency", "1", "--sampling", "greedy"])
    spec = compare.servers.ServerSpec("jaxpaged", [], 1, "m", ignore_eos=True, cut_fields=True)
    argv = compare.bench_argv(args, spec, Path("out.json"))
    assert argv[argv.index("--dataset") + 1] == "prompts" and argv[argv.index("--dataset-path") + 1] == "grounded-more"
    (tmp_path / "mine.json").write_text('["a prompt"]')
    monkeypatch.chdir(tmp_path)  # a file named from elsewhere than the repository's root, where the benchmark runs
    args = compare.peers_parse_args(["--dataset", "prompts", "--dataset-path", "mine.json", "--concurrency", "1",
                               "--sampling", "greedy"])
    assert args.dataset_path == str((tmp_path / "mine.json").resolve())
    for bad, message in ((["--dataset-path", "open", "--concurrency", "1,4", "--sampling", "greedy"], "one --sampling"),
                         (["--dataset-path", "open", "--concurrency", "1"], "one --sampling"),
                         (["--concurrency", "1", "--sampling", "greedy"], "needs --dataset-path")):
        with pytest.raises(SystemExit):
            compare.peers_parse_args(["--dataset", "prompts", *bad])
        assert message in capsys.readouterr().err

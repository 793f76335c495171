"""`python -m server --help` runs and documents vLLM's flags; argument parsing builds the configs."""

from __future__ import annotations

import gc
import subprocess
import sys

from server.__main__ import build_parser, engine_args, freeze_startup_objects, server_config

FLAGS = ["--model", "--served-model-name", "--tokenizer", "--revision", "--dtype", "--max-model-len",
         "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-memory",
         "--num-pages", "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching",
         "--tensor-parallel-size", "--api-key", "--host", "--port", "--seed", "--chat-template",
         "--generation-config", "--attention-backend", "--kv-cache-dtype", "--log-level", "--max-request-bytes",
         "--enable-auto-tool-choice", "--tool-call-parser", "--weight-layout", "--fuse-projections",
         "--no-fuse-projections", "--command-buffers", "--quantization", "--reasoning-parser"]


def test_help_lists_the_flags():
    out = subprocess.run([sys.executable, "-m", "server", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in FLAGS:
        assert flag in out.stdout, flag


def test_parse_to_configs(tmp_path, monkeypatch):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    monkeypatch.setenv("JAXPAGED_API_KEY", "from-env")
    ns = build_parser().parse_args(["--model", "org/m", "--served-model-name", "a", "b", "--max-model-len", "64",
                                    "--no-enable-prefix-caching", "--chat-template", str(template),
                                    "--kv-cache-dtype", "float16", "--weight-layout", "per_layer",
                                    "--no-fuse-projections", "--command-buffers", "off", "-q", "int8"])
    args, config = engine_args(ns), server_config(ns)
    assert args.model == "org/m" and args.max_model_len == 64 and args.enable_prefix_caching is False
    assert args.kv_cache_dtype == "float16" and args.quantization == "int8"
    assert (args.weight_layout, args.fuse_projections, args.command_buffers) == ("per_layer", False, "off")
    assert args.chat_template == "{{ messages[0]['content'] }}"
    assert config.served_model_names == ("a", "b", "org/m") and config.api_key == "from-env"
    ns = build_parser().parse_args(["--api-key", "flag"])
    assert server_config(ns).api_key == "flag" and ns.host == "0.0.0.0" and ns.port == 8000
    assert engine_args(ns).quantization is None


def test_tool_calling_flags():
    ns = build_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    config = server_config(ns)
    assert config.enable_auto_tool_choice and config.tool_call_parser == "llama3_json" and config.auto_tool_choice
    assert not server_config(build_parser().parse_args([])).auto_tool_choice
    from server.__main__ import main
    assert main(["--enable-auto-tool-choice"]) == 2  # no parser: refused before anything loads
    for parser in ("hermes", "mistral", "llama3_json", "pythonic", "qwen3_coder", "auto"):
        assert server_config(build_parser().parse_args(["--tool-call-parser", parser])).tool_call_parser == parser
    ns = build_parser().parse_args(["--reasoning-parser", "deepseek_r1"])
    assert server_config(ns).reasoning_parser == "deepseek_r1"


def test_unknown_parser_names_are_refused_naming_the_flag():
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        out = subprocess.run([sys.executable, "-m", "server", flag, "nope"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and flag in out.stderr and "invalid choice" in out.stderr




def test_the_defaults_restated_for_help_are_the_engines():
    """`--help` imports no JAX, so the parser restates some engine defaults: they must be the engine's own."""
    import server.__main__ as cli
    from jaxpaged.engine.async_llm import DEFAULT_MAX_WAITING_REQUESTS, AsyncLLMConfig
    from jaxpaged.config import CPU_ASYNC_MAX_TOKENS, EngineArgs
    from jaxpaged.worker.runner_config import QUANTIZATIONS
    from jaxpaged.models.loader import DEFAULT_MODEL

    assert (cli.DEFAULT_MODEL, cli.DEFAULT_MAX_WAITING_REQUESTS, cli.CPU_ASYNC_MAX_TOKENS, cli.QUANTIZATIONS) == (
        DEFAULT_MODEL, DEFAULT_MAX_WAITING_REQUESTS, CPU_ASYNC_MAX_TOKENS, QUANTIZATIONS)
    ns = build_parser().parse_args([])
    assert engine_args(ns) == EngineArgs()  # no flag given: exactly the engine's defaults
    from jaxpaged.worker.runner_config import KV_CACHE_DTYPES
    assert cli.KV_CACHE_DTYPES == tuple(KV_CACHE_DTYPES)
    assert engine_args(build_parser().parse_args(["--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8"
    assert AsyncLLMConfig(max_waiting_requests=ns.max_waiting_requests) == AsyncLLMConfig()


def test_start_up_objects_are_frozen_out_of_the_collector():
    kept = [[i] for i in range(1000)]  # alive at start-up, as the engine's objects are
    try:
        assert freeze_startup_objects() >= len(kept)
        alive = {id(x) for x in gc.get_objects()}  # the generations a collection walks
        assert not any(id(x) in alive for x in kept)
        made_later = [0]
        assert id(made_later) in {id(x) for x in gc.get_objects()}
    finally:
        gc.unfreeze()

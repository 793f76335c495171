"""`python -m server`: jaxpaged's OpenAI-compatible server, with vLLM's flag names.

    python -m server --model smollm2-135m-instruct --port 8000

Start-up order: parse the flags (no JAX imported, so `--help` and a bad flag answer at once), bind the
port (a busy one fails before the model loads), load the engine, then listen. A failure a user can fix
(a bad flag, a busy port, an unknown model, missing weights, a bad setting) ends with one `error: ...`
line on stderr and a non-zero exit; `--log-level debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
from pathlib import Path

from server.config import DEFAULT_MAX_REQUEST_BYTES, REASONING_PARSERS, TOOL_CALL_PARSERS, ServerConfig
from server.data_parallel import add_data_parallel_flags

API_KEY_ENV = "JAXPAGED_API_KEY"
USAGE_ERROR, STARTUP_ERROR = 2, 1  # exit statuses: a bad command line; a start-up that failed
# Engine defaults the help states, restated here because importing the engine imports JAX (seconds); the
# tests check each against the engine's own value (tests/server/test_cli.py; the CPU cap, as the engine
# applies it, in tests/server/test_startup.py).
DEFAULT_MODEL = "smollm2-135m-instruct"  # jaxpaged.models.loader.DEFAULT_MODEL
DEFAULT_MAX_WAITING_REQUESTS = 1024  # jaxpaged.engine.async_llm.DEFAULT_MAX_WAITING_REQUESTS
CPU_ASYNC_MAX_TOKENS = 8  # jaxpaged.config.CPU_ASYNC_MAX_TOKENS
CPU_MAX_MODEL_LEN = 2048  # the engine's cap on max_model_len on CPU when none is given
QUANTIZATIONS = ("fp8", "int8", "w8a8")  # jaxpaged.worker.runner_config.QUANTIZATIONS
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3")  # runner_config.KV_CACHE_DTYPES


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (argparse's default adds the whole usage)."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"error: {message} (see python -m server --help)\n")


class _DefaultsOnceFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already says its default (each once)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        stated = re.search(r"\bdefault\b", text) is not None
        if stated or action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m server", description=(
        "jaxpaged's OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
        "/tokenize, /detokenize, /health, /version, /metrics). Flags follow vLLM's `vllm serve`."),
        formatter_class=_DefaultsOnceFormatter)
    _add_model_flags(p.add_argument_group("model"))
    engine = p.add_argument_group("engine")
    for add_flags in (_add_engine_flags, _add_step_flags, _add_scheduling_flags):
        add_flags(engine)
    _add_multihost_flags(p.add_argument_group("multi-host (jax.distributed; see docs/distributed.md)"))
    add_data_parallel_flags(p.add_argument_group("data parallel (replicas behind a router; see docs/distributed.md)"))
    _add_tool_flags(p.add_argument_group("tool calling"))
    _add_server_flags(p.add_argument_group("server"))
    return p


def _add_model_flags(m: argparse._ArgumentGroup) -> None:
    m.add_argument("--model", default=DEFAULT_MODEL, help="built-in short name, .gguf file, local Hugging Face "
                   "folder or HF repo id (org/name)")
    m.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients pass as `model`; the "
                   "first is reported (default: the --model value, which is always accepted too)")
    m.add_argument("--tokenizer", default=None, help="tokenizer folder or repo id (default: the model's)")
    m.add_argument("--revision", default=None, help="HF repo revision (branch, tag or commit)")
    m.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    m.add_argument("--chat-template", default=None, help="chat template: a file path or the Jinja text itself "
                   "(default: the tokenizer's)")
    m.add_argument("--generation-config", default=None, help="path to a generation_config.json (stop ids and "
                   "sampling defaults; default: the model's)")


def _add_engine_flags(e: argparse._ArgumentGroup) -> None:
    """Sizes: context, batch, KV cache, devices."""
    e.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output) "
                   f"(default: the model's; on CPU at most {CPU_MAX_MODEL_LEN}, which keeps the warm-up short: "
                   "give --max-model-len N for more, up to the model's)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one batch "
                   "(default: 256 on GPU, 64 on CPU)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="most tokens in one step "
                   "(default: 8192 on GPU, 512 on CPU)")
    e.add_argument("--max-num-partial-prefills", type=int, default=None, help="most requests fed a prefill "
                   "chunk in one step (default: 16 on GPU, 4 on CPU)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of accelerator memory "
                   "the server may use (weights + KV cache)")
    e.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (overrides "
                   "--gpu-memory-utilization)")
    e.add_argument("--num-pages", type=int, default=None, help="KV cache size in pages (overrides both above)")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV cache page")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV pages of identical prompt prefixes between requests")
    e.add_argument("--tensor-parallel-size", type=int, default=1, help="devices to shard the model over "
                   "(tensor parallelism; the engine checks what it supports)")


def _add_step_flags(e: argparse._ArgumentGroup) -> None:
    """How a step computes: attention, dtypes, quantisation, weight layout, its programs."""
    e.add_argument("--attention-backend", default="auto", help="auto (pallas on GPU; on CPU cpu, or xla "
                   "where no C++ compiler builds the native CPU kernels), pallas, cpu, xla or reference")
    e.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache dtype; auto: the model's, but float32 for a bfloat16 model on CPU "
                   "(XLA:CPU would convert the whole cache around every write); fp8 / fp8_e4m3: e4m3 pages with "
                   "a scale per layer and KV head (the checkpoint's, else calibrated at start-up), twice bf16's tokens")
    e.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATIONS),
                   help="fp8: the weight dots' weights as float8_e4m3fn with a float32 scale per output channel "
                   "(FP8 gemms with per-token activation scales on a GPU with FP8 tensor cores, weight-only "
                   "elsewhere; an FP8 checkpoint is served so without the flag). int8 / w8a8 (CPU: float32 weights on "
                   "one device, the native matmul): int8 weights with a float32 scale per output column and 32 "
                   "rows (as llama.cpp's Q8_0); int8 computes in float32 (weight-only); w8a8 quantises each "
                   "dot's input too, per row and 32 values (~1.7-2x faster prefill and batched decode on "
                   "AVX-512 VNNI CPUs, at some quality). docs/quantization.md; default: the weights as loaded")
    e.add_argument("--weight-layout", default="auto", choices=["auto", "stacked", "per_layer"],
                   help="how the step holds the layer weights; auto: per-layer arrays (read in place, faster "
                   "steps, a longer cold compile), except float32 weights on CPU, packed for the native matmul, "
                   "whose stack a scan reads in place; stacked: one layer scanned over the stack (compiles fast)")
    e.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=True,
                   help="q/k/v and gate/up projections as one matmul each")
    e.add_argument("--command-buffers", default="auto", choices=["auto", "xla", "off", "full"],
                   help="XLA:GPU command buffers (CUDA graphs) over the step (GPU only)")
    e.add_argument("--fuse-sampler", default="auto", choices=["auto", "on", "off"],
                   help="the sampler inside the step's jitted program, one executable call per step "
                        "(auto: on with a GPU, off on CPU)")
    e.add_argument("--batch-invariant", action="store_true", help="batch-invariant mode: a request's logits and "
                   "log-probs the same to the bit whatever else is in the batch, however its prompt was chunked and "
                   "whether its prefix was cached (docs/rl.md; on CPU float32 weights on the native kernels)")


def _add_scheduling_flags(e: argparse._ArgumentGroup) -> None:
    """Seeds, async scheduling, speculative decoding."""
    e.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=None, help="keep one step in flight: schedule and dispatch the "
                   "next step before this one's tokens reach the host (vLLM's async scheduling); default: on")
    e.add_argument("--overlap-verification", action=argparse.BooleanOptionalAction,
                   default=None, help="with --speculative-config and async scheduling: "
                   "greedy requests' verification steps overlap the next step too (its drafts proposed on a guess "
                   "of their outcome); otherwise a step that verifies drafts runs synchronously (default: on with "
                   "a GPU, off on CPU)")
    e.add_argument("--async-scheduling-max-tokens", type=int, default=None, help="async scheduling keeps only "
                   "steps feeding at most this many tokens in flight (default: every step with a GPU, "
                   f"{CPU_ASYNC_MAX_TOKENS} on CPU, where the host's work shares the step's cores)")
    e.add_argument("--speculative-config", type=speculative_config_arg, default=None, help="speculative decoding, "
                   'as JSON (vLLM\'s): {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                   '"prompt_lookup_min": 2} drafts up to 4 tokens a step from the request\'s own prompt and output '
                   '(and verifies those expected to pay for their rows; "adaptive_draft_length": false: all of them)')


def _add_multihost_flags(d: argparse._ArgumentGroup) -> None:
    d.add_argument("--distributed-coordinator", default=None, help="host:port of process 0's coordinator; "
                   "every process runs this command with its own --process-id")
    d.add_argument("--num-processes", type=int, default=1, help="processes (hosts) in the job")
    d.add_argument("--process-id", type=int, default=0, help="this process; 0 serves HTTP and schedules, "
                   "the others run the same steps")


def _add_tool_flags(t: argparse._ArgumentGroup) -> None:
    t.add_argument("--enable-auto-tool-choice", action="store_true", help='serve tool_choice "auto": the model '
                   "decides whether to call a tool, and its output is parsed by --tool-call-parser")
    t.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS), help="how tool calls are "
                   'read from "auto" output: hermes (Qwen2.5/Qwen3\'s <tool_call> JSON), mistral ([TOOL_CALLS]), '
                   'llama3_json (Llama 3.x\'s {"name": ..., "parameters": ...}), pythonic ([f(a=1)], Llama 3.2/4), '
                   "qwen3_coder (Qwen3-Coder's <function=...> XML), or auto: the one the model's chat template or "
                   "family shows")
    t.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS), help="return the "
                   "model's <think> span as reasoning_content (chat) and reasoning items (responses): qwen3 or "
                   "deepseek_r1")


def _add_server_flags(s: argparse._ArgumentGroup) -> None:
    s.add_argument("--host", default="0.0.0.0", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--api-key", default=None, help="require `Authorization: "
                   f"Bearer <key>` on every route but /health, /version and /openapi.json (default: ${API_KEY_ENV})")
    s.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help="largest request "
                   "body accepted (413 beyond)")
    s.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS, help="most "
                   "sequences waiting to be scheduled; beyond it requests get 503 with Retry-After at once")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests may run "
                   "on after SIGTERM/SIGINT before they are aborted (the server then exits 0)")
    s.add_argument("--disable-chat-page", action="store_true", help="serve no chat page at / (API-only "
                   "deployments); the page itself is public, its requests need the API key")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   help="log level of jaxpaged and uvicorn")


def chat_template_arg(value: str | None) -> str | None:
    """--chat-template: a file's contents when it names a file, else the template text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text()
    return value


def speculative_config_arg(value: str):
    """--speculative-config: vLLM's JSON object as a SpeculativeConfig; a bad one is a CLI error naming what is
    wrong (imported here: only this flag needs the engine at parse time)."""
    from jaxpaged.spec_decode.ngram import SpeculativeConfig

    try:
        return SpeculativeConfig.from_dict(value)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def engine_args(ns: argparse.Namespace):
    """The EngineArgs of the command line (importing the engine, and so JAX)."""
    from jaxpaged.config import EngineArgs

    return EngineArgs(
        model=ns.model, tokenizer=ns.tokenizer, revision=ns.revision, dtype=ns.dtype, seed=ns.seed,
        max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_num_partial_prefills=ns.max_num_partial_prefills, block_size=ns.block_size,
        enable_prefix_caching=ns.enable_prefix_caching, gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory=ns.kv_cache_memory, num_pages=ns.num_pages, attention_backend=ns.attention_backend,
        kv_cache_dtype=ns.kv_cache_dtype, quantization=ns.quantization, weight_layout=ns.weight_layout,
        fuse_projections=ns.fuse_projections,
        command_buffers=ns.command_buffers, fuse_sampler=ns.fuse_sampler,
        tensor_parallel_size=ns.tensor_parallel_size, chat_template=chat_template_arg(ns.chat_template),
        generation_config=ns.generation_config, distributed_coordinator=ns.distributed_coordinator,
        num_processes=ns.num_processes, process_id=ns.process_id, speculative_config=ns.speculative_config,
        async_scheduling=ns.async_scheduling, async_scheduling_max_tokens=ns.async_scheduling_max_tokens,
        overlap_verification=ns.overlap_verification, batch_invariant=ns.batch_invariant)


def server_config(ns: argparse.Namespace) -> ServerConfig:
    names = tuple(dict.fromkeys([*(ns.served_model_name or []), ns.model]))
    api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
    return ServerConfig(served_model_names=names, api_key=api_key, max_request_bytes=ns.max_request_bytes,
                        enable_chat_page=not ns.disable_chat_page,
                        enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
                        reasoning_parser=ns.reasoning_parser, data_parallel_rank=ns.data_parallel_rank)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = build_parser().parse_args(argv)
    configure_logging(ns.log_level)
    # imported after parsing: --help imports no uvicorn
    from server.lifecycle import ShutdownConfig, bind_socket

    try:
        config, shutdown = server_config(ns), ShutdownConfig(grace_seconds=ns.shutdown_timeout)
    except ValueError as err:
        return fail(err, USAGE_ERROR)
    if ns.data_parallel_size > 1 or ns.data_parallel_worker_urls:  # a launcher: replicas behind a router
        from server import data_parallel

        try:  # the replicas' configuration, checked before any of them starts
            engine_args(ns)
        except (OSError, ValueError) as err:
            return fail(err, USAGE_ERROR)
        return data_parallel.main(ns, argv)
    try:  # process 0 binds before the model loads: a busy port fails in a second, not after the warm-up
        sock = bind_socket(ns.host, ns.port) if ns.process_id == 0 else None
    except OSError as err:
        return fail(err, STARTUP_ERROR)
    try:
        return start(ns, config, shutdown, sock)
    finally:
        if sock is not None:
            sock.close()


def freeze_startup_objects() -> int:
    """Move every object made so far (the engine, its model and tokenizer, the app: they live as long as the process)
    out of the cyclic collector's sight (gc.freeze, as vLLM does after start-up); returns how many. A full collection
    walked them all: ~730k objects with the default model, a 0.45 s stall of every running request about once
    every 800 served requests (CPU); serving's own objects are collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def start(ns: argparse.Namespace, config: ServerConfig, shutdown, sock) -> int:
    """Load the engine, then serve on `sock` (process 0) or follow process 0's steps (sock None)."""
    from jaxpaged.engine.async_llm import AsyncLLM, AsyncLLMConfig  # imports JAX: seconds
    from jaxpaged.engine.llm_engine import LLMEngine
    from jaxpaged.models.weights import WeightLoadError

    try:
        args = engine_args(ns)  # reads the --chat-template file: an unreadable one is an OSError
        async_config = AsyncLLMConfig(max_waiting_requests=ns.max_waiting_requests)
    except (OSError, ValueError) as err:
        return fail(err, USAGE_ERROR)
    log = logging.getLogger("server")
    log.info("python -m server: starting process %d of %d (pid %d)", args.process_id, args.num_processes,
             os.getpid())
    try:  # what a user can fix: an unknown model, missing or unreadable weights, a setting the model refuses
        engine = LLMEngine(args) if sock is None else AsyncLLM.from_engine_args(args, async_config)
    except (OSError, ValueError, WeightLoadError) as err:
        return fail(err, STARTUP_ERROR)
    if sock is None:
        steps = engine.follow()
        log.info("process %d followed %d steps; exiting", args.process_id, steps)
        return 0
    from server.app import build_app
    from server.lifecycle import ListenError

    try:
        try:
            app = build_app(engine, config)
        except ValueError as err:  # e.g. --tool-call-parser auto on a model whose format it cannot tell
            return fail(err, USAGE_ERROR)
        log_context_cap(engine, ns.max_model_len)
        freeze_startup_objects()
        serve(engine, app, ns, config, shutdown, sock)
    except ListenError as err:
        return fail(err, STARTUP_ERROR)
    finally:
        engine.shutdown()
    return 0


def serve(engine, app, ns: argparse.Namespace, config: ServerConfig, shutdown, sock) -> None:
    """uvicorn over the app, listening on the socket bound at start-up, until a signal ends it."""
    import uvicorn

    from server.lifecycle import FLUSH_SECONDS, GracefulServer

    served = (f"{ns.model} as {', '.join(config.served_model_names)} "
              f"(API key {'required' if config.api_key else 'not required'})")
    uvicorn_config = uvicorn.Config(app, host=ns.host, port=ns.port,
                                    log_level=ns.log_level, timeout_graceful_shutdown=FLUSH_SECONDS)
    GracefulServer(uvicorn_config, engine, shutdown, served=served).run(sockets=[sock])


def log_context_cap(engine, requested: int | None) -> None:
    """Say so when the context is shorter than the model's without being asked (the engine's CPU default)."""
    model_len = int(engine.engine.model.config.max_position_embeddings)
    if requested is None and engine.max_model_len < model_len:
        logging.getLogger("server").info(
            "max_model_len %d: the model's context is %d, capped on CPU by default to keep the warm-up short; "
            "give --max-model-len N (up to %d) for longer", engine.max_model_len, model_len, model_len)


def fail(err: BaseException, status: int) -> int:
    """One `error: ...` line on stderr (the traceback only at --log-level debug); returns the exit status."""
    logging.getLogger("server").debug("start-up failed", exc_info=err)
    print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
    return status


def configure_logging(level: str) -> None:
    """The application's logging: jaxpaged's and the server's lines at `level` on stderr.

    JAX's own INFO lines (e.g. "Unable to initialize backend 'tpu'" on every CPU start) are
    left out unless --log-level is debug."""
    level = level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "DEBUG":
        logging.getLogger("jax").setLevel(max(logging.WARNING, logging.getLevelName(level)))


if __name__ == "__main__":
    sys.exit(main())


"""What a precision costs in accuracy and gains in speed, against full precision, side by side from one run.

    python benchmarks/accuracy.py quant [--quantizations fp8,int8,w8a8]   # greedy agreement, KL, lm-eval
    python benchmarks/accuracy.py kv-fp8 [--tiny] [--scales unit]         # an fp8 KV cache against the float one
    python benchmarks/accuracy.py int8 [--batch-sizes 1,8,32]             # int8 / w8a8 weights: quality and speed

quant   each `--quantization` against the same weights in full precision (issue #64's targets)
kv-fp8  kv_cache_dtype="fp8" against the float cache on the same weights (issue #64's targets)
int8    weight-only int8 and W8A8 against float32: perplexity, agreement, greedy answers; output tok/s

`accuracy.py <command> -h` prints the command's full description. The chats are benchmarks/latency.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jaxpaged (and tests/, for kv-fp8 --tiny and the lm-eval task)
from jaxpaged.core.scheduler_output import ScheduledRequest  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402
from jaxpaged.worker.model_runner import ModelRunner  # noqa: E402
from jaxpaged.worker.runner_config import RunnerConfig  # noqa: E402
from latency import GROUNDED, GROUNDED_MORE, OPEN, chat_ids  # noqa: E402  (benchmarks/, beside this file)

QUANT_DOC = """What each `--quantization` costs in accuracy against full precision, side by side from one run.

    python benchmarks/accuracy.py quant                                   # SmolLM2-135M, fp8, int8, w8a8
    python benchmarks/accuracy.py quant --model path/to/hf_folder --quantizations fp8

Two figures per quantisation (issue #64's targets: greedy agreement >= 0.60, mean KL < 0.02):
  - greedy agreement: each of PROMPTS answered greedily (--max-tokens, 48) by the full-precision engine and
    the quantised one; the share of the full-precision answer that the quantised one repeats before the first
    token that differs (its common prefix over the full-precision answer's length), averaged over the prompts;
  - mean KL: the next-token distributions at every position of HELD_OUT (teacher-forced, one prefill each
    side), KL(full precision || quantised) in nats, averaged over the positions.
  - lm-eval loglikelihood: every choice's loglikelihood after its question in the repo's local lm-eval task
    (tests/evals/tasks/jaxpaged_mc.json, lm-eval's split of context and continuation), summed over the task;
    |quantised - full precision| / |full precision| (target < 1%).
Both sides load the same weights (`--dtype`, float32 by default: the int8 paths need it). A quantised side
of the model given: `--quantization` on full-precision weights; an FP8 checkpoint given as `--model` is its
own fp8 side against `--reference` (its full-precision original)."""
KV_FP8_DOC = """What an fp8 KV cache costs in accuracy against the float cache, in one run, on the same weights.

    python benchmarks/accuracy.py kv-fp8                              # SmolLM2: 32 chats, 48 tokens; held-out KL
    python benchmarks/accuracy.py kv-fp8 --scales unit                # vLLM's default scales (1.0) instead

Two measures, each against the same model with a float KV cache (float32 weights and pool on CPU):
  greedy  each prompt's greedy answer (--max-tokens, EOS ignored) from an engine with kv_cache_dtype="fp8",
          and the share of it identical to the float engine's answer up to the first differing token
          (common prefix / max_tokens), averaged over the prompts: benchmarks/latency.py's chats
          (grounded, open, grounded-more); target >= 0.60 (issue #64).
  kl      teacher-forced over HELD_OUT (text the calibration never saw), fed in chunks of --chunk tokens so
          that later chunks read the earlier ones from the pages: the mean over positions of
          KL(float || fp8) of the next-token distributions; target < 0.02.
--scales: "auto" is what the engine does (the checkpoint's scales, else calibrated at start-up:
jaxpaged/worker/kv_scales.py); "unit" every scale 1.0, for comparison.
Prints one line per measure with ours and the target side by side.

The tiny random families (tests/models/tiny_families.py) run with --tiny: the KL row only (their greedy
answers are near-ties everywhere, random weights)."""
INT8_DOC = """int8 weights (weight-only, and W8A8) against float32 on CPU, in one run: what each costs in quality, what
it gains in speed.

    python benchmarks/accuracy.py int8                       # the documented run
    python benchmarks/accuracy.py int8 --batch-sizes 1,32 --max-tokens 64 --rounds 3 --quantizations w8a8

Engines over the same weights (SmolLM2-135M-Instruct dequantised to float32 from its Q4_1 GGUF): one as
loaded, and one per --quantizations entry: "int8" (the weight dots' weights as int8 with a float32 scale per
output column and run of 32 rows, computed in float32 by the native CPU matmul) and "w8a8" (the same weights,
each dot's x quantised too per row and run of 32 values: integer dots, on AVX-512 VNNI where the CPU has it).

Quality, over benchmarks/latency.py's prompts (grounded, open, grounded-more: 32 chats), teacher-forced: each
engine scores every prompt token (prompt_logprobs=1): each side's perplexity, how often each quantised side's
most likely next token agrees with float32's, and the mean |difference| of the log-probabilities they give the
actual token. Then each prompt's greedy answer (--max-tokens, EOS allowed) on every side: how many equal
float32's, and the mean length of their common prefix.

Speed: for each batch size B (--batch-sizes), B of those chats at once decoding --max-tokens tokens each
(ignore_eos, greedy) on each engine in turn, the side that goes first rotating over --rounds rounds: output
tok/s per round, the medians and each side / float32. At batch 1 a decode step reads every weight once per
token, so int8 reads a quarter of the bytes; at 8-32 rows the step is bound by the multiply-adds, which
weight-only int8 does not cut (its values are widened to float32 in registers) and W8A8's VNNI dots do."""


# ---- quant ---------------------------------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\n",
    "def fibonacci(n):\n",
    "Q: What is 17 times 23?\nA:",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Translate to German: The weather is nice today.\n",
    "List five fruits that are red:\n1.",
    "Explain in one paragraph why the sky is blue.",
    "The best way to learn a new language is",
    "import numpy as np\n\n# compute the mean of each row\n",
    "Dear hiring manager,\n",
    "In 1969, the first humans",
    "A recipe for pancakes:\nIngredients:\n",
    "The difference between a virus and a bacterium is",
    "Here are three tips for better sleep:\n1.",
]
HELD_OUT = (
    "The river rose slowly through the night, and by morning the lower fields were under a hand's depth of "
    "brown water. Farmers walked the dikes with lanterns, checking for the soft places where the earth gave "
    "way. Nobody spoke much. The old miller said the water would crest by noon, as it had twenty years "
    "before, and most people believed him, because he had been right about the weather more often than the "
    "radio. By ten o'clock the rain had stopped, the clouds thinned to a pale grey, and the first birds came "
    "back to the poplars along the road."
)
BOUNDS = {"agreement": 0.60, "kl": 0.02, "loglikelihood": 0.01}  # issue #64's targets
MC_TASK = ROOT / "tests" / "evals" / "tasks" / "jaxpaged_mc.json"


def quant_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="accuracy.py quant", description=QUANT_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--reference", default=None, help="full-precision side (default: --model as loaded)")
    p.add_argument("--quantizations", default="fp8,int8,w8a8", help="comma-separated (fp8, int8, w8a8)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=48)
    return p.parse_args(argv)


def greedy_answers(model: str, quantization: str | None, dtype: str, max_tokens: int,
                   prompts=PROMPTS) -> list[list[int]]:
    """Each prompt's greedy answer (token ids, EOS allowed) from an engine over `model`."""
    from jaxpaged import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, quantization=quantization, warmup=False, max_model_len=256, max_num_seqs=8,
              kv_cache_memory=64 << 20)
    outputs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outputs]


def prefix_shares(reference: list[list[int]], quantized: list[list[int]]) -> list[float]:
    """Per prompt: the common prefix's share of the reference answer."""
    return [common_prefix(ref, got) / max(len(ref), 1) for ref, got in zip(reference, quantized, strict=True)]


def common_prefix(x: list[int], y: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))


def agreement(reference: list[list[int]], quantized: list[list[int]]) -> float:
    """Mean over prompts of the common prefix's share of the reference answer."""
    return float(np.mean(prefix_shares(reference, quantized)))


def scorer(model: str, quantization: str | None, dtype: str):
    """(tokenizer, score): score(token ids) -> the log-softmax of the next-token logits f32[T, V] at each of
    them (one prefill of at most 256 tokens on a paged step of its own runner; an FP8 checkpoint as fp8)."""
    from jaxpaged.models.llama import lm_logits
    from jaxpaged.models.loader import load_model

    loaded = load_model(model, dtype=dtype)
    quantization = quantization or ("fp8" if loaded.quantization is not None else None)
    config = RunnerConfig(max_num_seqs=1, max_num_batched_tokens=256, max_model_len=256, page_size=16, num_pages=20,
                          min_token_bucket=256, quantization=quantization)
    runner = ModelRunner(loaded.config, loaded.params, config)
    head = jax.jit(lm_logits, static_argnums=0)
    compiled = []

    def score(tokens: list[int]) -> np.ndarray:
        step = runner.prepare([ScheduledRequest("score", tuple(tokens), 0, tuple(range(1, 17)), True,
                                                SamplingParams(), len(tokens))])
        compiled[:] = compiled or [runner.lower(step).compile()]  # one shape: T = 256
        _, hidden, runner.kv = compiled[0](runner.params, runner.kv, step)  # the pool is donated: keep the new one
        return np.asarray(jax.nn.log_softmax(head(loaded.config, runner.params, hidden[:len(tokens)]), axis=-1))

    return loaded.tokenizer, score


def position_logprobs(model: str, quantization: str | None, dtype: str, text: str = HELD_OUT) -> np.ndarray:
    """log-softmax of the next-token logits f32[T, V] at every position of `text` (its first 200 tokens: within
    the tiny models' context of 256)."""
    tokenizer, score = scorer(model, quantization, dtype)
    return score(tokenizer(text, add_special_tokens=False)["input_ids"][:200])


def task_loglikelihoods(model: str, quantization: str | None, dtype: str, docs=None) -> np.ndarray:
    """The local lm-eval task's (tests/evals/tasks/jaxpaged_mc.json) loglikelihood of every choice after its
    question, split as lm-eval splits it (the question's tokens, then the rest of the whole text's) and summed
    over the choice's tokens: f64[choices]."""
    docs = docs if docs is not None else json.loads(MC_TASK.read_text())
    tokenizer, score = scorer(model, quantization, dtype)
    out = []
    for doc in docs:
        context = tokenizer(doc["question"], add_special_tokens=False)["input_ids"]
        for choice in doc["choices"]:
            whole = tokenizer(doc["question"] + " " + choice, add_special_tokens=False)["input_ids"]
            logprobs = score(whole)
            out.append(sum(float(logprobs[q - 1, whole[q]]) for q in range(len(context), len(whole))))
    return np.asarray(out)


def mean_kl(reference: np.ndarray, quantized: np.ndarray) -> float:
    """Mean over positions of KL(reference || quantized), both log-probabilities [T, V], in nats."""
    p = np.exp(reference)
    return float(np.mean(np.sum(p * (reference - quantized), axis=-1)))


def measure(model: str, quantization: str | None, dtype: str, max_tokens: int, reference: str | None = None,
            prompts=PROMPTS, text: str = HELD_OUT) -> dict[str, float]:
    """{"agreement", "kl"} of `model` under `quantization` against `reference` (default: `model` as loaded)."""
    reference = reference or model
    ref_answers = greedy_answers(reference, None, dtype, max_tokens, prompts)
    answers = greedy_answers(model, quantization, dtype, max_tokens, prompts)
    kl = mean_kl(position_logprobs(reference, None, dtype, text), position_logprobs(model, quantization, dtype, text))
    ref_ll, ll = task_loglikelihoods(reference, None, dtype), task_loglikelihoods(model, quantization, dtype)
    return {"agreement": agreement(ref_answers, answers), "kl": kl,
            "loglikelihood": float(abs(ll.sum() - ref_ll.sum()) / abs(ref_ll.sum()))}


def quant_main(argv=None) -> int:
    args = quant_args(argv)
    rows = []
    for q in [q for q in args.quantizations.split(",") if q]:
        quantization = None if q == "checkpoint" else q
        rows.append((q, measure(args.model, quantization, args.dtype, args.max_tokens, args.reference)))
    print(f"model {args.model} ({args.dtype}), reference {args.reference or 'the same weights, full precision'}; "
          f"{len(PROMPTS)} prompts x {args.max_tokens} greedy tokens, KL over {len(HELD_OUT)} characters")
    print(f"| quantization | greedy agreement (target >= {BOUNDS['agreement']}) | mean KL, nats (target < "
          f"{BOUNDS['kl']}) | lm-eval task loglikelihood, relative difference (target < {BOUNDS['loglikelihood']}) "
          "| targets |")
    print("|---|---:|---:|---:|---|")
    for q, r in rows:
        ok = r["agreement"] >= BOUNDS["agreement"] and r["kl"] < BOUNDS["kl"] and \
            r["loglikelihood"] < BOUNDS["loglikelihood"]
        print(f"| {q} | {r['agreement']:.3f} | {r['kl']:.5f} | {r['loglikelihood']:.4f} | {'met' if ok else 'MISS'} |")
    return 0


# ---- kv-fp8 --------------------------------------------------------------------------------------------------

KV_HELD_OUT = (  # text the KV scales' calibration never saw
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. From the lamp room he could "
    "see the whole bay: the fishing boats coming home, the gulls settling on the breakwater, and far out, "
    "the dark line where the sea met the sky. He had kept the light for thirty-one years, and in all that "
    "time it had never failed. Each night he trimmed the wick, polished the great lens until it shone, and "
    "wrote a line in the logbook: the weather, the ships that passed, anything unusual. Most entries were "
    "short. 'Fog until midnight. Two trawlers. Wind from the west.' But one winter night in 1962 he wrote a "
    "whole page, and the harbour master, who read it the next morning, kept it in his desk for the rest of "
    "his life. To compute the area of a circle, square its radius and multiply by pi; for a radius of 3 cm "
    "the area is about 28.27 square centimetres. In Python: import math; area = math.pi * r ** 2.")
KV_TARGETS = {"greedy": 0.60, "kl": 0.02}


def kv_fp8_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="accuracy.py kv-fp8", description=KV_FP8_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=32, help="how many of the chats (greedy measure)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--chunk", type=int, default=64, help="tokens a step feeds (KL measure)")
    p.add_argument("--scales", choices=("auto", "unit"), default="auto")
    p.add_argument("--tiny", action="store_true", help="also the tiny random families' KL (needs torch)")
    return p.parse_args(argv)


def _kv_engine(loaded, kv_cache_dtype: str, scales: str):
    """An engine over `loaded` with a float ("auto") or an fp8 KV pool; scales "unit": every fp8 scale 1.0."""
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model="unused", dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                  max_model_len=min(1024, loaded.config.max_position_embeddings), max_num_seqs=32,
                                  max_num_batched_tokens=256, kv_cache_memory=64 << 20, warmup=False,
                                  compilation_cache_dir=None), loaded=loaded)
    if kv_cache_dtype == "fp8" and scales == "unit":
        shape = (loaded.config.num_hidden_layers, loaded.config.num_key_value_heads)  # two buffers: both donated
        engine.runner.kv = dataclasses.replace(engine.runner.kv, k_scale=jnp.ones(shape), v_scale=jnp.ones(shape))
    return engine


def greedy_agreement(loaded, prompts: list[list[int]], max_tokens: int, scales: str = "auto") -> list[float]:
    """Per prompt: the common prefix of the fp8-KV and float-KV greedy answers / max_tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    answers = {}
    for kv in ("auto", "fp8"):
        engine = _kv_engine(loaded, kv, scales)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        answers[kv] = [done[str(i)] for i in range(len(prompts))]
    return prefix_shares(answers["auto"], answers["fp8"])  # ignore_eos: each answer is max_tokens long


def kv_mean_kl(loaded, token_ids: list[int], chunk: int, scales: str = "auto") -> float:
    """Mean KL(float KV || fp8 KV) of the next-token distributions at every position of token_ids, the text fed
    `chunk` tokens a step through each engine's own runner (later chunks read the earlier ones' pages)."""
    from jaxpaged.models.llama import lm_logits

    logprobs = {}
    for kv in ("auto", "fp8"):
        runner, rows = _kv_engine(loaded, kv, scales).runner, []
        for start in range(0, len(token_ids), chunk):
            step = _chunk_step(token_ids, start, min(len(token_ids), start + chunk), runner.config.page_size)
            _, hidden = runner._forward(step)  # pylint: disable=protected-access
            logits = lm_logits(loaded.config, runner.params, hidden[: step.cu_q_lens[1]])
            rows.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)))
        logprobs[kv] = np.concatenate(rows)
    return mean_kl(logprobs["auto"], logprobs["fp8"])


def _chunk_step(token_ids: list[int], start: int, end: int, page_size: int):
    """One sequence's tokens start..end-1 as a step over pages 1, 2, ... (positions 0.. of the sequence)."""
    from jaxpaged.worker.step_input import StepInput

    n = end - start
    pages = -(-end // page_size)
    positions = np.arange(start, end, dtype=np.int32)
    slots = (1 + positions // page_size) * page_size + positions % page_size
    return StepInput(np.asarray(token_ids[start:end], np.int32), positions, slots.astype(np.int32),
                     np.arange(1, pages + 1, dtype=np.int32)[None], np.asarray([end], np.int32),
                     np.asarray([0, n], np.int32), np.int32(1), np.asarray([n - 1], np.int32))


def kv_fp8_main(argv=None) -> int:
    args = kv_fp8_args(argv)

    from jaxpaged.models.loader import load_model

    loaded = load_model(args.model, dtype="float32")
    kinds = (["grounded"] * len(GROUNDED) + ["open"] * len(OPEN) + ["grounded-more"] * len(GROUNDED_MORE))[
        :args.prompts]
    prompts = chat_ids(loaded.tokenizer, (GROUNDED + OPEN + GROUNDED_MORE)[: args.prompts])
    shares = greedy_agreement(loaded, prompts, args.max_tokens, args.scales)
    kl = kv_mean_kl(loaded, loaded.tokenizer(KV_HELD_OUT)["input_ids"], args.chunk, args.scales)
    print(f"model {args.model}, fp8 KV scales {args.scales}")
    print(f"greedy  identical share of a {args.max_tokens}-token answer, mean over {len(prompts)} prompts: "
          f"{np.mean(shares):.3f} (min {min(shares):.3f}, {sum(s == 1 for s in shares)} whole)  "
          f"target >= {KV_TARGETS['greedy']:.2f}")
    for kind in dict.fromkeys(kinds):
        part = [s for s, k in zip(shares, kinds) if k == kind]
        print(f"greedy    {kind:14s} {len(part):2d} prompts: {np.mean(part):.3f}")
    print(f"kl      mean KL(float || fp8) over {len(loaded.tokenizer(KV_HELD_OUT)['input_ids'])} held-out tokens: "
          f"{kl:.5f}  target < {KV_TARGETS['kl']:.2f}")
    if args.tiny:
        _tiny_rows(args)
    return 0


def _tiny_rows(args) -> None:
    import tempfile

    from jaxpaged.models.loader import load_model
    from tests.conftest import make_tiny_checkpoint
    from tests.models.tiny_families import FAMILY_VARIANTS, make_family_checkpoint

    with tempfile.TemporaryDirectory() as root:
        paths = {"llama": make_tiny_checkpoint(pathlib.Path(root) / "llama", "gqa4")}
        paths.update({v: make_family_checkpoint(pathlib.Path(root) / v, v) for v in FAMILY_VARIANTS})
        ids = list(KV_HELD_OUT.encode()[:200])  # the tiny byte-level vocabulary: ids 0..255 are the bytes
        for name, path in paths.items():
            kl = kv_mean_kl(load_model(str(path), dtype="float32"), ids, args.chunk, args.scales)
            print(f"kl      tiny {name:14s} mean KL(float || fp8) over {len(ids)} tokens: {kl:.2e}  "
                  f"target < {KV_TARGETS['kl']:.2f}")


# ---- int8 ----------------------------------------------------------------------------------------------------

BASE = "float32"


def int8_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="accuracy.py int8", description=INT8_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantizations", default="int8,w8a8", help="comma-separated quantised sides (int8, w8a8)")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes for the speed rounds")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (speed and greedy answers)")
    p.add_argument("--rounds", type=int, default=4, help="speed rounds per batch size (first side rotates)")
    return p.parse_args(argv)


def int8_engines(model: str, quantizations: list[str]) -> dict:
    """float32 and each quantised side, each an `LLM` (the model loads from jaxpaged's model cache after the first)."""
    from jaxpaged import LLM

    base = dict(dtype="float32", max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512,
                kv_cache_memory=256 << 20)
    return {BASE: LLM(model, **base), **{q: LLM(model, quantization=q, **base) for q in quantizations}}


def run_all(llm, prompts: list[list[int]], params) -> tuple[float, list]:
    """All prompts at once, to the end: wall seconds and the outputs in prompt order."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def int8_quality(engines: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    """Per side: perplexity; per quantised side, against float32: top-1 agreement, mean |logprob difference|,
    identical greedy answers and their mean common prefix."""
    sides = list(engines)
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = {side: run_all(engine, prompts, score)[1] for side, engine in engines.items()}
    nll = {side: [] for side in sides}
    agree = {side: 0 for side in sides[1:]}
    diffs = {side: [] for side in sides[1:]}
    for i, prompt in enumerate(prompts):
        for pos in range(1, len(prompt)):  # entry 0 is None: nothing predicts the first token
            entries = {side: scored[side][i].prompt_logprobs[pos] for side in sides}
            actual = {side: entries[side][prompt[pos]].logprob for side in sides}
            top = {side: next(t for t, lp in entries[side].items() if lp.rank == 1) for side in sides}
            for side in sides:
                nll[side].append(-actual[side])
            for side in sides[1:]:
                agree[side] += top[BASE] == top[side]
                diffs[side].append(abs(actual[BASE] - actual[side]))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    answers = {side: [o.outputs[0].token_ids for o in run_all(engine, prompts, greedy)[1]]
               for side, engine in engines.items()}
    out = {"tokens_scored": len(diffs[sides[1]]) if len(sides) > 1 else 0, "answers": len(prompts),
           "mean_answer_tokens": float(np.mean([len(a) for a in answers[BASE]])),
           "perplexity": {side: math.exp(float(np.mean(nll[side]))) for side in sides}}
    for side in sides[1:]:
        prefixes = [common_prefix(x, y) for x, y in zip(answers[BASE], answers[side])]
        out[side] = {"top1_agreement": agree[side] / len(diffs[side]),
                     "mean_abs_logprob_diff": float(np.mean(diffs[side])),
                     "identical_answers": sum(x == y for x, y in zip(answers[BASE], answers[side])),
                     "mean_common_prefix": float(np.mean(prefixes))}
    return out


def int8_speed(engines: dict, prompts: list[list[int]], batch: int, max_tokens: int, rounds: int) -> dict:

    sides = list(engines)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    chosen = [prompts[i % len(prompts)] for i in range(batch)]
    for engine in engines.values():  # untimed: each step shape's first run costs extra
        run_all(engine, chosen, dataclasses.replace(params, max_tokens=8))
    rates = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            seconds, _ = run_all(engines[side], chosen, params)
            rates[side].append(batch * max_tokens / seconds)
    medians = {side: statistics.median(v) for side, v in rates.items()}
    return {"batch": batch, "rates": rates, "median": medians,
            "ratio": {side: medians[side] / medians[BASE] for side in sides[1:]}}


def int8_main(argv=None) -> int:
    args = int8_args(argv)
    quantizations = [q for q in args.quantizations.split(",") if q]
    engines = int8_engines(args.model, quantizations)
    sides = list(engines)
    prompts = chat_ids(engines[BASE].get_tokenizer(), GROUNDED + OPEN + GROUNDED_MORE)
    q = int8_quality(engines, prompts, args.max_tokens)
    print(f"## quality: {len(prompts)} chats, {q['tokens_scored']} prompt tokens scored, greedy answers up to "
          f"{args.max_tokens} tokens (float32's mean {q['mean_answer_tokens']:.0f})\n")
    print("| | " + " | ".join(sides) + " |\n|---|" + "---:|" * len(sides))
    print("| perplexity (prompt tokens) | " + " | ".join(f"{q['perplexity'][s]:.3f}" for s in sides) + " |")
    rows = [("top-1 next-token agreement with float32", lambda m: f"{100 * m['top1_agreement']:.2f}%"),
            ("mean abs logprob difference of the actual token", lambda m: f"{m['mean_abs_logprob_diff']:.4f}"),
            ("greedy answers identical to float32's", lambda m: f"{m['identical_answers']}/{q['answers']}"),
            ("mean common prefix with float32's (tokens)", lambda m: f"{m['mean_common_prefix']:.1f}")]
    for label, fmt in rows:
        print(f"| {label} | | " + " | ".join(fmt(q[s]) for s in sides[1:]) + " |")
    print(f"\n## speed: output tok/s, {args.max_tokens} tokens a request, greedy, {args.rounds} rounds\n", flush=True)
    print("| batch | " + " | ".join(f"{s} (rounds)" for s in sides) + " | " + " | ".join(f"{s} median" for s in sides)
          + " | " + " | ".join(f"{s} / float32" for s in sides[1:]) + " |")
    print("|---:|" + "---|" * len(sides) + "---:|" * (2 * len(sides) - 1))
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        r = int8_speed(engines, prompts, batch, args.max_tokens, args.rounds)
        print(f"| {batch} | " + " | ".join(" ".join(f"{v:.1f}" for v in r["rates"][s]) for s in sides) + " | "
              + " | ".join(f"{r['median'][s]:.1f}" for s in sides) + " | "
              + " | ".join(f"**{r['ratio'][s]:.2f}x**" for s in sides[1:]) + " |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"quant": quant_main, "kv-fp8": kv_fp8_main, "int8": int8_main}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

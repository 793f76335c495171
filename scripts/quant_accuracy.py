"""What each `--quantization` costs in accuracy against full precision, side by side from one run.

    python scripts/quant_accuracy.py                                   # SmolLM2-135M, fp8, int8, w8a8
    python scripts/quant_accuracy.py --model path/to/hf_folder --quantizations fp8

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
own fp8 side against `--reference` (its full-precision original).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

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
MC_TASK = pathlib.Path(__file__).resolve().parents[1] / "tests" / "evals" / "tasks" / "jaxpaged_mc.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    shares = []
    for ref, got in zip(reference, quantized, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        shares.append(same / max(len(ref), 1))
    return shares


def agreement(reference: list[list[int]], quantized: list[list[int]]) -> float:
    """Mean over prompts of the common prefix's share of the reference answer."""
    return float(np.mean(prefix_shares(reference, quantized)))


def scorer(model: str, quantization: str | None, dtype: str):
    """(tokenizer, score): score(token ids) -> the log-softmax of the next-token logits f32[T, V] at each of
    them (one prefill of at most 256 tokens on a paged step of its own runner; an FP8 checkpoint as fp8)."""
    import jax

    from jaxpaged.core.scheduler_output import ScheduledRequest
    from jaxpaged.models.llama import lm_logits
    from jaxpaged.models.loader import load_model
    from jaxpaged.sampling_params import SamplingParams
    from jaxpaged.worker.model_runner import ModelRunner
    from jaxpaged.worker.runner_config import RunnerConfig

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


def main(argv=None) -> None:
    args = parse_args(argv)
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


if __name__ == "__main__":
    main()

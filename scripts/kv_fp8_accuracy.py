"""What an fp8 KV cache costs in accuracy against the float cache, in one run, on the same weights.

    python scripts/kv_fp8_accuracy.py                              # SmolLM2: 32 chats, 48 tokens; held-out KL
    python scripts/kv_fp8_accuracy.py --prompts 8 --max-tokens 24  # smaller
    python scripts/kv_fp8_accuracy.py --scales unit                # vLLM's default scales (1.0) instead

Two measures, each against the same model with a float KV cache (float32 weights and pool on CPU):
  greedy  each prompt's greedy answer (--max-tokens, EOS ignored) from an engine with kv_cache_dtype="fp8",
          and the share of it identical to the float engine's answer up to the first differing token
          (common prefix / max_tokens), averaged over the prompts: benchmark_latency.py's chats
          (grounded, open, grounded-more); target >= 0.60 (issue #64).
  kl      teacher-forced over HELD_OUT (text the calibration never saw), fed in chunks of --chunk tokens so
          that later chunks read the earlier ones from the pages: the mean over positions of
          KL(float || fp8) of the next-token distributions; target < 0.02.
--scales: "auto" is what the engine does (the checkpoint's scales, else calibrated at start-up:
jaxpaged/worker/kv_scales.py); "unit" every scale 1.0, for comparison.
Prints one line per measure with ours and the target side by side.

The tiny random families (tests/models/tiny_families.py) run with --tiny: the KL row only (their greedy
answers are near-ties everywhere, random weights).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from quant_accuracy import mean_kl as kl_between  # noqa: E402 (scripts/, beside this one)
from quant_accuracy import prefix_shares  # noqa: E402

HELD_OUT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. From the lamp room he could "
    "see the whole bay: the fishing boats coming home, the gulls settling on the breakwater, and far out, "
    "the dark line where the sea met the sky. He had kept the light for thirty-one years, and in all that "
    "time it had never failed. Each night he trimmed the wick, polished the great lens until it shone, and "
    "wrote a line in the logbook: the weather, the ships that passed, anything unusual. Most entries were "
    "short. 'Fog until midnight. Two trawlers. Wind from the west.' But one winter night in 1962 he wrote a "
    "whole page, and the harbour master, who read it the next morning, kept it in his desk for the rest of "
    "his life. To compute the area of a circle, square its radius and multiply by pi; for a radius of 3 cm "
    "the area is about 28.27 square centimetres. In Python: import math; area = math.pi * r ** 2.")
TARGETS = {"greedy": 0.60, "kl": 0.02}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=32, help="how many of the chats (greedy measure)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--chunk", type=int, default=64, help="tokens a step feeds (KL measure)")
    p.add_argument("--scales", choices=("auto", "unit"), default="auto")
    p.add_argument("--tiny", action="store_true", help="also the tiny random families' KL (needs torch)")
    return p.parse_args(argv)


def _engine_args(kv_cache_dtype: str, config) -> dict:
    return dict(dtype="float32", kv_cache_dtype=kv_cache_dtype,
                max_model_len=min(1024, config.max_position_embeddings), max_num_seqs=32,
                max_num_batched_tokens=256, kv_cache_memory=64 << 20, warmup=False, compilation_cache_dir=None)


def unit_scales(config):
    shape = (config.num_hidden_layers, config.num_key_value_heads)
    return np.ones(shape, np.float32), np.ones(shape, np.float32)


def greedy_agreement(loaded, prompts: list[list[int]], max_tokens: int, scales: str = "auto") -> list[float]:
    """Per prompt: the common prefix of the fp8-KV and float-KV greedy answers / max_tokens."""
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine
    from jaxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    answers = {}
    for kv in ("auto", "fp8"):
        engine = LLMEngine(EngineArgs(model="unused", **_engine_args(kv, loaded.config)), loaded=loaded)
        if kv == "fp8" and scales == "unit":
            _set_scales(engine.runner, unit_scales(loaded.config))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        answers[kv] = [done[str(i)] for i in range(len(prompts))]
    return prefix_shares(answers["auto"], answers["fp8"])  # ignore_eos: each answer is max_tokens long


def _set_scales(runner, scales) -> None:
    import dataclasses

    import jax.numpy as jnp
    runner.kv = dataclasses.replace(runner.kv, k_scale=jnp.asarray(scales[0]), v_scale=jnp.asarray(scales[1]))


def mean_kl(loaded, token_ids: list[int], chunk: int, scales: str = "auto") -> float:
    """Mean KL(float KV || fp8 KV) of the next-token distributions at every position of token_ids, the text fed
    `chunk` tokens a step through each engine's own runner (later chunks read the earlier ones' pages)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine
    from jaxpaged.models.llama import lm_logits

    logprobs = {}
    for kv in ("auto", "fp8"):
        engine = LLMEngine(EngineArgs(model="unused", **_engine_args(kv, loaded.config)), loaded=loaded)
        if kv == "fp8" and scales == "unit":
            _set_scales(engine.runner, unit_scales(loaded.config))
        runner, rows = engine.runner, []
        for start in range(0, len(token_ids), chunk):
            step = _chunk_step(token_ids, start, min(len(token_ids), start + chunk), runner.config.page_size)
            _, hidden = runner._forward(step)  # pylint: disable=protected-access
            logits = lm_logits(loaded.config, runner.params, hidden[: step.cu_q_lens[1]])
            rows.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)))
        logprobs[kv] = np.concatenate(rows)
    return kl_between(logprobs["auto"], logprobs["fp8"])


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


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from latency import GROUNDED, GROUNDED_MORE, OPEN, chat_ids

    from jaxpaged.models.loader import load_model

    loaded = load_model(args.model, dtype="float32")
    kinds = (["grounded"] * len(GROUNDED) + ["open"] * len(OPEN) + ["grounded-more"] * len(GROUNDED_MORE))
    kinds = kinds[: args.prompts]
    prompts = chat_ids(loaded.tokenizer, (GROUNDED + OPEN + GROUNDED_MORE)[: args.prompts])
    shares = greedy_agreement(loaded, prompts, args.max_tokens, args.scales)
    kl = mean_kl(loaded, loaded.tokenizer(HELD_OUT)["input_ids"], args.chunk, args.scales)
    print(f"model {args.model}, fp8 KV scales {args.scales}")
    print(f"greedy  identical share of a {args.max_tokens}-token answer, mean over {len(prompts)} prompts: "
          f"{np.mean(shares):.3f} (min {min(shares):.3f}, {sum(s == 1 for s in shares)} whole)  "
          f"target >= {TARGETS['greedy']:.2f}")
    for kind in dict.fromkeys(kinds):
        part = [s for s, k in zip(shares, kinds) if k == kind]
        print(f"greedy    {kind:14s} {len(part):2d} prompts: {np.mean(part):.3f}")
    print(f"kl      mean KL(float || fp8) over {len(loaded.tokenizer(HELD_OUT)['input_ids'])} held-out tokens: "
          f"{kl:.5f}  target < {TARGETS['kl']:.2f}")
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
        ids = list(HELD_OUT.encode()[:200])  # the tiny byte-level vocabulary: ids 0..255 are the bytes
        for name, path in paths.items():
            kl = mean_kl(load_model(str(path), dtype="float32"), ids, args.chunk, args.scales)
            print(f"kl      tiny {name:14s} mean KL(float || fp8) over {len(ids)} tokens: {kl:.2e}  "
                  f"target < {TARGETS['kl']:.2f}")


if __name__ == "__main__":
    sys.exit(main())

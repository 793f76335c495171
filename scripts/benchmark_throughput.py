"""Offline throughput: jaxpaged's LLM vs transformers' `generate` in static batches, same prompts.

    python scripts/benchmark_throughput.py                      # the documented workload
    python scripts/benchmark_throughput.py --num-prompts 32     # a quicker look

Synthetic workload (vLLM's "random" dataset): prompts of random token ids with
input lengths uniform in [--input-min, --input-max] and output lengths uniform
in [--output-min, --output-max], EOS ignored so both engines produce exactly the
requested tokens. Both run the same weights in float32 on the default device.
Output tokens/s counts the requested output tokens only (static batches also
compute padding and run to the longest request of each batch: that waste is
exactly what continuous batching removes).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def make_workload(tokenizer, num_prompts: int, lengths: tuple[int, int, int, int], seed: int):
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
    in_lens = rng.integers(lengths[0], lengths[1] + 1, size=num_prompts)
    out_lens = rng.integers(lengths[2], lengths[3] + 1, size=num_prompts)
    prompts = [rng.choice(vocab, size=n).tolist() for n in in_lens]
    return prompts, out_lens.tolist()


def run_jaxpaged(args, prompts, out_lens) -> dict:
    from jaxpaged import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.input_max + args.output_max,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_gib << 30)
    startup = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    stats = llm.llm_engine.stats()
    return {"engine": "jaxpaged", "seconds": seconds, "startup_seconds": startup, "output_tokens": produced,
            "preemptions": stats["num_preemptions"]}


def run_transformers(args, prompts, out_lens) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged.models.loader import resolve_model_path

    path = resolve_model_path(args.model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    torch.set_num_threads(args.torch_threads or torch.get_num_threads())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    start = time.perf_counter()
    order = range(0, len(prompts), args.hf_batch_size)
    for b in order:
        batch, lens = prompts[b:b + args.hf_batch_size], out_lens[b:b + args.hf_batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=pad)
        print(f"  transformers batch {b // args.hf_batch_size + 1}/{len(order)} done", flush=True)
    seconds = time.perf_counter() - start
    return {"engine": f"transformers generate (static batch {args.hf_batch_size})", "seconds": seconds,
            "output_tokens": sum(out_lens)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-min", type=int, default=32)
    parser.add_argument("--input-max", type=int, default=512)
    parser.add_argument("--output-min", type=int, default=32)
    parser.add_argument("--output-max", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--torch-threads", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--save-json", default=None)
    args = parser.parse_args(argv)

    from jaxpaged.models.loader import load_model
    tokenizer = load_model(args.model).tokenizer
    lengths = (args.input_min, args.input_max, args.output_min, args.output_max)
    prompts, out_lens = make_workload(tokenizer, args.num_prompts, lengths, args.seed)
    print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} input tokens, {sum(out_lens)} output "
          f"tokens (in {lengths[0]}-{lengths[1]}, out {lengths[2]}-{lengths[3]}, seed {args.seed})")
    results = [run_jaxpaged(args, prompts, out_lens)]
    if not args.skip_transformers:
        results.append(run_transformers(args, prompts, out_lens))
    print(f"\n{'engine':44s} {'seconds':>9s} {'output tok/s':>13s} {'requests/s':>11s}")
    for r in results:
        r["output_tokens_per_s"] = r["output_tokens"] / r["seconds"]
        r["requests_per_s"] = len(prompts) / r["seconds"]
        print(f"{r['engine']:44s} {r['seconds']:9.1f} {r['output_tokens_per_s']:13.1f} {r['requests_per_s']:11.2f}")
    if len(results) == 2:
        ratio = results[0]["output_tokens_per_s"] / results[1]["output_tokens_per_s"]
        print(f"{'ratio jaxpaged / transformers':44s} {'':9s} {ratio:12.2f}x")
    print(f"(jaxpaged start-up incl. warm-up compile: {results[0]['startup_seconds']:.1f} s, "
          f"preemptions: {results[0]['preemptions']})")
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

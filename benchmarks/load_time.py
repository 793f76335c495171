"""How long loading a GGUF model takes in-process, checkouts side by side (`micro.py load`).

    python benchmarks/micro.py load --tree /tmp/jp-base --tree .              # SmolLM2, 3 rounds
    python benchmarks/micro.py load --tree /tmp/jp-base --tree . --model gemma3-270m --rounds 2

Two timings per start, each round a fresh process per checkout (the checkouts alternating, so a busy
machine's slow spell falls on both): `open_gguf` (the file's metadata header and tensor index) and then
`load_model(..., cache_dir=None)` (config, dequantised params on the device, tokenizer; the model cache
left out, so the GGUF file is read as on a cold start). JAX starts before either is timed. Prints each
checkout's median and range and the first checkout's median over each other's (> 1: the other is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(tree: str, model: str) -> None:
    sys.path.insert(0, tree)
    import jax  # pylint: disable=import-outside-toplevel
    jax.devices()
    from jaxpaged.models import gguf_loader  # pylint: disable=import-outside-toplevel
    from jaxpaged.models.loader import load_model, resolve_model_path  # pylint: disable=import-outside-toplevel
    path = resolve_model_path(model)
    start = time.perf_counter()
    gguf_loader.open_gguf(path)
    opened = time.perf_counter()
    load_model(str(path), cache_dir=None)
    print(json.dumps({"open_gguf": opened - start, "load_model": time.perf_counter() - opened}))


def measure(tree: Path, model: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--worker", str(tree), "--model", model], check=True,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tree), "TQDM_DISABLE": "1",
                              "PYTHONDONTWRITEBYTECODE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="micro.py load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, action="append", help="a checkout (repeat to compare; default: this one)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a built-in GGUF model or a .gguf path")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model)
        return 0
    trees = [t.resolve() for t in args.tree or [ROOT]]
    runs: list[list[dict[str, float]]] = [[] for _ in trees]
    for i in range(args.rounds):
        for n in range(len(trees)) if i % 2 == 0 else reversed(range(len(trees))):
            runs[n].append(measure(trees[n], args.model))
            print(f"round {i + 1} {trees[n]}: " + ", ".join(f"{k} {v:.2f} s" for k, v in runs[n][-1].items()),
                  flush=True)
    for key in ("open_gguf", "load_model"):
        times = [[r[key] for r in tree_runs] for tree_runs in runs]
        medians = [statistics.median(t) for t in times]
        cells = [f"{tree}: {m:.2f} s ({min(t):.2f}-{max(t):.2f})" for tree, m, t in zip(trees, medians, times)]
        ratios = [f"{medians[0] / m:.2f}x" for m in medians[1:]]
        print(f"{key}, median (range) of {args.rounds}: " + "; ".join(cells)
              + (f"; the first / each other: {', '.join(ratios)}" if ratios else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""CPU attention A/B: this tree's XLA path against another checkout's, interleaved in one process.

SmolLM2-135M attention shapes (9 q heads, 3 kv heads, D = 64, page size 16, float32), a layer-stacked
pool [30, 3, N, 16, 64], each program a 30-layer `lax.scan` as in the engine's step: every layer writes
the step's K/V into the pool (`write_kv_inner`, pool donated) and attends (`backend="xla"`, the engine's
XLA:CPU options for a step of T tokens). Cases:

  decode B     B sequences in decode, contexts 150-200 (170 at B = 1), T = S = B
  verify N     one sequence fed N tokens at context 170 (a speculative verification of N - 1 drafts),
               over S = 4 slots, T = N; "verify 4 x 2 + 2 decodes": two of them beside two decodes, T = 16
  prefill 256  two fresh prompts, 160 and 96 tokens (T = 256, S = 4)
  mixed 512    three fresh 160/160/156-token prompts beside 28 decodes at context 170-290 (T = 512, S = 32),
               the chat workload's mixed step

Timed per case: the scan with the write alone ("write only") and with write + attention for each
tree; attention = that - write only. Fastest of --rounds rounds, each running every program once in
turn (a busy machine slows all alike). The other tree's `pallas_kernels/xla_attention.py` and
`tiling.py` are loaded from its files as separate modules; both trees' outputs are compared.

    python scripts/bench_cpu_attention.py --before-tree /work/main [--rounds 7]
        [--cases d1 d4 d32 v4 v8 v4x2 p256 m512]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from jaxpaged.worker.runner_config import cpu_compiler_options  # noqa: E402
from pallas_kernels import xla_attention  # noqa: E402
from pallas_kernels.kv_write import write_kv_inner  # noqa: E402

LAYERS, KVH, GROUP, HEAD_DIM, PAGE = 30, 3, 3, 64, 16


def load_tree(tree: str):
    """The other checkout's xla_attention module, bound to its own tiling module."""
    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    root = pathlib.Path(tree) / "pallas_kernels"
    saved = sys.modules["pallas_kernels.tiling"]
    sys.modules["pallas_kernels.tiling"] = load("before_tiling", root / "tiling.py")
    try:
        return load("before_xla_attention", root / "xla_attention.py")
    finally:
        sys.modules["pallas_kernels.tiling"] = saved


def make_case(rng, q_lens, kv_lens, num_slots, num_tokens, num_pages=641, width=32):
    """Host arrays of one step: pages shuffled over the pool, slots of each sequence's last q_len positions."""
    table = np.zeros((num_slots, width), np.int32)
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    slots, used, tok = np.zeros(num_tokens, np.int32), 0, 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        pages = -(-kv_len // PAGE)
        table[i, :pages] = perm[used:used + pages]
        used += pages
        for pos in range(kv_len - q_len, kv_len):
            slots[tok] = table[i, pos // PAGE] * PAGE + pos % PAGE
            tok += 1
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    kv = np.zeros(num_slots, np.int32)
    kv[:len(kv_lens)] = kv_lens
    new = rng.standard_normal((num_tokens, KVH, HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((num_tokens, KVH * GROUP, HEAD_DIM)).astype(np.float32)
    return [q, new, new * 0.5, slots, kv, table, cu, np.int32(len(q_lens))], num_pages


def program(attention):
    """(q, pool k, pool v, new k, new v, slots, kv_lens, table, cu, num_seqs) -> (sum of outputs, pools)."""
    def prog(q, kp, vp, k_new, v_new, slots, kv_lens, table, cu, num_seqs):
        def body(carry, layer):
            kp, vp, acc = carry
            kp, vp = write_kv_inner(kp, vp, k_new + layer.astype(jnp.float32), v_new, slots, layer=layer)
            if attention is None:
                return (kp, vp, acc + q), None
            o = attention(q + 1e-6 * acc, kp, vp, kv_lens, table, cu, num_seqs, sm_scale=HEAD_DIM ** -0.5,
                          layer=layer, max_num_partial_prefills=4)
            return (kp, vp, acc + o), None
        (kp, vp, acc), _ = lax.scan(body, (kp, vp, jnp.zeros_like(q)), jnp.arange(LAYERS, dtype=jnp.int32))
        return acc, kp, vp
    return prog


def time_case(args, num_pages, programs, rounds):
    """{name: fastest ms}, and the largest |difference| between the attention programs' outputs."""
    shape = (LAYERS, KVH, num_pages, PAGE, HEAD_DIM)
    kp = jnp.asarray(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
    vp = kp * 0.5
    args = [jnp.asarray(a) for a in args]
    options = cpu_compiler_options(num_tokens=args[0].shape[0])  # the engine's, for a step of T tokens
    compiled = {name: jax.jit(program(fn), donate_argnums=(1, 2), compiler_options=options)
                .lower(args[0], kp, vp, *args[1:]).compile() for name, fn in programs.items()}
    times, outs = {name: [] for name in compiled}, {}
    for _ in range(rounds + 1):  # the first round warms up
        for name, fn in compiled.items():
            start = time.perf_counter()
            out, kp, vp = fn(args[0], kp, vp, *args[1:])
            jax.block_until_ready(out)
            times[name].append(1e3 * (time.perf_counter() - start))
            outs[name] = np.asarray(out)
    a, b = (outs[n] for n in programs if programs[n] is not None)
    return {name: min(t[1:]) for name, t in times.items()}, float(np.abs(a - b).max())


def cases(rng):
    ctx = list(rng.integers(150, 200, 32))
    return {
        "d1": ("decode 1", [1], [170], 1, 1),
        "d4": ("decode 4", [1] * 4, ctx[:4], 4, 4),
        "v4": ("verify 4", [4], [170], 4, 4),
        "v8": ("verify 8", [8], [170], 4, 8),
        "v4x2": ("verify 4 x 2 + 2 decodes", [4, 4, 1, 1], [170, 190, 160, 175], 4, 16),
        "d32": ("decode 32", [1] * 32, ctx, 32, 32),
        "p256": ("prefill 256", [160, 96], [160, 96], 4, 256),
        "m512": ("mixed 512", [160, 160, 156] + [1] * 28, [160, 160, 156] + list(rng.integers(170, 290, 28)), 32, 512),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-tree", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cases", nargs="+", default=["d1", "d4", "d32", "v4", "v8", "v4x2", "p256", "m512"])
    args = parser.parse_args(argv)
    before = load_tree(args.before_tree)
    programs = {"write only": None, "before": before.ragged_paged_attention_xla,
                "after": xla_attention.ragged_paged_attention_xla}
    print(f"jax {jax.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; 30-layer scan, "
          f"fastest of {args.rounds} interleaved rounds; before = {args.before_tree}, after = this tree\n")
    print("| case | write only ms | before: attention ms | after: attention ms | after / before | max diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, (name, q_lens, kv_lens, slots, tokens) in cases(np.random.default_rng(0)).items():
        if key not in args.cases:
            continue
        step, num_pages = make_case(np.random.default_rng(1), q_lens, kv_lens, slots, tokens)
        ms, diff = time_case(step, num_pages, programs, args.rounds)
        att = {n: ms[n] - ms["write only"] for n in ("before", "after")}
        print(f"| {name} | {ms['write only']:.1f} | {att['before']:.1f} | {att['after']:.1f} | "
              f"{att['after'] / att['before']:.2f} | {diff:.1e} |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a compiled step holds, read from XLA's program text: op counts, and per-layer weight copies.

The step should read each weight once, in place. A layer scan over stacked weights slices every
layer's weights out of the stack at run time (a dynamic slice, which XLA may materialise as a copy
before the gemm). `weight_copies` finds any instruction that produces a buffer the size of one
layer's weight matrix; `stablehlo_weight_slices` finds dynamic slices of that size in a lowering
(StableHLO, e.g. for CUDA lowered on a CPU). benchmarks/gpu_engine.py prints `op_counts` of each
compiled step; tests/test_weight_layout.py holds the chosen layouts to zero copies.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

# compiled HLO text: op -> pattern (one match per instruction)
OP_PATTERNS = {
    "copy": r"\scopy(?:-start)?\(",
    "dynamic-slice": r"\sdynamic-slice\(",
    "gemm": r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)"|__triton_gemm|"__ynn_fusion"',
    "dot": r"\sdot\(",
    "fusion": r"\sfusion\(",
    "while": r"\swhile\(",
    "call": r"\scall\(",  # a call XLA left in place (the engine's per-layer calls are inlined: expect 0)
}
# "%name = f32[1,64,2,6,16]{4,3,2,1,0} opcode(" -> dims, opcode
_INSTRUCTION = re.compile(r"=\s+\w+\[([\d,]*)\]\S*\s+([\w-]+)\(")
_VIEWS = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")  # no new buffer
_STABLEHLO_DYNAMIC_SLICE = re.compile(r"stablehlo\.dynamic_slice\b.*?sizes = \[([\d, ]+)\]")


def op_counts(hlo_text: str) -> dict[str, int]:
    """How many of each OP_PATTERNS op the program text holds (fused computations included)."""
    return {op: len(re.findall(pattern, hlo_text)) for op, pattern in OP_PATTERNS.items()}


def weight_sizes(layer_shapes: Iterable[tuple[int, ...]]) -> set[int]:
    """Element counts of one layer's weight matrices (arrays of 2 or more axes; norms and biases left out)."""
    return {math.prod(shape) for shape in layer_shapes if len(shape) >= 2}


def weight_copies(hlo_text: str, sizes: set[int]) -> list[str]:
    """Instructions of a compiled program that write a buffer of one layer's weight size (any op but a
    view: a dynamic slice, copy, transpose, fusion ...), i.e. a layer's weights read and written again."""
    found = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.search(line)
        if m and m.group(2) not in _VIEWS and math.prod(int(d) for d in m.group(1).split(",") if d) in sizes:
            found.append(line.strip())
    return found


def stablehlo_weight_slices(stablehlo_text: str, sizes: set[int]) -> list[str]:
    """stablehlo.dynamic_slice ops of a lowering whose slice has one layer's weight size."""
    found = []
    for line in stablehlo_text.splitlines():
        m = _STABLEHLO_DYNAMIC_SLICE.search(line)
        if m and math.prod(int(d) for d in m.group(1).split(",")) in sizes:
            found.append(line.strip())
    return found

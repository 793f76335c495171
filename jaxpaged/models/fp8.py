"""FP8 weight dots (`--quantization fp8`): weights as float8_e4m3fn with a float32 scale per output channel.

`quantize_params` turns the step's weight dots' weights (wqkv, wo, w_gate_up, w_down; the embedding and the
LM head stay as loaded, as in vLLM) into `Fp8Weight`s, and `weight_dots.dot_weight` hands those to `fp8_dot`, in
one of two forms (`Fp8Weight.gemm`, chosen per backend by runner_config.fp8_gemm):
  - gemm=True (a GPU with FP8 tensor cores, compute capability >= 8.9): x is quantised per token at run
    time (dynamic: each row's max |x| / 448) and the dot is dot_general(x8 [M, K], q [N, K]) on
    float8_e4m3fn operands with a float32 result, times both scales after it: the form XLA:GPU's gemm
    rewriter turns into a cuBLASLt FP8 gemm (its scaling a fused epilogue). q is held [N, K], K minor, as
    cuBLASLt's FP8 gemm wants both operands (no transposed copy of a weight per step).
  - gemm=False (weight-only: XLA:CPU, or a GPU without FP8 gemms): q upcast to x's dtype inside the dot's
    fusion, times the weight's scale after it; x stays as it is.
`reference_dot` is the independent, readable reference: the dequantised weight (q times its scale) as a
float32 matrix, and for gemm=True x rounded the same way, in a plain float32 matmul.

Shapes: a weight's 2-D view w [K, N] (wo: [H * D, E]; one layer's `shape` keeps its original trailing
axes, N = prod(shape[1:])); stacked layers add a leading L to q [L, N, K] and scale [L, N].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
QUANTIZED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")  # the fused layout's weight dots (not the LM head)


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A weight dot's weight in FP8. q: float8_e4m3fn [(L,) N, K], w's 2-D view transposed (output channels
    major); scale: float32 [(L,) N], w[k, n] ~ q[n, k] * scale[n]; shape: one layer's w shape [K, ...]
    (static); gemm: FP8 x FP8 dot with per-token activation scales, else weight-only (static)."""
    q: jax.Array
    scale: jax.Array
    shape: tuple[int, ...]
    gemm: bool

    def dot(self, x: jax.Array) -> jax.Array:
        """x [M, K] @ w -> float32 [M, N] (N = prod(shape[1:]))."""
        return fp8_dot(x, self.q, self.scale, self.gemm)


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["q", "scale"], meta_fields=["shape", "gemm"])


# Each output channel's scale is its largest |value| over one of these e4m3 values, whichever rounds the channel
# with the least squared error. 448 alone (the usual choice) re-rounds an FP8 checkpoint stored with one scale per
# tensor (its channels' largest q below 448) onto another grid; one of these is each such channel's largest q
# times a power of two (every e4m3 magnitude from 2^-6 up is one of them times 2^k), so such a channel's values
# come back as stored, and full-precision weights round no worse than with 448 alone.
SCALE_CANDIDATES = (448.0, 416.0, 384.0, 352.0, 320.0, 288.0, 256.0, 240.0)


def quantize_weight(w2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w2 [..., K, N] (float) -> (q float8_e4m3fn [..., N, K], scale f32 [..., N]): each output channel's
    scale its largest |value| / one of SCALE_CANDIDATES, the one with the least squared error (an all-zero
    channel gets scale 1)."""
    wt = jnp.swapaxes(w2, -1, -2).astype(jnp.float32)  # [..., N, K]
    amax = jnp.max(jnp.abs(wt), axis=-1)  # [..., N]
    best = None
    for top in SCALE_CANDIDATES:
        scale = jnp.where(amax > 0, amax / top, 1.0)
        q = jnp.clip(wt / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
        err = jnp.sum(jnp.square(q.astype(jnp.float32) * scale[..., None] - wt), axis=-1)  # [..., N]
        if best is None:
            best = (q, scale, err)
            continue
        better = err < best[2]
        best = (jnp.where(better[..., None], q, best[0]), jnp.where(better, scale, best[1]),
                jnp.minimum(err, best[2]))
    return best[0], best[1]


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (x8 float8_e4m3fn [M, K], scale f32 [M, 1]): per token, largest |value| at FP8_MAX (an
    all-zero row, e.g. padding, gets scale 1)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(x32 / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


_CONTRACT_K = (((1,), (1,)), ((), ()))  # x [M, K] . q [N, K] -> [M, N]


def fp8_dot(x: jax.Array, q: jax.Array, scale: jax.Array, gemm: bool) -> jax.Array:
    """x [M, K] times the weight (q f8 [N, K], scale f32 [N]) -> float32 [M, N] (module docstring)."""
    if gemm:
        x8, x_scale = quantize_rows(x)
        y = jax.lax.dot_general(x8, q, _CONTRACT_K, preferred_element_type=jnp.float32)
        return y * x_scale * scale
    y = jax.lax.dot_general(x, q.astype(x.dtype), _CONTRACT_K, preferred_element_type=jnp.float32)
    return y * scale


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """The float32 weight w [..., K, N] an FP8 weight stands for (reference and tests)."""
    return jnp.swapaxes(q.astype(jnp.float32) * scale[..., None], -1, -2)


def reference_dot(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """fp8_dot's result as a plain float32 matmul of dequantised operands: x rounded per token first when
    w.gemm (the FP8 gemm's input), as it is otherwise."""
    x32 = x.astype(jnp.float32)
    if w.gemm:
        x8, x_scale = quantize_rows(x)
        x32 = x8.astype(jnp.float32) * x_scale
    return jnp.matmul(x32, dequantize(w.q, w.scale), precision=jax.lax.Precision.HIGHEST)


def quantizer(gemm: bool) -> Callable[[jax.Array, tuple[int, ...]], Fp8Weight]:
    """A `weight_dots.pack_weights` packer: a weight's 2-D view w2 [(L,) K, N] and one layer's shape -> Fp8Weight."""
    quantize = jax.jit(quantize_weight)

    def pack(w2: jax.Array, shape: tuple[int, ...]) -> Fp8Weight:
        q, scale = quantize(w2)
        return Fp8Weight(q, scale, tuple(shape), gemm)

    return pack


def quantize_params(params, gemm: bool, *, consume: bool = False):
    """Params (any weight layout, fused projections) with the weight dots' weights (QUANTIZED_WEIGHTS) as
    Fp8Weights, quantised on the device one weight at a time; the embedding, norms and LM head as they are.
    consume=True deletes each source weight once quantised (device memory then peaks at the weights plus one
    weight's float32 temporaries). Params quantised already come back as they are."""
    # weight_dots.py imports Fp8Weight from here for its dots: its packer is imported at the call
    from jaxpaged.models.weight_dots import pack_weights  # pylint: disable=import-outside-toplevel
    layers = params["layers"]
    first = layers[0] if isinstance(layers, (list, tuple)) else layers
    if isinstance(first.get("wqkv"), Fp8Weight):  # quantised already (the engine's, before sizing the KV pool)
        return params
    names = set(first)
    if not names.issuperset(QUANTIZED_WEIGHTS):
        raise ValueError(f"quantization 'fp8' quantises the fused projections {QUANTIZED_WEIGHTS}; these params "
                         f"hold {sorted(names)} (use fuse_projections=True)")
    head = {k: params[k] for k in ("lm_head",) if k in params}
    out = pack_weights({k: v for k, v in params.items() if k != "lm_head"}, quantizer(gemm), consume=consume)
    return {**out, **head}

"""The weight dots' forms: how a layer's x [T, E] @ w [E, ...] runs (einsum, a step's own `Matmul`, a
`PackedWeight`'s product, an `Fp8Weight`'s), and `pack_weights`, which puts params' dot weights in packed form.

The model's math (jaxpaged/models/llama.py) calls `dot_weight` for every weight dot; which form a weight has is
the engine's choice (jaxpaged/worker/step_program.py packs for the native CPU matmul, --quantization fp8 gives
`Fp8Weight`s, jaxpaged/models/fp8.py). Letters as in llama.py: T tokens, E hidden, L layers, M/K/N a 2-D product's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpaged.models.fp8 import Fp8Weight


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight dot's w [K, ...] held in a layout only its own product reads (the paged engine on CPU: the
    native matmul's contiguous column blocks, `pack_weights`). data: that layout, for one layer or (stacked
    layers) every layer on a leading L axis; shape: one layer's w's 2-D-viewable shape [K, ...] (wo's is
    [H * D, E]); dot: fn(x [M, K], data, layer, scale, rows) -> [M, prod(shape[1:])] (static); layer: which
    layer of stacked data the product reads (int32 scalar; None for one layer's data); scale: weight-only
    int8's scales (data then holds the int8 values; pallas_kernels/cpu_matmul.py), None for float weights;
    rows: how many of x's first rows the product computes (int32 scalar: a padded step's real tokens, the
    other rows' products are zeros; None: all). A layer scan hands each step the whole stack with its
    layer (`at_layer`), so no weight is sliced out of the stack."""
    data: jax.Array
    shape: tuple[int, ...]
    dot: Callable[..., jax.Array]
    layer: jax.Array | None = None
    scale: jax.Array | None = None
    rows: jax.Array | None = None

    def at_layer(self, layer: jax.Array) -> PackedWeight:
        """Stacked data read at `layer` (a traced int32 scalar inside a scan)."""
        return dataclasses.replace(self, layer=layer)


jax.tree_util.register_dataclass(PackedWeight, data_fields=["data", "layer", "scale", "rows"],
                                 meta_fields=["shape", "dot"])


def with_live_rows(tree, rows: jax.Array):
    """`tree` (params or part of them) with each PackedWeight's product limited to x's first `rows` rows
    (int32 scalar): a padded step's real tokens, so padding costs its weight dots nothing."""
    return jax.tree.map(lambda w: dataclasses.replace(w, rows=rows) if isinstance(w, PackedWeight) else w, tree,
                        is_leaf=lambda w: isinstance(w, PackedWeight))


def dot_view(name: str, w, num_lead: int = 0):
    """A weight dot's weight (`num_lead` stacking axes, then one layer's shape) as its 2-D view [(L,) K, N]:
    wo [H, D, E] -> [H * D, E], the others [E, ...] -> [E, the rest] (numpy or jax arrays alike)."""
    lead = w.shape[:num_lead]
    return w.reshape(*lead, -1, w.shape[-1]) if name == "wo" else w.reshape(*lead, w.shape[num_lead], -1)


def pack_weights(params: dict[str, Any], pack: Callable[[jax.Array, tuple[int, ...]], PackedWeight | None], *,
                 consume: bool = False) -> dict[str, Any]:
    """Params with each weight dot's weight (wqkv, wo, w_gate_up, w_down, lm_head) as `pack(w2, shape)`
    of its 2-D view w2 [K, N] and one layer's shape (wo: both [H * D, E]) where that is not None; the rest
    as it is. Stacked layers ({name: [L, ...]}) pack as stacked views w2 [L, K, N] (`pack` returns stacked
    data), per-layer ones one layer at a time. consume=True deletes each source array once packed (the
    caller's params become unusable)."""

    def one(name: str, w, stacked: bool = False):
        if isinstance(w, PackedWeight):
            return w
        lead = w.shape[:1] if stacked else ()
        view = dot_view(name, w, len(lead))
        packed = pack(view, view.shape[len(lead):] if name == "wo" else w.shape[len(lead):])
        if packed is None:
            return w
        if consume and not w.is_deleted():
            w.delete()
        return packed

    if isinstance(params["layers"], (list, tuple)):
        layers = [{name: one(name, w) if name in PACKED_WEIGHTS else w for name, w in layer.items()}
                  for layer in params["layers"]]
    else:
        layers = {name: one(name, w, stacked=True) if name in PACKED_WEIGHTS else w
                  for name, w in params["layers"].items()}
    out = dict(params, layers=layers)
    if "lm_head" in params:
        out["lm_head"] = one("lm_head", params["lm_head"])
    return out


PACKED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")  # the layer weights `pack_weights` packs


class Matmul(NamedTuple):
    """A step's own 2-D product for its weight dots (the paged engine's native CPU matmul): fn(x [M, K],
    w [K, N]) -> [M, N], used where takes(x, w); elsewhere, and without one, the einsums as written."""
    fn: Callable[[jax.Array, jax.Array], jax.Array]
    takes: Callable[[jax.Array, jax.Array], bool]
    # batch-invariant mode: x [..., E] -> sums over E [..., 1], each row in one order at any row count (the
    # norms' reductions; `rms_norm`); None: XLA's
    row_sums: Callable[[jax.Array], jax.Array] | None = None
    # x [M, E] @ embed [V, E] transposed -> [M, V]: a tied LM head's product on the step's own GEMM
    # (batch-invariant mode on a GPU, jaxpaged/worker/invariant_dots.py); None: XLA's einsum
    fn_t: Callable[[jax.Array, jax.Array], jax.Array] | None = None


def dot_weight(x: jax.Array, w: jax.Array, matmul: Matmul | None, spec: str,
               preferred_element_type=None) -> jax.Array:
    """x [T, E] @ w [E, ...] -> [T, ...]: a PackedWeight's own product; else matmul on w's 2-D view (a free
    reshape) if it takes the shapes, else jnp.einsum(spec, x, w); in preferred_element_type (default x's). An
    Fp8Weight (--quantization fp8) runs its own FP8 or weight-only dot (jaxpaged/models/fp8.py)."""
    if isinstance(w, Fp8Weight):
        y = w.dot(x.reshape(-1, x.shape[-1])).astype(preferred_element_type or x.dtype)
        return y.reshape(*x.shape[:-1], *w.shape[1:])
    if isinstance(w, PackedWeight):
        y = w.dot(x.reshape(-1, x.shape[-1]), w.data, w.layer, w.scale, w.rows)
        y = y.astype(preferred_element_type or x.dtype)
        return y.reshape(*x.shape[:-1], *w.shape[1:])
    if matmul is not None and x.ndim == 2:
        w2 = w.reshape(w.shape[0], -1)
        if matmul.takes(x, w2):
            y = matmul.fn(x, w2).astype(preferred_element_type or x.dtype)
            return y.reshape(x.shape[0], *w.shape[1:])
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)


"""The params pytree's shapes and layouts: `param_shapes` (the checkpoint layout of jaxpaged/models/llama.py's
docstring, or fused), `WeightLayout` (how the engine's step holds the layers), the fusions `fuse_qkv` and
`fuse_gate_up`, `unstack_layers`, and `init_params` (random params for tests and benchmarks).

Converting a loaded model between layouts is jaxpaged/worker/weight_layout.py's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpaged.models.llama import LlamaConfig, Params

UNFUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}  # fused name -> the checkpoint's


def param_shapes(config: LlamaConfig, fused: bool = False) -> Params:
    """Shapes of the params pytree, stacked layers (jaxpaged/models/llama.py's docstring); fused: wqkv, w_gate_up."""
    c = config
    e, h, k, d, f, n = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, \
        c.intermediate_size, c.num_hidden_layers
    shapes: Params = {
        "embed": (c.vocab_size, e),
        "layers": {
            "attn_norm": (n, e), "wq": (n, e, h, d), "wk": (n, e, k, d), "wv": (n, e, k, d),
            "wo": (n, h, d, e), "mlp_norm": (n, e), "w_gate": (n, e, f), "w_up": (n, e, f),
            "w_down": (n, f, e),
        },
        "final_norm": (e,),
    }
    if c.attention_bias:
        shapes["layers"].update(bq=(n, h, d), bk=(n, k, d), bv=(n, k, d))
    if c.qk_norm:
        shapes["layers"].update(q_norm=(n, d), k_norm=(n, d))
    if c.sandwich_norms:
        shapes["layers"].update(post_attn_norm=(n, e), post_mlp_norm=(n, e))
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (e, c.vocab_size)
    if fused:
        layers = {name: shape for name, shape in shapes["layers"].items() if name not in sum(UNFUSED.values(), ())}
        shapes["layers"] = dict(layers, wqkv=(n, e, k, h // k + 2, d), w_gate_up=(n, e, 2, f))
    return shapes


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How the engine's step holds the layer weights (jaxpaged/models/llama.py's docstring).

    per_layer: "layers" is a list of L per-layer dicts, not {name: [L, ...]} scanned over. A scan
        slices each layer's weights out of the stack at run time; XLA:GPU may copy a slice before
        its gemm (each weight crossing HBM three times). Costs compile time (L layers compiled).
    fused: wqkv and w_gate_up instead of wq/wk/wv and w_gate/w_up (one gemm each, wider N).
    WeightLayout() is the checkpoint layout.
    """

    per_layer: bool = False
    fused: bool = False

    @classmethod
    def of(cls, params: Params) -> WeightLayout:
        layers = params["layers"]
        per_layer = isinstance(layers, (list, tuple))
        return cls(per_layer=per_layer, fused="wqkv" in (layers[0] if per_layer else layers))


def fuse_qkv(config: LlamaConfig, wq: jax.Array, wk: jax.Array, wv: jax.Array, xp=jnp) -> jax.Array:
    """wq [..., E, H, D], wk/wv [..., E, K, D] -> wqkv [..., E, K, G + 2, D] (stacked or one layer), with
    jax.numpy or numpy (`xp`: live weight updates fuse on the host)."""
    *lead, e, _, d = wq.shape
    q = wq.reshape(*lead, e, config.num_key_value_heads, config.num_queries_per_kv, d)  # h = k * G + g
    return xp.concatenate([q, wk[..., None, :], wv[..., None, :]], axis=-2)


def fuse_gate_up(w_gate: jax.Array, w_up: jax.Array, xp=jnp) -> jax.Array:
    """w_gate, w_up [..., E, F] -> w_gate_up [..., E, 2, F] (`xp`: as fuse_qkv's)."""
    return xp.stack([w_gate, w_up], axis=-2)


def unstack_layers(params: Params) -> Params:
    """The same params with "layers" as a list of per-layer dicts (copies every layer weight).

    The engine's step takes either layout (jaxpaged.worker.model_runner.paged_forward): stacked layers are
    scanned, per-layer ones looped over, so no weight is sliced out of a stack."""
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    return dict(params, layers=[jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)])


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random params (normal, std 0.02; norms the identity) for tests and benchmarks."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    arrays = [
        jnp.full(shape, 1.0 - config.norm_weight_offset, dtype) if "norm" in path else (0.02 * jax.random.normal(k, shape)).astype(dtype)
        for path, shape, k in zip(paths, leaves, keys)
    ]
    return jax.tree.unflatten(treedef, arrays)


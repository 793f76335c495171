"""The decoder-only transformer in JAX: Llama and the families that differ from it in data.

Llama 2/3/3.1/3.2, SmolLM2, Mistral, Qwen2/2.5, Qwen3 and Gemma 3 (text) share one
decoder layer; what sets a family apart is a handful of `LlamaConfig` fields
(q/k/v biases, q/k norms, (1 + w) norms, sandwich norms, GeGLU, scaled embeddings,
query_pre_attn_scalar, per-layer sliding windows and RoPE bases). Which family a
checkpoint is, and how its tensors are named, lives in `jaxpaged/models/registry.py`.

The math lives in pure functions of an explicit params pytree, so the paged
engine and the plain forward share every line of it; `Llama` is the NNX module
researchers hold (`logits = model(token_ids)`), split into graph and state for
jitted use.

Params pytree (layer weights stacked on a leading L axis, scanned over):
    embed       [V, E]
    layers:
      attn_norm [L, E]        mlp_norm [L, E]
      wq        [L, E, H, D]  wk, wv   [L, E, K, D]   wo [L, H, D, E]
      w_gate    [L, E, F]     w_up     [L, E, F]      w_down [L, F, E]
      bq [L, H, D], bk/bv [L, K, D]                  (attention_bias: Qwen2)
      q_norm, k_norm [L, D]                          (qk_norm: Qwen3, Gemma 3)
      post_attn_norm, post_mlp_norm [L, E]           (sandwich_norms: Gemma 3)
    final_norm  [E]
    lm_head     [E, V]        (absent when the embeddings are tied)
That is the checkpoint layout (loaders, converters and `forward` use it). The engine's step may hold
the layers another way (`WeightLayout` in jaxpaged/models/params.py, `to_weight_layout`): projections sharing
an input fused,
    wqkv      [L, E, K, G + 2, D]  per kv head: its G query heads, then its k and its v
    w_gate_up [L, E, 2, F]         gate, then up
(replacing wq/wk/wv and w_gate/w_up: one gemm each), and/or "layers" as a list of L per-layer dicts
(no weight is sliced out of a stack at run time). `decoder_layer` takes every layout. On CPU the engine's
runner also holds the weight dots' weights as `PackedWeight`s (jaxpaged/models/weight_dots.py: the native matmul's
contiguous column blocks), which `dot_weight` hands to their own product; with --quantization fp8 they are
`Fp8Weight`s (jaxpaged/models/fp8.py: float8_e4m3fn [N, K] and a scale per output channel), likewise.
Letters: B batch, T/S query/key tokens, E hidden, H query heads, K kv heads,
G = H // K query heads per kv head, D head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.fp8 import Fp8Weight
from jaxpaged.models.weight_dots import Matmul, PackedWeight, dot_weight

Params = dict[str, Any]


class UnsupportedModelError(ValueError):
    """A checkpoint asks for something this implementation does not do."""


HIDDEN_ACTS = ("silu", "gelu_tanh")  # SwiGLU (Llama, Qwen, Mistral), GeGLU with tanh GELU (Gemma)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise UnsupportedModelError(f"rope_scaling: invalid llama3 parameters {self}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # llama.cpp's per-frequency divisors (GGUF)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Family differences (defaults: Llama). See jaxpaged/models/registry.py for who sets what.
    architecture: str = "llama"            # registry family name
    attention_bias: bool = False           # q/k/v projections have biases (Qwen2)
    qk_norm: bool = False                  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    norm_weight_offset: float = 0.0        # RMSNorm scales by (offset + w): Gemma's 1 + w
    scale_embeddings: bool = False         # embeddings times sqrt(hidden_size) (Gemma)
    hidden_act: str = "silu"               # MLP gate activation, one of HIDDEN_ACTS
    sandwich_norms: bool = False           # norms after attention and after the MLP too (Gemma 3)
    query_pre_attn_scalar: float | None = None  # softmax scale scalar**-0.5 instead of head_dim**-0.5
    rope_linear_factor: float = 1.0        # linear RoPE scaling (positions / factor), global layers
    sliding_window: int | None = None      # keys p - W < k <= p for windowed layers
    layer_windowed: tuple[bool, ...] | None = None  # which layers use the window (None: all, if any)
    local_rope_theta: float | None = None  # RoPE base of windowed layers (Gemma 3), no scaling

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise UnsupportedModelError(f"config.{name}={getattr(self, name)!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"config.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"config.head_dim={self.head_dim} must be even for RoPE")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise UnsupportedModelError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                                        f"head_dim={self.head_dim} needs {self.head_dim // 2}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise UnsupportedModelError(f"hidden_act={self.hidden_act!r}: supported {HIDDEN_ACTS}")
        if self.sliding_window is not None and int(self.sliding_window) <= 0:
            raise UnsupportedModelError(f"sliding_window={self.sliding_window!r} must be a positive integer")
        if self.layer_windowed is not None and len(self.layer_windowed) != self.num_hidden_layers:
            raise UnsupportedModelError(f"layer_windowed has {len(self.layer_windowed)} entries for "
                                        f"{self.num_hidden_layers} layers")
        if self.rope_linear_factor <= 0:
            raise UnsupportedModelError(f"rope_linear_factor={self.rope_linear_factor} must be > 0")

    @property
    def windowed_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend through the sliding window?"""
        if self.sliding_window is None:
            return (False,) * self.num_hidden_layers
        return self.layer_windowed if self.layer_windowed is not None else (True,) * self.num_hidden_layers

    @property
    def has_sliding_window(self) -> bool:
        return any(self.windowed_layers)

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer windowed: KV older than the window is never read again (pages can be freed)."""
        return all(self.windowed_layers)

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict (any registered family), rejecting what we
        do not support."""
        from jaxpaged.models import registry  # pylint: disable=import-outside-toplevel
        return registry.config_from_hf(hf)


# ----------------------------------------------------------------------------- math


def rope_inv_freq(config: LlamaConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [D/2] (float32), with llama3/linear scaling when configured.

    local=True: a windowed layer's, which has its own base (local_rope_theta) and no scaling."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    if local and config.local_rope_theta is not None:
        return (1.0 / (config.local_rope_theta ** exponents)).astype(np.float32)
    inv_freq = 1.0 / (config.rope_theta ** exponents) / config.rope_linear_factor
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def layer_constants(config: LlamaConfig) -> dict[str, jax.Array]:
    """Per-layer data scanned with the weights: window int32 [L] (0 = global) and rope int32 [L], the row of
    `rope_frequencies(config)` (and of the `rope_tables` made from it) that is the layer's RoPE.

    Arrays, not Python branches, so mixed local/global stacks run in one scan."""
    window = np.asarray([config.sliding_window if w else 0 for w in config.windowed_layers], np.int32)
    return {"window": jnp.asarray(window), "rope": jnp.asarray(_rope_rows(config)[1])}


def rope_frequencies(config: LlamaConfig) -> jax.Array:
    """f32[U, D/2]: the stack's distinct RoPE inverse frequencies (U = 1, or 2 with windowed layers)."""
    return jnp.asarray(_rope_rows(config)[0])


def _rope_rows(config: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """(f32[U, D/2] distinct inverse frequencies, i32[L] each layer's row of them)."""
    per_layer = np.stack([rope_inv_freq(config, local=w) for w in config.windowed_layers])  # f32[L, D/2]
    distinct, index = np.unique(per_layer, axis=0, return_inverse=True)
    return distinct, index.reshape(-1).astype(np.int32)


def rope_tables(config: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[U, T, D] of positions i32[T] under each of `rope_frequencies(config)`; a layer reads its
    row (`layer_constants`' rope). pallas_kernels.cpu_rope makes the same tables as one native call."""
    freqs = positions.astype(jnp.float32)[..., None] * rope_frequencies(config)[:, None, :]  # [U, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (Hugging Face layout) on x [..., T, N, D]; cos/sin [..., T, D]."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0,
             row_sums: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """RMSNorm over the last axis, scaled by (offset + weight): Llama's w, Gemma's 1 + w (in f32). row_sums:
    x [..., E] -> its sums over E [..., 1] in one order per row whatever the row count (batch-invariant mode,
    `Matmul.row_sums`; XLA:CPU's reduction changes its order with the number of rows); None: jnp.mean."""
    x32 = x.astype(jnp.float32)
    if row_sums is None:
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    else:  # sqrt and division are correctly rounded in XLA:CPU's vector and scalar code alike, but x / sqrt(y)
        # becomes x * rsqrt(y), whose vector form (rows in lanes) rounds otherwise than the scalar one: the
        # barrier keeps the sqrt a value of its own
        root = jax.lax.optimization_barrier(jnp.sqrt(row_sums(x32 * x32) / np.float32(x.shape[-1]) + eps))
        normed = x32 / root
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def norm(config: LlamaConfig, x: jax.Array, weight: jax.Array, matmul: Matmul | None = None) -> jax.Array:
    return rms_norm(x, weight, config.rms_norm_eps, config.norm_weight_offset,
                    None if matmul is None else matmul.row_sums)


def mlp(p: Params, x: jax.Array, hidden_act: str = "silu", matmul: Matmul | None = None) -> jax.Array:
    """Gated MLP: SwiGLU (silu) or GeGLU (gelu_tanh); gate and up as one gemm when fused."""
    if "w_gate_up" in p:
        gate_up = dot_weight(x, p["w_gate_up"], matmul, "...e,eyf->...yf")  # [..., 2, F]
        gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    else:
        gate = jnp.einsum("...e,ef->...f", x, p["w_gate"])
        up = jnp.einsum("...e,ef->...f", x, p["w_up"])
    act = jax.nn.silu(gate) if hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    return dot_weight(act * up, p["w_down"], matmul, "...f,fe->...e")


# attend(q [..., T, H, D], k [..., T, K, D], v) -> (out [..., T, H, D], aux): the one
# place where the plain forward and the paged engine differ.
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def decoder_layer(config: LlamaConfig, p: Params, h: jax.Array, cos: jax.Array, sin: jax.Array,
                  attend: AttendFn, matmul: Matmul | None = None) -> tuple[jax.Array, Any]:
    """One pre-norm block on h [..., T, E]; p holds one layer's weights (no L axis).

    The optional pieces (biases, q/k norms, sandwich norms) follow the config's family fields."""
    x = norm(config, h, p["attn_norm"], matmul)
    q, k, v = project_qkv(config, p, x, matmul)
    if config.attention_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if config.qk_norm:
        q, k = norm(config, q, p["q_norm"], matmul), norm(config, k, p["k_norm"], matmul)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, aux = attend(q, k, v)
    a = project_out(o.astype(h.dtype), p["wo"], matmul)
    if config.sandwich_norms:
        a = norm(config, a, p["post_attn_norm"], matmul)
    h = h + a
    m = mlp(p, norm(config, h, p["mlp_norm"], matmul), config.hidden_act, matmul)
    if config.sandwich_norms:
        m = norm(config, m, p["post_mlp_norm"], matmul)
    return h + m, aux


def project_qkv(config: LlamaConfig, p: Params, x: jax.Array,
                matmul: Matmul | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., T, E] -> q [..., T, H, D], k and v [..., T, K, D]: one gemm when fused (wqkv)."""
    if "wqkv" not in p:
        return (jnp.einsum("...te,ehd->...thd", x, p["wq"]), jnp.einsum("...te,ekd->...tkd", x, p["wk"]),
                jnp.einsum("...te,ekd->...tkd", x, p["wv"]))
    return split_qkv(config, dot_weight(x, p["wqkv"], matmul, "...te,ekgd->...tkgd"))


def split_qkv(config: LlamaConfig, qkv) -> tuple[Any, Any, Any]:
    """qkv [..., K, G + 2, D] (wqkv's layout: per kv head its G query heads, then its k and its v) -> q [..., H, D],
    k and v [..., K, D]: a fused projection's output, or the fused weight itself (params.fuse_qkv undone)."""
    g = config.num_queries_per_kv
    q = qkv[..., :g, :].reshape(*qkv.shape[:-3], config.num_attention_heads, config.head_dim)  # h = k * G + g
    return q, qkv[..., g, :], qkv[..., g + 1, :]


def project_out(o: jax.Array, wo: jax.Array, matmul: Matmul | None = None) -> jax.Array:
    """o [..., T, H, D] @ wo [H, D, E] -> [..., T, E], as one [T, H*D] x [H*D, E] matmul: the 2-D operands pin
    the layouts, so XLA reshapes the (small) attention output, never the weight (XLA:CPU transposed wo
    into a copy every step when handed the 3-D contraction)."""
    hd = o.shape[-2] * o.shape[-1]
    # packed or FP8: already [H * D, E]
    w2 = wo if isinstance(wo, (PackedWeight, Fp8Weight)) else wo.reshape(hd, wo.shape[-1])
    return dot_weight(o.reshape(*o.shape[:-2], hd), w2, matmul, "...tn,ne->...te")


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, sm_scale: float,
                     window: jax.Array | int = 0) -> jax.Array:
    """Causal GQA attention, q [B, T, H, D], k/v [B, T, K, D] -> [B, T, H, D]; softmax in f32.

    window > 0: query t sees keys t - window < s <= t (may be traced; 0 = no window)."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, h // kv_heads, d)  # [B, T, K, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    qpos, kpos = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    mask = (kpos <= qpos) & ((window <= 0) | (kpos > qpos - window))  # [T, S]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def embed_tokens(params: Params, token_ids: jax.Array, config: LlamaConfig | None = None) -> jax.Array:
    """Embedding rows [..., E]; Gemma scales them by sqrt(hidden_size) (rounded to their dtype)."""
    h = jnp.take(params["embed"], token_ids, axis=0)
    if config is not None and config.scale_embeddings:
        h = h * jnp.asarray(math.sqrt(config.hidden_size), h.dtype)
    return h


def lm_logits(config: LlamaConfig, params: Params, h: jax.Array, matmul: Matmul | None = None) -> jax.Array:
    """Final norm and LM head: h [..., E] -> logits [..., V] in float32.

    The head is params["lm_head"] [E, V] when present (an untied model's, or a tied one's embedding
    transposed by `untie_lm_head`), else the tied embedding [V, E]."""
    x = norm(config, h, params["final_norm"], matmul)
    if "lm_head" in params:
        return dot_weight(x, params["lm_head"], matmul, "...e,ev->...v", preferred_element_type=jnp.float32)
    if not config.tie_word_embeddings:
        raise KeyError("params lack lm_head (the model's embeddings are not tied)")
    if matmul is not None and matmul.fn_t is not None and x.ndim == 2:
        return matmul.fn_t(x, params["embed"]).astype(jnp.float32)
    return jnp.einsum("...e,ve->...v", x, params["embed"], preferred_element_type=jnp.float32)


def untie_lm_head(config: LlamaConfig, params: Params) -> Params:
    """Tied-embedding params with the LM head also held as its own [E, V] array (the embedding
    transposed; V x E more memory): the head's dot then contracts the head's major axis, which XLA:CPU
    runs several times faster at one row than the [V, E] embedding's minor axis (docs/performance.md,
    "Which knobs matter"). Other params come back unchanged. The logits are the same dot."""
    if not config.tie_word_embeddings or "lm_head" in params:
        return params
    return dict(params, lm_head=jnp.transpose(params["embed"]))


def forward(config: LlamaConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    """Plain full-causal forward: token_ids [B, T] -> logits [B, T, V] (float32). params["layers"] is the
    stack ({name: [L, ...]}, scanned) or a list of L per-layer dicts (the engine's layout on CPU and GPU,
    jaxpaged/worker/weight_layout.py)."""
    positions = jnp.arange(token_ids.shape[-1], dtype=jnp.int32)
    cos_table, sin_table = rope_tables(config, positions)  # [U, T, D]

    def body(h, xs):
        layer_params, consts = xs
        cos, sin = cos_table[consts["rope"]], sin_table[consts["rope"]]  # [T, D]: this layer's RoPE base

        def attend(q, k, v):
            return causal_attention(q, k, v, config.attn_scale, consts["window"]), None

        h, _ = decoder_layer(config, layer_params, h, cos, sin, attend)
        return h, None

    h, consts = embed_tokens(params, token_ids, config), layer_constants(config)
    if isinstance(params["layers"], (list, tuple)):
        for i, layer_params in enumerate(params["layers"]):
            h, _ = body(h, (layer_params, jax.tree.map(lambda x, i=i: x[i], consts)))
    else:
        h, _ = jax.lax.scan(body, h, (params["layers"], consts))
    return lm_logits(config, params, h)


forward_jit = jax.jit(forward, static_argnums=0)


# ----------------------------------------------------------------------------- NNX module


def __getattr__(name: str):
    """`Llama` and `LlamaLayers` live in jaxpaged/models/llama_nnx.py, imported on first use: Flax
    (with flax.linen) costs ~0.5 s of every start, and the engine never needs it."""
    if name in ("Llama", "LlamaLayers"):
        from jaxpaged.models import llama_nnx  # pylint: disable=import-outside-toplevel
        return getattr(llama_nnx, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

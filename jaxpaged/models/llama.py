"""The Llama family (Llama 2/3/3.1/3.2, SmolLM2) in JAX, with a Flax NNX front.

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
    final_norm  [E]
    lm_head     [E, V]        (absent when the embeddings are tied)
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

Params = dict[str, Any]


class UnsupportedModelError(ValueError):
    """A checkpoint asks for something this Llama implementation does not do."""


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

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict, rejecting what we do not support."""
        _check_supported(hf)
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        theta, scaling = _rope_from_hf(hf)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _check_supported(hf: Mapping[str, Any]) -> None:
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type != "llama" or any(a != "LlamaForCausalLM" for a in architectures):
        raise UnsupportedModelError(
            f"config.model_type={model_type!r}, architectures={architectures!r}: jaxpaged supports only "
            "the Llama family (model_type 'llama', LlamaForCausalLM)")
    refusals = {
        "attention_bias": lambda v: bool(v),
        "mlp_bias": lambda v: bool(v),
        "sliding_window": lambda v: v is not None,
        "hidden_act": lambda v: v not in ("silu", "swish"),
        "pretraining_tp": lambda v: v not in (None, 1),
    }
    for field, refused in refusals.items():
        if field in hf and refused(hf[field]):
            raise UnsupportedModelError(f"config.{field}={hf[field]!r} is not supported by jaxpaged's Llama")


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"config.rope_scaling type {rope_type!r} is not supported (supported: default, llama3)")
    return theta, Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


# ----------------------------------------------------------------------------- math


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [D/2] (float32), with llama3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
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


def rope_cos_sin(config: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., T, D] (float32) for integer positions [..., T]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))  # [..., T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (Hugging Face layout) on x [..., T, N, D]; cos/sin [..., T, D]."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def mlp(p: Params, x: jax.Array) -> jax.Array:
    gate = jnp.einsum("...e,ef->...f", x, p["w_gate"])
    up = jnp.einsum("...e,ef->...f", x, p["w_up"])
    return jnp.einsum("...f,fe->...e", jax.nn.silu(gate) * up, p["w_down"])


# attend(q [..., T, H, D], k [..., T, K, D], v) -> (out [..., T, H, D], aux): the one
# place where the plain forward and the paged engine differ.
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def decoder_layer(config: LlamaConfig, p: Params, h: jax.Array, cos: jax.Array, sin: jax.Array,
                  attend: AttendFn) -> tuple[jax.Array, Any]:
    """One pre-norm Llama block on h [..., T, E]; p holds one layer's weights (no L axis)."""
    x = rms_norm(h, p["attn_norm"], config.rms_norm_eps)
    q = jnp.einsum("...te,ehd->...thd", x, p["wq"])  # [..., T, H, D]
    k = jnp.einsum("...te,ekd->...tkd", x, p["wk"])  # [..., T, K, D]
    v = jnp.einsum("...te,ekd->...tkd", x, p["wv"])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, aux = attend(q, k, v)
    h = h + jnp.einsum("...thd,hde->...te", o.astype(h.dtype), p["wo"])
    h = h + mlp(p, rms_norm(h, p["mlp_norm"], config.rms_norm_eps))
    return h, aux


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, sm_scale: float) -> jax.Array:
    """Full causal GQA attention, q [B, T, H, D], k/v [B, T, K, D] -> [B, T, H, D]; softmax in f32."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, h // kv_heads, d)  # [B, T, K, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def embed_tokens(params: Params, token_ids: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], token_ids, axis=0)


def lm_logits(config: LlamaConfig, params: Params, h: jax.Array) -> jax.Array:
    """Final norm and LM head: h [..., E] -> logits [..., V] in float32."""
    x = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    if config.tie_word_embeddings:
        return jnp.einsum("...e,ve->...v", x, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("...e,ev->...v", x, params["lm_head"], preferred_element_type=jnp.float32)


def forward(config: LlamaConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    """Plain full-causal forward: token_ids [B, T] -> logits [B, T, V] (float32)."""
    positions = jnp.arange(token_ids.shape[-1], dtype=jnp.int32)
    cos, sin = rope_cos_sin(config, positions)  # [T, D]
    sm_scale = 1.0 / math.sqrt(config.head_dim)

    def attend(q, k, v):
        return causal_attention(q, k, v, sm_scale), None

    def body(h, layer_params):
        h, _ = decoder_layer(config, layer_params, h, cos, sin, attend)
        return h, None

    h, _ = jax.lax.scan(body, embed_tokens(params, token_ids), params["layers"])
    return lm_logits(config, params, h)


forward_jit = jax.jit(forward, static_argnums=0)


# ----------------------------------------------------------------------------- params


def param_shapes(config: LlamaConfig) -> Params:
    """Shapes of the params pytree (see the module docstring)."""
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
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (e, c.vocab_size)
    return shapes


def unstack_layers(params: Params) -> Params:
    """The same params with "layers" as a list of per-layer dicts (copies every layer weight).

    The engine's step takes either layout (jaxpaged.model_runner.paged_forward): stacked layers are
    scanned, per-layer ones looped over, so no weight is sliced out of a stack."""
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    return dict(params, layers=[jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)])


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random params (normal, std 0.02; norms at 1) for tests and benchmarks."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    arrays = [
        jnp.ones(shape, dtype) if "norm" in path else (0.02 * jax.random.normal(k, shape)).astype(dtype)
        for path, shape, k in zip(paths, leaves, keys)
    ]
    return jax.tree.unflatten(treedef, arrays)


# ----------------------------------------------------------------------------- NNX module


def __getattr__(name: str):
    """`Llama` and `LlamaLayers` live in jaxpaged/models/llama_nnx.py, imported on first use: Flax
    (with flax.linen) costs ~0.5 s of every start, and the engine never needs it."""
    if name in ("Llama", "LlamaLayers"):
        from jaxpaged.models import llama_nnx  # pylint: disable=import-outside-toplevel
        return getattr(llama_nnx, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

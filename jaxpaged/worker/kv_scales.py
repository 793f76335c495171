"""The fp8 KV cache's scales (f32 [L, K]: per layer and KV head), chosen once at start-up.

Where they come from (`resolve_kv_scales`), in order:
  1. the checkpoint, when it stores them (jaxpaged/models/kv_scales.py: compressed-tensors / ModelOpt
     `k_scale`, `v_scale`): what the model was calibrated for;
  2. otherwise a calibration forward at start-up (`calibrate_kv_scales`): the model, in full precision,
     runs CALIBRATION_TEXT once, and each (layer, KV head) gets scale = HEADROOM * max|x| / 448 of its
     keys (values) there.
Why calibrate rather than take vLLM's default of 1.0: e4m3 keeps 3 mantissa bits for magnitudes in
[2^-6, 448] times the scale and saturates above. With 1.0, a head whose values are mostly below 2^-6
(small models' V heads often are) falls into the subnormals and loses most of its precision, and one
whose keys pass 448 is clipped. A scale from the head's own range puts its values at the top of e4m3's
range; HEADROOM = 4 leaves room for text whose activations run up to 4x the calibration text's before
anything saturates, and costs nothing measurable: values down to max / 7,000 keep the full 3 bits.
The calibration compiles one decoder layer and runs it layer by layer: 1.6 s of a first SmolLM2 start on 2
CPU cores (0.5 s once compiled).

The scales never change while the engine runs (pages written under one scale are read under the same
one, prefix-cached pages included). They reach the step as explicit inputs: `KVPool.k_scale`/`v_scale`.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.kv_scales import read_kv_scales
from jaxpaged.models.llama import (LlamaConfig, Params, causal_attention, decoder_layer, embed_tokens,
                                   layer_constants, rope_tables)
from pallas_kernels.kv_quant import FP8_DTYPE, FP8_MAX

logger = logging.getLogger(__name__)

HEADROOM = 4.0
# Varied on purpose (prose, a dialogue turn, code, numbers, another language), so that each head sees the
# kinds of token it will see when serving.
CALIBRATION_TEXT = (
    "The river rose through the night, and by morning the lower fields were a brown lake. "
    "Farmers moved their animals to the ridge and waited for the water to fall.\n"
    "User: Can you explain what a hash table is?\nAssistant: A hash table stores key-value pairs in an "
    "array; a hash function maps each key to a slot, so lookups take constant time on average.\n"
    "def mean(values):\n    return sum(values) / len(values) if values else 0.0\n\n"
    "Quarterly revenue: 1,204.5 (Q1), 1,310.0 (Q2), 987.25 (Q3); growth -24.6% since June 2023.\n"
    "Le chat dort sur le canapé pendant que la pluie tombe. Die Katze schläft, und es regnet.\n"
    "1. Preheat the oven to 200 C. 2. Mix flour, salt and water. 3. Bake for 25 minutes.")


def resolve_kv_scales(config: LlamaConfig, params: Params, kv_dtype, source, tokenize) -> \
        tuple[np.ndarray, np.ndarray] | None:
    """An fp8 pool's (k_scale, v_scale) f32 [L, K]: the checkpoint's at `source` if it stores them, else
    calibrated on `tokenize(CALIBRATION_TEXT)` (token ids; a model without a tokenizer, e.g. random weights for a
    benchmark: on 512 seeded random ids); None for a float pool (nothing is read)."""
    if not is_fp8(kv_dtype):
        return None
    stored = read_kv_scales(source, config)
    if stored is not None:
        logger.info("fp8 KV cache: scales from the checkpoint (k %s, v %s)", _span(stored[0]), _span(stored[1]))
        return stored
    # within the model's context (a byte-level vocabulary makes the text ~800 tokens)
    token_ids = np.random.default_rng(0).integers(0, config.vocab_size, 512, dtype=np.int32) if tokenize is None \
        else np.asarray(tokenize(CALIBRATION_TEXT), np.int32)
    token_ids = token_ids[: config.max_position_embeddings]
    scales = calibrate_kv_scales(config, params, token_ids)
    logger.info("fp8 KV cache: scales calibrated at start-up on %d tokens (k %s, v %s)", token_ids.size,
                _span(scales[0]), _span(scales[1]))
    return scales


def is_fp8(kv_dtype) -> bool:
    """Whether a resolved kv_cache_dtype is fp8 (e4m3: its pool holds the bytes, pallas_kernels/kv_quant.py)."""
    return np.dtype(kv_dtype) == np.dtype(FP8_DTYPE)


def check_kv_scales(config: LlamaConfig, kv_dtype, kv_scales) -> tuple[np.ndarray, np.ndarray] | None:
    """A runner's kv_scales checked against its pool: (k_scale, v_scale) f32 [L, K], finite and > 0, for an
    fp8 pool (required); None for a float pool (given ones: ValueError). Raises ValueError naming the fault."""
    if not is_fp8(kv_dtype):
        if kv_scales is not None:
            raise ValueError(f"kv_scales are for an fp8 KV cache; this pool is {np.dtype(kv_dtype).name}")
        return None
    if kv_scales is None:
        raise ValueError("an fp8 KV cache needs its scales (k_scale, v_scale) f32 [L, K]: "
                         "jaxpaged.worker.kv_scales.resolve_kv_scales makes them (checkpoint or calibration)")
    shape = (config.num_hidden_layers, config.num_key_value_heads)
    out = []
    for name, scale in zip(("k_scale", "v_scale"), kv_scales):
        scale = np.asarray(scale, np.float32)
        if scale.shape != shape:
            raise ValueError(f"fp8 KV cache: {name} has shape {list(scale.shape)}, expected {list(shape)} "
                             "(layers, KV heads)")
        if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
            raise ValueError(f"fp8 KV cache: {name} must be finite and > 0 everywhere")
        out.append(scale)
    return out[0], out[1]


def _span(scale: np.ndarray) -> str:
    return f"{float(scale.min()):.3g}..{float(scale.max()):.3g}"


def calibrate_kv_scales(config: LlamaConfig, params: Params, token_ids: np.ndarray) -> \
        tuple[np.ndarray, np.ndarray]:
    """(k_scale, v_scale) f32 [L, K]: HEADROOM * max|k| / 448 per layer and KV head over a plain causal
    forward of token_ids i32[T] (keys after RoPE, as the pool stores them). params: stacked or per-layer,
    fused or not (`decoder_layer` takes every layout), not packed. ValueError if a maximum is not finite."""
    ids = jnp.asarray(token_ids, jnp.int32)[None]  # [1, T]
    cos_table, sin_table = rope_tables(config, jnp.arange(ids.shape[1], dtype=jnp.int32))  # [U, T, D]
    consts = layer_constants(config)
    layers = params["layers"]
    num_layers = config.num_hidden_layers
    h = embed_tokens(params, ids, config)
    k_max, v_max = [], []
    for i in range(num_layers):
        p = layers[i] if isinstance(layers, (list, tuple)) else jax.tree.map(lambda x, i=i: x[i], layers)
        c = jax.tree.map(lambda x, i=i: x[i], consts)
        h, (km, vm) = _layer_absmax(config, p, h, cos_table[c["rope"]], sin_table[c["rope"]], c["window"])
        k_max.append(np.asarray(km))
        v_max.append(np.asarray(vm))
    return _to_scale(np.stack(k_max), "keys"), _to_scale(np.stack(v_max), "values")


@functools.partial(jax.jit, static_argnums=0)
def _layer_absmax(config: LlamaConfig, p: Params, h: jax.Array, cos: jax.Array, sin: jax.Array, window: jax.Array):
    """One decoder layer on h [1, T, E] -> (h, (max |k|, max |v|) f32 [K] each). Jitted: every layer of a model
    has the same shapes, so one compile serves them all (op by op, the first calibration took ~4 s on CPU)."""

    def attend(q, k, v):
        out = causal_attention(q, k, v, config.attn_scale, window)
        return out, (jnp.max(jnp.abs(k.astype(jnp.float32)), axis=(0, 1, 3)),  # [K]
                     jnp.max(jnp.abs(v.astype(jnp.float32)), axis=(0, 1, 3)))

    return decoder_layer(config, p, h, cos, sin, attend)


def _to_scale(absmax: np.ndarray, what: str) -> np.ndarray:
    if not np.all(np.isfinite(absmax)):
        raise ValueError(f"fp8 KV cache calibration: the model's {what} are not finite on the calibration text "
                         "(its weights give inf/NaN); serve it with a float kv_cache_dtype")
    # a head that is all zeros still gets a positive scale (its zeros are stored exactly under any)
    return (HEADROOM * np.maximum(absmax, 1e-6) / FP8_MAX).astype(np.float32)

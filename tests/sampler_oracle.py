"""The sampler's device path as it was before the sort-free filter (a test oracle, kept verbatim).

One full-vocabulary descending sort per row for top_k / top_p, Gumbel noise over the whole
vocabulary. `tests/test_sampler.py` checks the sort-free sampler draws the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.sample.sampling_batch import GREEDY_TEMPERATURE_EPS, _PRNG_IMPL, SamplingBatch
from jaxpaged.sample.ops import process_logits


def oracle_token_ids(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """i32[S]: the tokens the previous sampler drew for these logits and this batch."""
    processed = process_logits(logits.astype(jnp.float32), batch)
    greedy_ids = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    is_greedy = batch.temperature < GREEDY_TEMPERATURE_EPS
    return jnp.where(is_greedy, greedy_ids, _random_sample(processed, batch, is_greedy))


oracle_token_ids_jit = jax.jit(oracle_token_ids)


def _random_sample(processed: jax.Array, batch: SamplingBatch, is_greedy: jax.Array) -> jax.Array:
    """i32[S]: temperature, min_p / top_k / top_p masks, then Gumbel-max with each row's key."""
    temperature = jnp.where(is_greedy, 1.0, batch.temperature)[:, None]  # f32[S, 1]
    scaled = _min_p_mask(processed / temperature, batch.min_p)
    needs_sort = jnp.any((batch.top_k > 0) | (batch.top_p < 1.0))
    scaled = jax.lax.cond(needs_sort, _top_k_top_p_mask, lambda x, k, p: x, scaled, batch.top_k, batch.top_p)
    noise = _gumbel_noise(batch.key_data, batch.steps, processed.shape[-1])
    return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)


def _min_p_mask(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Keep tokens with prob >= min_p * max prob, i.e. logit >= max logit + log(min_p)."""
    threshold = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]  # f32[S, 1]; -inf when off
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _top_k_top_p_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the top_k highest logits, then the smallest head of those whose mass reaches top_p.

    Both cuts are per-row thresholds read off one descending sort (ties at a
    threshold are all kept, as in vLLM).
    """
    V = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)  # f32[S, V], descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)  # i32[S]
    k_threshold = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # f32[S, 1]
    desc = jnp.where(desc >= k_threshold, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)  # f32[S, V]
    mass_before = jnp.pad(jnp.cumsum(probs, axis=-1)[:, :-1], ((0, 0), (1, 0)))  # f32[S, V], exclusive
    num_kept = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)  # i32[S]
    p_threshold = jnp.take_along_axis(desc, (num_kept - 1)[:, None], axis=-1)  # f32[S, 1]
    p_threshold = jnp.where(top_p[:, None] >= 1.0, -jnp.inf, p_threshold)
    return jnp.where(scaled >= jnp.maximum(k_threshold, p_threshold), scaled, -jnp.inf)


def _gumbel_noise(key_data: jax.Array, steps: jax.Array, vocab_size: int) -> jax.Array:
    """f32[S, V] standard Gumbel noise; row s depends only on (key_data[s], steps[s]) and V.

    Built from raw threefry bits (not jax.random.gumbel) so the stream is
    pinned to the bit generator: u = (top 23 bits + 1/2) / 2**23 in (0, 1).
    """
    def row(data, step):
        key = jax.random.fold_in(jax.random.wrap_key_data(data, impl=_PRNG_IMPL), step)
        bits = jax.random.bits(key, (vocab_size,), jnp.uint32)  # u32[V]
        u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
        return -jnp.log(-jnp.log(u))

    return jax.vmap(row)(key_data, steps)

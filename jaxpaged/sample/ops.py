"""The sampler's device operations on logits rows: masks, bias and penalties, the cut thresholds, Gumbel noise.

Pure jax.numpy functions of [S, V] logits and per-row arrays, shared by the sampler's separate programs and the
fused step (jaxpaged/sample/sampler.py); `threefry2x32` is the counter-based generator every row's noise comes
from, so a seeded row samples the same tokens whatever the batch and the default PRNG implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.sample.sampling_batch import _PRNG_IMPL, SamplingBatch


@jax.jit
def _mask_logits(logits: jax.Array, bitmask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits f32[S, V] with the bitmask's disallowed tokens at -inf, finite bool[S] of the unmasked rows)."""
    raw = logits.astype(jnp.float32)
    return apply_token_bitmask(raw, bitmask), jnp.all(jnp.isfinite(raw), axis=-1)


def process_logits(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """f32[S, V]: logits after logit_bias, banned ids and penalties (what greedy rows take argmax of)."""
    logits = _apply_bias(logits.astype(jnp.float32), batch.bias_ids, batch.bias_values)
    return _apply_penalties(logits, batch)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array | None) -> jax.Array:
    """logits f32[S, V] with -inf where bitmask i32[S, W] has a clear bit (bit j of word w: token 32w + j)."""
    if bitmask is None:
        return logits
    S, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)  # u32[32]
    bits = (bitmask.astype(jnp.uint32)[:, :, None] >> shifts) & 1  # u32[S, W, 32]
    allowed = bits.reshape(S, -1)[:, :V].astype(jnp.bool_)  # bool[S, V]
    return jnp.where(allowed, logits, -jnp.inf)


def _check_shapes(logits, batch: SamplingBatch, k: int) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [S, V], got shape {logits.shape}")
    S, V = logits.shape
    if batch.num_rows != S:
        raise ValueError(f"logits have {S} rows but the SamplingBatch has {batch.num_rows}")
    if batch.output_counts is not None and batch.output_counts.shape != (S, V):
        raise ValueError(f"output_counts shape {batch.output_counts.shape} != logits shape {(S, V)}")
    if batch.prompt_mask is not None and batch.prompt_mask.shape != (S, V):
        raise ValueError(f"prompt_mask shape {batch.prompt_mask.shape} != logits shape {(S, V)}")
    if batch.token_bitmask is not None and batch.token_bitmask.shape != (S, (V + 31) // 32):
        raise ValueError(f"token_bitmask shape {batch.token_bitmask.shape} != {(S, (V + 31) // 32)}")
    if not isinstance(k, int) or not 0 <= k <= V:
        raise ValueError(f"num_top_logprobs={k!r}: must be an integer in [0, V={V}]")


def _apply_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits[s, ids[s, b]] += values[s, b]; id -1 is an unused slot."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]  # i32[S, 1]
    ids = jnp.where(ids < 0, V, ids)  # out of range: dropped (negative ids would wrap around)
    return logits.at[rows, ids].add(values, mode="drop")


def _apply_penalties(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Repetition (HF), then frequency and presence (OpenAI) penalties; a no-op without count arrays."""
    if batch.output_counts is None:
        return logits
    counts = batch.output_counts  # i32[S, V]
    in_output = counts > 0  # bool[S, V]
    rep = batch.repetition_penalty[:, None]  # f32[S, 1]
    repeated = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(batch.prompt_mask | in_output, repeated, logits)
    logits = logits - batch.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - batch.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _argmax(x: jax.Array) -> jax.Array:
    """i32[S]: jnp.argmax over the last axis (first maximum), as two vectorised reductions: XLA:CPU
    runs argmax's (value, index) reduction element by element (S=32, V=49k: 35 ms instead of 2).
    A row without a maximum (NaN) gets the last id."""
    best = jnp.max(x, axis=-1, keepdims=True)
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == best, ids, x.shape[-1] - 1), axis=-1)


def _logsumexp(x: jax.Array) -> jax.Array:
    """f32[S, 1]: jax.nn.logsumexp over the last axis for rows with a finite maximum (others: NaN or
    inf; their tokens are flagged), in two passes instead of its four."""
    best = jnp.max(x, axis=-1, keepdims=True)
    return best + jnp.log(jnp.sum(jnp.exp(x - best), axis=-1, keepdims=True))


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k behind an optimization barrier: XLA:CPU runs TopK as a partial sort only while
    the two outputs reach their users untouched; once it folds a slice of the values into a user
    it sorts whole rows instead (S=32, V=49k: 800 ms instead of 13)."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


def _prefilter_threshold(scaled: jax.Array, values: jax.Array, top_k: jax.Array, top_p: jax.Array,
                         V: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The top_k then top_p cut read off each row's kp largest logits `values` f32[S, kp] (descending):
    (f32[S] threshold, bool[S] exact, bool[S] valid on the candidates).

    top_k cut: the k-th largest logit (ties all kept). top_p cut, on the top_k survivors: the
    smallest head, in descending order, whose exclusive cumulative probability is below top_p,
    ended at its last logit (ties kept), as in vLLM. The normaliser sums the whole row (no sort).
    Exact when top_k <= kp and that head ends inside the candidates. When it does not (mass left
    over), or top_k > kp without top_p, the true cut lies at or below the last candidate: the
    threshold returned then keeps exactly the candidates the true cut keeps (`valid`); with top_k > kp
    and top_p on it does not (bisection decides).
    """
    kp = values.shape[-1]
    k_on = (top_k > 0) & (top_k < V)
    k_exact = ~k_on | (top_k <= kp)
    k_index = jnp.clip(top_k - 1, 0, kp - 1)[:, None]  # i32[S, 1]
    k_threshold = jnp.where(k_on & k_exact, jnp.take_along_axis(values, k_index, axis=-1)[:, 0], -jnp.inf)
    row_max = values[:, :1]  # f32[S, 1]
    kept = scaled >= k_threshold[:, None]
    normaliser = jnp.sum(jnp.where(kept, jnp.exp(scaled - row_max), 0.0), axis=-1, keepdims=True)
    probs = jnp.where(values >= k_threshold[:, None], jnp.exp(values - row_max), 0.0) / normaliser
    mass = jnp.cumsum(probs, axis=-1)  # f32[S, kp]; inclusive
    mass_before = jnp.pad(mass[:, :-1], ((0, 0), (1, 0)))  # exclusive
    p_on = top_p < 1.0
    p_exact = ~p_on | (mass[:, -1] >= top_p) | (kp == V)
    num_kept = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)  # i32[S]
    p_threshold = jnp.take_along_axis(values, (num_kept - 1)[:, None], axis=-1)[:, 0]
    p_threshold = jnp.where(p_on & p_exact, p_threshold, -jnp.inf)
    return jnp.maximum(k_threshold, p_threshold), k_exact & p_exact, k_exact | ~p_on


def _sortable(x: jax.Array) -> jax.Array:
    """u32 keys in the order of the f32 values x (-inf lowest; NaN-free rows)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _unsortable(keys: jax.Array) -> jax.Array:
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_key(keys: jax.Array, predicate) -> jax.Array:
    """u32[S]: per row, the largest t in [min key, max key] with predicate(t) (bool[S]); predicate must
    hold at the row's min key and be monotone (true up to some t, false above). 32 halvings."""
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)  # u32[S]; predicate(lo) holds

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + ((hi - lo) >> 1) + ((hi - lo) & 1)  # in (lo, hi] while lo < hi (no overflow)
        ok = predicate(mid)
        open_ = lo < hi
        return jnp.where(open_ & ok, mid, lo), jnp.where(open_ & ~ok, mid - 1, hi)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def _bisect_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, with_top_k: bool = True) -> jax.Array:
    """f32[S]: the exact top_k then top_p threshold of `_prefilter_threshold`, by bisection over
    the whole row (O(V) per halving, no sort): the largest logit keeping >= k tokens, then the
    largest keeping probability mass >= top_p of the top_k survivors. with_top_k False (static):
    top_k is taken as off in every row, and its 32 halvings are not traced."""
    S, V = scaled.shape
    keys = _sortable(scaled)  # i32[S, V]
    k_on = (top_k > 0) & (top_k < V) & with_top_k
    k_key = jnp.min(keys, axis=-1)  # u32[S]; keeps every token
    if with_top_k:
        k = jnp.where(k_on, top_k, 1)
        k_key = jnp.where(k_on, _largest_key(keys, lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k), k_key)
    kept = keys >= k_key[:, None]
    weights = jnp.where(kept, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)  # f32[S, V]
    target = top_p * jnp.sum(weights, axis=-1)  # f32[S]
    p_key = _largest_key(keys, lambda t: jnp.sum(jnp.where(keys >= t[:, None], weights, 0.0), axis=-1) >= target)
    p_key = jnp.where(top_p < 1.0, jnp.maximum(p_key, k_key), k_key)
    return jnp.where(k_on | (top_p < 1.0), _unsortable(p_key), -jnp.inf)


def _gumbel_argmax(values: jax.Array, ids: jax.Array, threshold: jax.Array, key_data: jax.Array,
                   steps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(i32[S] id, f32[S] score): per row, max(values + Gumbel noise at ids) over values >= threshold,
    ties to the lowest id. values f32[S, C] at token ids i32[S, C] (C candidates, or the whole row)."""
    noise = _gumbel_noise_at(key_data, steps, ids)  # f32[S, C]
    scores = jnp.where(values >= threshold[:, None], values + noise, -jnp.inf)
    best = jnp.max(scores, axis=-1)
    big = jnp.iinfo(jnp.int32).max
    return jnp.min(jnp.where(scores == best[:, None], ids, big), axis=-1).astype(jnp.int32), best


@jax.jit  # nested in the sampler's programs: traced once per shape, not once per program (warm-up time)
def _gumbel_noise_at(key_data: jax.Array, steps: jax.Array, ids: jax.Array) -> jax.Array:
    """f32[S, C] standard Gumbel noise of each row's vocabulary stream at token ids i32[S, C].

    Token t's noise depends only on (key_data[s], steps[s], t): threefry2x32 of the row's key
    fold_in(key, step) on the counter (0, t), its two words xor-ed (jax.random.bits' layout over a
    vocabulary-sized vector), u = (top 23 bits + 1/2) / 2**23 in (0, 1), -log(-log(u)).
    """
    keys = _row_keys(key_data, steps)  # u32[S, 2]
    counters = ids.astype(jnp.uint32)  # u32[S, C]
    hi, lo = threefry2x32(keys[:, :1], keys[:, 1:], jnp.zeros_like(counters), counters)  # each row's key broadcast
    bits = hi ^ lo  # u32[S, C]
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    return -jnp.log(-jnp.log(u))


def _row_keys(key_data: jax.Array, steps: jax.Array) -> jax.Array:
    """u32[S, 2]: each row's Threefry key for this step, fold_in(key_data[s], steps[s])."""
    def fold(data, step):
        return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(data, impl=_PRNG_IMPL), step))
    return jax.vmap(fold)(key_data, steps)


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # Threefry-2x32's, alternating per 4 rounds
_THREEFRY_PARITY = 0x1BD11BDA


def threefry2x32(k0: jax.Array, k1: jax.Array, c0: jax.Array, c1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32, 20 rounds (Salmon et al., Random123), of the key (k0, k1) on counters (c0, c1): u32
    arrays that broadcast. Bit for bit `threefry2x32_p`, written out as plain elementwise ops: JAX lowers
    its primitive on CPU as a rolled loop, which XLA cannot fuse (32 x 49k counters: 10.5 ms there,
    1.9 ms here). Five blocks of four mix rounds, the key injected after each block."""
    u32 = jnp.uint32
    schedule = (k0, k1, k0 ^ k1 ^ u32(_THREEFRY_PARITY))
    x0, x1 = c0 + schedule[0], c1 + schedule[1]
    for block in range(5):
        for r in _THREEFRY_ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = ((x1 << u32(r)) | (x1 >> u32(32 - r))) ^ x0
        x0 = x0 + schedule[(block + 1) % 3]
        x1 = x1 + schedule[(block + 2) % 3] + u32(block + 1)
    return x0, x1

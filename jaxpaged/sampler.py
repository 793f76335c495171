"""Sampler: pick the next token of every sequence slot of a batch, on device (vLLM v1's Sampler).

Host side, once per step: `make_sampling_batch(rows, num_rows, vocab_size)`
turns one `RowInfo` per live slot into a `SamplingBatch`, a pytree of fixed
shape numpy arrays (S = num_rows, the padded batch bucket). Rows beyond
`len(rows)` are padding: greedy and neutral, their results are garbage.

Device side: `sample(logits, batch)` (jitted: `sample_jit`) processes each
row like vLLM does:

  0. structured outputs: when the batch carries a token bitmask (i32[S, W],
     W = ceil(V / 32), llguidance's layout; unconstrained rows all ones), tokens
     whose bit is clear get -inf before anything else, log-probs included;
  1. logit_bias and banned ids (-inf), one fixed-width scatter [S, B];
  2. repetition penalty (HF: positive logits / p, negative * p) for tokens in
     the prompt or the output; frequency and presence penalties (OpenAI) on
     the output counts. Only when the batch carries the dense count arrays;
  3. greedy rows (temperature < GREEDY_TEMPERATURE_EPS) take argmax here;
  4. random rows: logits / temperature, then the min_p, top_k and top_p masks
     (each on what the previous left; the [S, V] sort runs only when some
     row has top_k or top_p on), then Gumbel-max with the row's key.

Randomness: a row's key is fold_in(PRNGKey(seed), step) under threefry2x32,
whatever the default PRNG implementation is, and its noise depends only on
that key and V, so a seeded request samples the same tokens in any batch, in
any row. Log-probs are those of the RAW model distribution (vLLM v1's
default): log_softmax of the unmodified logits.

Compile variants of `sample_jit` at one (S, V, B): with and without the
penalty arrays (`output_counts`/`prompt_mask` None or not), with and without
the token bitmask (None when no row is constrained: no cost), times each static
`num_top_logprobs`. Parameter values never cause a recompile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BIAS_ENTRIES = 320  # OpenAI allows 300 logit_bias entries; the rest is room for banned ids
GREEDY_TEMPERATURE_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it sample greedily
_PRNG_IMPL = "threefry2x32"
_U32_MASK = 0xFFFFFFFF


# ---- host side ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowInfo:
    """What the sampler needs to know about one live sequence slot this step."""

    params: SamplingParams
    seed: int  # the request's own params.seed when set, else one the engine chose
    step: int = 0  # output tokens generated so far: the key is fold_in(PRNGKey(seed), step)
    prompt_token_ids: Sequence[int] = ()  # read only when repetition_penalty != 1
    output_token_ids: Sequence[int] = ()  # read only when some penalty is on
    banned_token_ids: tuple[int, ...] = ()  # masked to -inf this step (e.g. EOS before min_tokens)

    def __post_init__(self):
        object.__setattr__(self, "banned_token_ids", tuple(int(t) for t in self.banned_token_ids))
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"RowInfo.params must be a SamplingParams, got {type(self.params).__name__}")
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise ValueError(f"RowInfo.seed={self.seed!r}: must be an integer")
        if not isinstance(self.step, (int, np.integer)) or not 0 <= self.step <= _U32_MASK:
            raise ValueError(f"RowInfo.step={self.step!r}: must be an integer in [0, 2**32)")

    @property
    def uses_penalties(self) -> bool:
        p = self.params
        return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class SamplingBatch:
    """Per-row sampling state of one batch, S rows over a vocabulary of V. A pytree.

    No __post_init__ checks: pytree unflattening rebuilds it from tracers and
    placeholders; `make_sampling_batch` validates and `sample` checks shapes.
    """

    temperature: np.ndarray  # f32[S]; 0 for greedy rows (and padding)
    top_k: np.ndarray  # i32[S]; 0 = off (also for -1, k >= V and greedy rows)
    top_p: np.ndarray  # f32[S]; 1 = off
    min_p: np.ndarray  # f32[S]; 0 = off
    presence_penalty: np.ndarray  # f32[S]
    frequency_penalty: np.ndarray  # f32[S]
    repetition_penalty: np.ndarray  # f32[S]
    key_data: np.ndarray  # u32[S, 2]; threefry2x32 key data of PRNGKey(seed)
    steps: np.ndarray  # u32[S]; folded into key_data on device
    bias_ids: np.ndarray  # i32[S, B]; -1 = unused slot
    bias_values: np.ndarray  # f32[S, B]; -inf for banned ids
    output_counts: np.ndarray | None = None  # i32[S, V]; only when some row uses penalties
    prompt_mask: np.ndarray | None = None  # bool[S, V]; idem
    token_bitmask: np.ndarray | None = None  # i32[S, W], W = ceil(V / 32); only when some row is constrained

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def has_penalties(self) -> bool:
        return self.output_counts is not None

    @property
    def has_token_bitmask(self) -> bool:
        return self.token_bitmask is not None


jax.tree_util.register_dataclass(
    SamplingBatch, data_fields=[f.name for f in dataclasses.fields(SamplingBatch)], meta_fields=[])


def seed_key_data(seed: int) -> np.ndarray:
    """u32[2]: threefry2x32 key data of `seed` mod 2**64; equals PRNGKey(seed) for 0 <= seed < 2**32."""
    seed = int(seed)
    return np.array([(seed >> 32) & _U32_MASK, seed & _U32_MASK], dtype=np.uint32)


def step_key(seed: int, step: int) -> jax.Array:
    """The typed PRNG key a row with this (seed, step) samples with (for tests and debugging)."""
    key = jax.random.wrap_key_data(jnp.asarray(seed_key_data(seed)), impl=_PRNG_IMPL)
    return jax.random.fold_in(key, np.uint32(step))


def make_sampling_batch(rows: Sequence[RowInfo], num_rows: int, vocab_size: int, *,
                        max_bias_entries: int = MAX_BIAS_ENTRIES,
                        token_bitmask: np.ndarray | None = None) -> SamplingBatch:
    """Host arrays for one step: rows[i] fills slot i, slots len(rows).. are greedy padding.

    token_bitmask: i32[num_rows, ceil(vocab_size / 32)] of allowed tokens (structured outputs), or None."""
    _check_token_bitmask(token_bitmask, num_rows, vocab_size)
    if not isinstance(num_rows, int) or num_rows < max(1, len(rows)):
        raise ValueError(f"num_rows={num_rows!r}: must be an integer >= max(1, len(rows)={len(rows)})")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r}: must be an integer >= 1")
    if not isinstance(max_bias_entries, int) or max_bias_entries < 1:
        raise ValueError(f"max_bias_entries={max_bias_entries!r}: must be an integer >= 1")
    S, B = num_rows, max_bias_entries
    scalars = [_row_scalars(row.params, vocab_size) for row in rows] + [_PADDING_SCALARS] * (S - len(rows))
    temperature, top_k, top_p, min_p, presence, frequency, repetition = np.array(scalars, np.float64).T
    key_data = np.zeros((S, 2), np.uint32)
    steps = np.zeros((S,), np.uint32)
    bias_ids = np.full((S, B), -1, np.int32)
    bias_values = np.zeros((S, B), np.float32)
    for i, row in enumerate(rows):
        key_data[i] = seed_key_data(row.seed)
        steps[i] = row.step
        _fill_bias_row(bias_ids[i], bias_values[i], row, vocab_size, i)
    counts, prompt_mask = _penalty_arrays(rows, S, vocab_size)
    f32 = np.float32
    return SamplingBatch(
        temperature=temperature.astype(f32), top_k=top_k.astype(np.int32), top_p=top_p.astype(f32),
        min_p=min_p.astype(f32), presence_penalty=presence.astype(f32), frequency_penalty=frequency.astype(f32),
        repetition_penalty=repetition.astype(f32), key_data=key_data, steps=steps, bias_ids=bias_ids,
        bias_values=bias_values, output_counts=counts, prompt_mask=prompt_mask, token_bitmask=token_bitmask)


def _check_token_bitmask(bitmask: np.ndarray | None, S: int, V: int) -> None:
    if bitmask is None:
        return
    width = (V + 31) // 32
    if not isinstance(bitmask, np.ndarray) or bitmask.dtype != np.int32 or bitmask.shape != (S, width):
        raise ValueError(f"token_bitmask must be an int32 numpy array of shape {(S, width)}, got "
                         f"{getattr(bitmask, 'dtype', type(bitmask).__name__)} {getattr(bitmask, 'shape', '')}")


# (temperature, top_k, top_p, min_p, presence, frequency, repetition) of a padding row: greedy, neutral
_PADDING_SCALARS = (0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0)


def _row_scalars(p: SamplingParams, vocab_size: int) -> tuple[float, ...]:
    """(temperature, top_k, top_p, min_p, presence, frequency, repetition), cuts off for greedy rows."""
    penalties = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    if p.temperature < GREEDY_TEMPERATURE_EPS:
        return (0.0, 0, 1.0, 0.0, *penalties)
    top_k = p.top_k if 0 < p.top_k < vocab_size else 0
    return (p.temperature, top_k, p.top_p, p.min_p, *penalties)


def _fill_bias_row(ids: np.ndarray, values: np.ndarray, row: RowInfo, vocab_size: int, index: int) -> None:
    entries = list(row.params.logit_bias or ()) + [(t, -np.inf) for t in row.banned_token_ids]
    if len(entries) > ids.shape[0]:
        raise ValueError(f"row {index}: {len(entries)} logit_bias + banned ids exceed the batch's "
                         f"max_bias_entries={ids.shape[0]}")
    for j, (token_id, bias) in enumerate(entries):
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"row {index}: token id {token_id} in logit_bias/banned_token_ids is outside "
                             f"the vocabulary [0, {vocab_size})")
        ids[j], values[j] = token_id, bias


def _penalty_arrays(rows: Sequence[RowInfo], S: int, V: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Dense output counts i32[S, V] and prompt mask bool[S, V], or (None, None) when no row needs them."""
    if not any(row.uses_penalties for row in rows):
        return None, None
    counts = np.zeros((S, V), np.int32)
    prompt_mask = np.zeros((S, V), np.bool_)
    for i, row in enumerate(rows):
        if not row.uses_penalties:
            continue  # its penalties are neutral: the counts are never read
        out = np.asarray(row.output_token_ids, np.int64).reshape(-1)
        _check_ids(out, V, i, "output_token_ids")
        np.add.at(counts[i], out, 1)
        if row.params.repetition_penalty != 1.0:
            prompt = np.asarray(row.prompt_token_ids, np.int64).reshape(-1)
            _check_ids(prompt, V, i, "prompt_token_ids")
            prompt_mask[i, prompt] = True
    return counts, prompt_mask


def _check_ids(ids: np.ndarray, V: int, index: int, name: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= V):
        raise ValueError(f"row {index}: {name} has ids outside the vocabulary [0, {V})")


# ---- device side -------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class SamplerOutput:
    """What one step sampled, per row (S rows, K = num_top_logprobs). A pytree of device arrays."""

    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; log-prob of token_ids under the raw model distribution
    top_token_ids: jax.Array  # i32[S, K]; raw distribution's K most likely ids, most likely first
    top_logprobs: jax.Array  # f32[S, K]
    finite: jax.Array  # bool[S]; False when the row's raw logits hold a NaN or an inf (its token is garbage)


jax.tree_util.register_dataclass(
    SamplerOutput, data_fields=["token_ids", "logprobs", "top_token_ids", "top_logprobs", "finite"],
    meta_fields=[])


def sample(logits: jax.Array, batch: SamplingBatch, *, num_top_logprobs: int = MAX_LOGPROBS) -> SamplerOutput:
    """Sample one token per row of logits f32[S, V] (pure; jit with num_top_logprobs static)."""
    _check_shapes(logits, batch, num_top_logprobs)
    raw = logits.astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(raw), axis=-1)  # bool[S]; before the grammar's -inf
    raw = apply_token_bitmask(raw, batch.token_bitmask)
    processed = process_logits(raw, batch)
    greedy_ids = jnp.argmax(processed, axis=-1).astype(jnp.int32)  # i32[S]; ties: lowest id
    is_greedy = batch.temperature < GREEDY_TEMPERATURE_EPS  # bool[S]
    token_ids = jax.lax.cond(
        jnp.all(is_greedy),
        lambda: greedy_ids,
        lambda: jnp.where(is_greedy, greedy_ids, _random_sample(processed, batch, is_greedy)))
    return dataclasses.replace(_raw_logprobs(raw, token_ids, num_top_logprobs), finite=finite)


sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs",))


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


def _raw_logprobs(raw: jax.Array, token_ids: jax.Array, k: int) -> SamplerOutput:
    """Log-probs under log_softmax(raw) of the sampled ids and of the raw top-k."""
    lse = jax.nn.logsumexp(raw, axis=-1, keepdims=True)  # f32[S, 1]
    sampled = jnp.take_along_axis(raw, token_ids[:, None], axis=-1) - lse  # f32[S, 1]
    if k == 0:
        top_values = jnp.zeros((raw.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
    else:
        top_values, top_ids = jax.lax.top_k(raw, k)  # f32[S, K], i32[S, K]
    return SamplerOutput(token_ids=token_ids, logprobs=sampled[:, 0],
                         top_token_ids=top_ids.astype(jnp.int32), top_logprobs=top_values - lse,
                         finite=jnp.all(jnp.isfinite(raw), axis=-1))

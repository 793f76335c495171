"""The sampler inside the step program (the fused step, `RunnerConfig.fuse_sampler`): the same operations as
sampler.py's separate parts, traced into the forward's own program, and the host-side call that finishes them.

`sample_in_step` takes a batch with every optional array present (`with_neutral_arrays` fills the absent ones
from `neutral_arrays`, made once per row count), so one program serves every batch; it returns an unfinished
`SamplerOutput` (no top log-probs, a random row's fallback state kept). `finish_in_step` runs the fallback
(`sampler._finish_random`) only when the flags ask, and the top log-probs only when a row asks for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sample.ops import apply_token_bitmask, process_logits
from jaxpaged.sample.sampler import (
    PREFILTER_K,
    SamplerOutput,
    _candidate_tokens,
    _finish_random,
    _raw_logprobs,
    _row_stats,
    _scale,
    with_top_logprobs,
)
from jaxpaged.sample.sampling_batch import GREEDY_TEMPERATURE_EPS, MAX_BIAS_ENTRIES, SamplingBatch
from pallas_kernels import cpu_sampler


def neutral_arrays(num_rows: int, vocab_size: int) -> tuple[jax.Array, ...]:
    """Device arrays standing in for a batch's absent optional fields in the fused step, so that one program
    serves every batch: output counts i32[S, V] of zeros, prompt mask bool[S, V] all False (penalties then
    change nothing), a token bitmask i32[S, ceil(V / 32)] allowing every token, and no logit bias (ids i32[S, B]
    all -1, values f32[S, B] zeros: `assemble_sampling_batch(neutral_bias=True)` leaves a batch's None when no
    row has one, so a step without sends none to the device). Made once per S."""
    width, B = (vocab_size + 31) // 32, MAX_BIAS_ENTRIES
    return (jnp.zeros((num_rows, vocab_size), jnp.int32), jnp.zeros((num_rows, vocab_size), jnp.bool_),
            jnp.full((num_rows, width), -1, jnp.int32), jnp.full((num_rows, B), -1, jnp.int32),
            jnp.zeros((num_rows, B), jnp.float32))


def with_neutral_arrays(batch: SamplingBatch, neutral: tuple[jax.Array, ...], **fields) -> SamplingBatch:
    """`batch` with its absent counts, prompt mask, token bitmask and logit bias taken from `neutral_arrays`, and
    `fields` set, in one copy (a frozen batch of 24 fields costs ~4 us a copy: the fused step makes one a step)."""
    counts, prompt_mask, bitmask, bias_ids, bias_values = neutral
    if batch.output_counts is None and "output_counts" not in fields:
        fields.update(output_counts=counts, prompt_mask=prompt_mask)
    if batch.bias_ids is None and "bias_ids" not in fields:
        fields.update(bias_ids=bias_ids, bias_values=bias_values)
    if batch.token_bitmask is None and "token_bitmask" not in fields:
        fields.update(token_bitmask=bitmask)
    return dataclasses.replace(batch, **fields) if fields else batch


def sample_in_step(logits: jax.Array, batch: SamplingBatch, fed_token_ids: jax.Array, *, random: bool,
                   prefilter_k: int = PREFILTER_K, native: bool = False) -> SamplerOutput:
    """`sample_deferred`'s device part, traced inside the step's own program (pure; not jitted here).

    logits f32[S, V]; batch: every field present (`with_neutral_arrays`); fed_token_ids i32[S, F]: output
    tokens of each row's request the host's counts do not hold yet (async scheduling: the previous step's token,
    fed this step as a placeholder, the drafts it accepted and the drafts fed before the row:
    `model_runner.outputs_in_flight`), -1 for none. random (static, the host's choice, as `sample` makes it):
    some row samples at random, so the candidate pass runs (else argmax only). native (static): the step
    runs on the CPU, so the candidates' top-k is the native call (as `native_kernels` says for the parts)
    where it builds. An unfinished sample (its raw logits kept; random: its fallback state too, and the key
    steps it drew with); no top log-probs (`finish_in_step` adds them when asked). Same operations as the
    separate parts, so the same samples.
    """
    unmasked = logits.astype(jnp.float32)
    raw = apply_token_bitmask(unmasked, batch.token_bitmask)  # identity under an all-ones bitmask
    batch = dataclasses.replace(batch, output_counts=_count_fed_tokens(batch.output_counts, fed_token_ids))
    processed = process_logits(raw, batch)
    finite = jnp.all(jnp.isfinite(unmasked), axis=-1)  # bool[S]; before the grammar's -inf
    native = native and cpu_sampler.load_cpu_sampler()
    greedy_ids, lse, _ = _row_stats(processed, raw, native)
    if not random:
        return dataclasses.replace(_raw_logprobs(raw, greedy_ids, 0, lse), finite=finite, logits=raw)
    scaled, min_p_threshold = _scale(processed, batch, native)
    token_ids, threshold, flags = _candidate_tokens(greedy_ids, scaled, min_p_threshold, batch, prefilter_k, native)
    return dataclasses.replace(_raw_logprobs(raw, token_ids, 0, lse), finite=finite, logits=raw, scaled=scaled,
                               threshold=threshold, flags=flags, steps=batch.steps)


def _count_fed_tokens(counts: jax.Array, fed_token_ids: jax.Array) -> jax.Array:
    """i32[S, V]: counts with one more for each of a row's fed tokens i32[S, F] (-1: none); elementwise (F
    compares an element, F small: 2k + 1 for k drafts a row), it fuses with its users."""
    vocabulary = jnp.arange(counts.shape[-1], dtype=jnp.int32)[None, :]  # i32[1, V]
    for f in range(fed_token_ids.shape[1]):
        counts = counts + (vocabulary == fed_token_ids[:, f, None]).astype(counts.dtype)
    return counts


def finish_in_step(state: SamplerOutput, batch: SamplingBatch, num_top_logprobs: int) -> Callable[[], SamplerOutput]:
    """`sample_deferred`'s `finish` for a fused step's unfinished sample. Its token_ids are `state.token_ids` themselves
    unless a random row needed a fallback (the flags are read back only when some row samples at random):
    `_resample_rows`, a separate program run only when the flags ask, over those rows only (O(V) passes
    per row, 32 halvings and noise over the whole vocabulary, that the candidate pass almost always makes
    unnecessary). num_top_logprobs > 0 (some row asks): `_top_logprobs` adds the raw top-k, also a
    separate program, as a top-k over the vocabulary in every step (XLA:GPU sorts for k = 20) would cost
    more than one small dispatch on the steps that ask."""
    def finish() -> SamplerOutput:
        if state.flags is None:  # greedy rows only: nothing to fall back on
            out = state.finished()
        else:  # keyed as the program drew (its steps may have moved: async scheduling)
            random_rows = np.asarray(batch.temperature) >= GREEDY_TEMPERATURE_EPS  # host copy (a numpy batch)
            out = _finish_random(state.logits, dataclasses.replace(batch, steps=state.steps), random_rows, state)
        return with_top_logprobs(out, state.logits, num_top_logprobs)
    return finish

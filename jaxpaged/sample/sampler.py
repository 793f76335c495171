"""Sampler: pick the next token of every sequence slot of a batch, on device (vLLM v1's Sampler).

Host side, once per step: `make_sampling_batch(rows, num_rows, vocab_size)`
turns one `RowInfo` per live slot into a `SamplingBatch`, a pytree of fixed
shape numpy arrays (S = num_rows, the padded batch bucket). Rows beyond
`len(rows)` are padding: greedy and neutral, their results are garbage.
The runner builds the same batch from constants it keeps per request across
steps (`worker.input_batch.InputBatch`: its params' scalars, its seed's key data) and RowInfos
only for the rows that need more (`assemble_sampling_batch`).

Device side: `sample(logits, batch)` (its parts jitted; the host picks which
run from the batch and a few flags) processes each row like vLLM does:

  0. structured outputs: when the batch carries a token bitmask (i32[S, W],
     W = ceil(V / 32), llguidance's layout; unconstrained rows all ones), tokens
     whose bit is clear get -inf before anything else, log-probs included;
  1. logit_bias and banned ids (-inf), one fixed-width scatter [S, B];
  2. repetition penalty (HF: positive logits / p, negative * p) for tokens in
     the prompt or the output; frequency and presence penalties (OpenAI) on
     the output counts. Only when the batch carries the dense count arrays;
  3. greedy rows (temperature < GREEDY_TEMPERATURE_EPS) take argmax here;
  4. random rows: logits / temperature, then the min_p, top_k and top_p cuts
     (each on what the previous left) as one per-row threshold, then
     Gumbel-max with the row's key. No sort of the vocabulary: the row's 256
     largest logits decide the threshold and the token whenever they can
     (almost always on a language model's rows); bisection over the row and
     noise over the whole vocabulary run only for rows that need them.

Randomness: a row's key is fold_in(PRNGKey(seed), step) under threefry2x32,
whatever the default PRNG implementation is, and its noise depends only on
that key and V, so a seeded request samples the same tokens in any batch, in
any row. Log-probs are those of the RAW model distribution (vLLM v1's
default): log_softmax of the unmodified logits.

Compile variants at one (S, V, B) (`warmup` compiles them all, `lower_parts`
lowers them): greedy and random parts with and without the penalty arrays
(`output_counts`/`prompt_mask` None or not), the top log-probs (a program of
their own, run only when some row asks: `num_top_logprobs_for`), the fallback
(`_resample_rows`: per row count R of `fallback_rows` and cut method), and the
token-bitmask pass (run only when some row is constrained: an unconstrained
batch pays nothing for it). Parameter values never cause a recompile.

The fused step (`RunnerConfig.fuse_sampler`) traces the same operations into the step's own program:
jaxpaged/sample/in_step.py (`sample_in_step`, `finish_in_step`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sample.ops import (
    _argmax,
    _bisect_threshold,
    _check_shapes,
    _gumbel_argmax,
    _logsumexp,
    _mask_logits,
    _prefilter_threshold,
    _row_keys,
    _top_k,
    process_logits,
)
from jaxpaged.sample.sampling_batch import (
    GREEDY_TEMPERATURE_EPS,
    RowInfo,
    SamplingBatch,
    make_sampling_batch,
)
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from pallas_kernels import cpu_sampler

# Above any Gumbel noise the stream draws: u <= 1 - 2**-24, so -log(-log(u)) <= 16.64
GUMBEL_MAX = 17.0
PREFILTER_K = 256  # candidates per row of the sort-free top_k / top_p / min_p cut
GUMBEL_CANDIDATES = 4  # tokens the native whole-row pass names per row (cpu_sampler.gumbel_candidates_cpu)


# ---- device side -------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class SamplerOutput:
    """What one step sampled, per row (S rows, K = num_top_logprobs). A pytree of device arrays (numpy once
    fetched to the host).

    A sample not yet finished (`sample_in_step`, `_candidate_sample`: a random row's token may still change in a
    fallback, and K = 0) also holds what its fallbacks and top log-probs read; the finishing call
    (`finish_in_step`, `_finish_random`) drops it (`finished`), so that no [S, V] array reaches the host."""

    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; log-prob of token_ids under the raw model distribution
    top_token_ids: jax.Array  # i32[S, K]; raw distribution's K most likely ids, most likely first
    top_logprobs: jax.Array  # f32[S, K]
    finite: jax.Array  # bool[S]; False when the row's raw logits hold a NaN or an inf (its token is garbage)
    # ---- an unfinished sample's (None once finished, and where the program has none) ----
    logits: jax.Array | None = None  # f32[S, V]: raw logits after the token bitmask (a fused step's)
    scaled: jax.Array | None = None  # f32[S, V]: tempered, min_p-cut logits (random rows only)
    threshold: jax.Array | None = None  # f32[S]: each random row's cut; idem
    flags: jax.Array | None = None  # bool[2, S]: (covered, exact) of `_candidate_tokens`; idem
    steps: jax.Array | None = None  # u32[S]: the key steps the rows drew with (a fused step's random rows)

    def finished(self) -> SamplerOutput:
        """This sample without its fallback state (the per-row arrays themselves, unchanged)."""
        return dataclasses.replace(self, logits=None, scaled=None, threshold=None, flags=None, steps=None)

    def to_host(self) -> SamplerOutput:
        """This finished sample's per-row arrays on the host (numpy), fetched together. The [S, 0] top arrays of a
        step that asked for no log-probs are made here, not fetched."""
        if self.top_token_ids.shape[1]:
            return fetch(self)
        token_ids, logprobs, finite = fetch((self.token_ids, self.logprobs, self.finite))
        return SamplerOutput(token_ids, logprobs, np.zeros(self.top_token_ids.shape, self.top_token_ids.dtype),
                             np.zeros(self.top_logprobs.shape, self.top_logprobs.dtype), finite)


def fetch(tree):
    """`jax.device_get(tree)`: its device arrays as numpy arrays (waiting for them). On CPU each is already host
    memory and `np.asarray` takes it without a copy, as device_get does, but without device_get's ~6 us of Python
    work an array, paid by every step; on an accelerator device_get starts every copy before waiting for any."""
    if jax.default_backend() != "cpu":
        return jax.device_get(tree)
    return jax.tree_util.tree_map(np.asarray, tree)


jax.tree_util.register_dataclass(
    SamplerOutput, data_fields=["token_ids", "logprobs", "top_token_ids", "top_logprobs", "finite", "logits",
                                "scaled", "threshold", "flags", "steps"], meta_fields=[])


def sample(logits: jax.Array, batch: SamplingBatch, *, num_top_logprobs: int = MAX_LOGPROBS,
           prefilter_k: int = PREFILTER_K) -> SamplerOutput:
    """Sample one token per row of logits f32[S, V]; every device part is jitted.

    num_top_logprobs: how many raw top log-probs to return (0 skips their top-k pass).
    prefilter_k: candidates per row of the sort-free filter (see `_candidate_sample`); any value
    gives the same samples, only the cost differs.

    The host picks the parts: all-greedy batches run `_greedy_sample` only; others run
    `_candidate_sample`, then `_resample_rows` over the rows that need it only when some random
    row does (XLA:CPU charges an untaken lax.cond branch of this size ~60 ms a call
    at S=32, V=49k, so the branches are separate programs, decided from a few flags).
    `sample_deferred` is the same in two calls.
    """
    return sample_deferred(logits, batch, num_top_logprobs=num_top_logprobs, prefilter_k=prefilter_k)()


def sample_deferred(logits: jax.Array, batch: SamplingBatch, *, num_top_logprobs: int = MAX_LOGPROBS,
                    prefilter_k: int = PREFILTER_K) -> Callable[[], SamplerOutput]:
    """`sample` in two calls: this one dispatches every part that needs no host decision and returns
    `finish()`, which reads the fallback flags back (the host waits for the device only there),
    dispatches the fallbacks some random rows need and returns the SamplerOutput. Async scheduling
    calls `finish` once the next step is scheduled, so the host does not wait in between."""
    _check_shapes(logits, batch, num_top_logprobs)
    if not isinstance(prefilter_k, int) or prefilter_k < 1:
        raise ValueError(f"prefilter_k={prefilter_k!r}: must be an integer >= 1")
    if batch.token_bitmask is None:
        return _sample_parts(logits, batch, num_top_logprobs, prefilter_k)
    # Structured outputs: one masking pass, only when some row is constrained; `finite` is read before
    # the grammar's -inf (a NaN/inf from the model still fails only its row).
    logits, finite = _mask_logits(logits, batch.token_bitmask)
    finish = _sample_parts(logits, dataclasses.replace(batch, token_bitmask=None), num_top_logprobs, prefilter_k)
    return lambda: dataclasses.replace(finish(), finite=finite)


def _sample_parts(logits: jax.Array, batch: SamplingBatch, num_top_logprobs: int,
                  prefilter_k: int) -> Callable[[], SamplerOutput]:
    """`sample_deferred` of an unmasked batch: the host picks which jitted parts run (see `sample`)."""
    random_rows = np.asarray(batch.temperature) >= GREEDY_TEMPERATURE_EPS  # host copy (a numpy batch: free)
    native = native_kernels(logits)
    if not random_rows.any():
        out = with_top_logprobs(_greedy_sample(logits, batch, native), logits, num_top_logprobs)
        return lambda: out
    out = with_top_logprobs(_candidate_sample(logits, batch, prefilter_k, native), logits, num_top_logprobs)
    return functools.partial(_finish_random, logits, batch, random_rows, out)


def with_top_logprobs(out: SamplerOutput, raw: jax.Array, num_top_logprobs: int) -> SamplerOutput:
    """out with the top log-probs of raw f32[S, V] (the logits the sampler read, after any token bitmask) when
    num_top_logprobs > 0: `_top_logprobs`, a program of its own dispatched only then, so that the sampler's
    parts have no variant per num_top_logprobs (half the programs to compile at warm-up)."""
    if not num_top_logprobs:
        return out
    top_ids, top_logprobs = _top_logprobs(raw, num_top_logprobs, native_kernels(raw))
    return dataclasses.replace(out, top_token_ids=top_ids, top_logprobs=top_logprobs)


def _finish_random(logits, batch: SamplingBatch, random_rows: np.ndarray, out: SamplerOutput) -> SamplerOutput:
    """The fallbacks of a batch with random rows, decided from the unfinished sample's flags (read back here):
    only the rows that need them are resampled, gathered into R = `fallback_rows(n, S)` rows. Finished."""
    covered, exact = np.asarray(out.flags)  # bool[2, S]
    rows = np.flatnonzero(random_rows & ~covered)  # the n rows whose candidates did not decide the token
    if rows.size == 0:
        return out.finished()
    S = len(random_rows)
    index = np.full(fallback_rows(rows.size, S), S, np.int32)  # i32[R]; S: padding (read clipped, never written)
    index[:rows.size] = rows
    bisect = np.zeros(index.shape, bool)  # bool[R]: rows whose cut the candidates did not decide
    bisect[:rows.size] = ~exact[rows]
    with_top_k = bool((np.asarray(batch.top_k)[rows][bisect[:rows.size]] > 0).any())
    token_ids, logprobs = _resample_rows(logits, out.token_ids, out.logprobs, out.scaled, out.threshold, batch.top_k,
                                         batch.top_p, batch.min_p, batch.key_data, batch.steps, index, bisect,
                                         _cut_method(out.scaled, bisect.any(), with_top_k))
    return dataclasses.replace(out.finished(), token_ids=token_ids, logprobs=logprobs)


FALLBACK_ROW_BUCKETS = (1, 4, 16)  # R of a fallback below S: one program per (S, R) and cut method
CUT_METHODS = ("none", "native", "bisect", "bisect_top_k")  # how `_resample_rows` finds the exact cut


def native_kernels(x: jax.Array) -> bool:
    """Whether the sampler's parts over x (a concrete array) use the native CPU kernels (cpu_sampler.cc): the
    candidates' top-k, the fallback's exact cut and the rows' argmax / log-sum-exp (`_row_stats`). Where x
    lives on the CPU and the kernels build."""
    return all(d.platform == "cpu" for d in x.devices()) and cpu_sampler.load_cpu_sampler()


def _cut_method(x: jax.Array, any_inexact: bool, with_top_k: bool) -> str:
    """`_resample_rows`' cut: "native" (cpu_sampler.cc) for arrays on the CPU where it builds, also when the
    candidates decided every row's cut (rows not marked keep theirs; the native cut costs little beside the fallback's
    noise over the vocabulary (docs/kernels.md), and each (S, R) then has one program, not two, to compile at
    warm-up); else "none" (the candidates decided every row's), else "bisect" (XLA, 32 halvings
    per cut), with the top_k halvings ("bisect_top_k") only when some row to bisect cuts top_k."""
    if native_kernels(x):
        return "native"
    if not any_inexact:
        return "none"
    return "bisect_top_k" if with_top_k else "bisect"


def fallback_rows(n: int, num_rows: int) -> int:
    """R, the padded row count of a fallback over n of num_rows rows: the smallest bucket >= n, else num_rows.
    A fallback costs O(R V) passes (32 halvings, noise over the vocabulary), so one flat row of 32 pays for
    one, not 32."""
    return next((r for r in FALLBACK_ROW_BUCKETS if n <= r < num_rows), num_rows)


sample_jit = sample  # the former name: `sample` jits its own parts


@functools.partial(jax.jit, static_argnums=(1, 2))
def _top_logprobs(raw: jax.Array, k: int, native: bool = False) -> tuple[jax.Array, jax.Array]:
    """(i32[S, K] ids, f32[S, K] log-probs) of the raw distribution's k most likely tokens (`_raw_logprobs`'),
    under the log-sum-exp the parts give the sampled token's log-prob (`_row_stats`; native: static)."""
    raw = raw.astype(jnp.float32)
    _, lse, finite = _row_stats(raw, raw, native)
    out = _raw_logprobs(raw, jnp.zeros(raw.shape[:1], jnp.int32), k, lse, finite)
    return out.top_token_ids, out.top_logprobs


def num_top_logprobs_for(any_row_asks: bool) -> int:
    """The num_top_logprobs a step needs: MAX_LOGPROBS when any row asks for logprobs, else 0
    (two compile variants; the engine warms up both)."""
    return MAX_LOGPROBS if any_row_asks else 0


def lower_parts(num_rows: int, vocab_size: int) -> list[jax.stages.Lowered]:
    """Every part of `sample` at (num_rows, vocab_size), lowered with arguments of the kinds serving passes
    (logits on the device, a numpy batch): greedy and random parts with and without the penalty arrays, the
    fallback at each R and cut method this device takes, the token-bitmask pass and the top log-probs.
    Compiling them (`warmup`, or the runner's pool of compile threads) fills the parts' jit caches, so no
    batch traces or compiles later. Lowering only: nothing runs."""
    logits = jax.device_put(np.zeros((num_rows, vocab_size), np.float32))  # as the runner hands it over
    native = native_kernels(logits)
    lowered = []
    for penalties in (False, True):
        params = SamplingParams(temperature=1.0, repetition_penalty=1.1 if penalties else 1.0)
        batch = make_sampling_batch([RowInfo(params, seed=0)], num_rows, vocab_size)
        lowered.append(_greedy_sample.lower(logits, batch, native))
        lowered.append(_candidate_sample.lower(logits, batch, PREFILTER_K, native))
    out = lowered[-1].out_info  # the fallback reads the candidate pass's unfinished sample
    methods = sorted({_cut_method(logits, any_inexact, with_top_k) for any_inexact in (False, True)
                      for with_top_k in (False, True)})  # those this device takes
    for num_fallback_rows in sorted({fallback_rows(n, num_rows) for n in (*FALLBACK_ROW_BUCKETS, num_rows)}):
        index = np.arange(num_fallback_rows, dtype=np.int32)  # the fallback of every R and cut method
        lowered += [_resample_rows.lower(logits, out.token_ids, out.logprobs, out.scaled, out.threshold, batch.top_k,
                                         batch.top_p, batch.min_p, batch.key_data, batch.steps, index,
                                         np.ones(index.shape, bool), cut) for cut in methods]
    lowered.append(_mask_logits.lower(logits, np.full((num_rows, (vocab_size + 31) // 32), -1, np.int32)))
    lowered.append(_top_logprobs.lower(logits, MAX_LOGPROBS, native))
    return lowered


def warmup(num_rows: int, vocab_size: int) -> None:
    """Compile every part of `sample` at (num_rows, vocab_size) (`lower_parts`): nothing compiles later."""
    for lowered in lower_parts(num_rows, vocab_size):
        lowered.compile()


def compiled_variants() -> int:
    """How many programs the sampler's parts have compiled so far (tests: no recompiles)."""
    return sum(f._cache_size() for f in (_greedy_sample, _candidate_sample, _resample_rows, _mask_logits,
                                         _top_logprobs))


@functools.partial(jax.jit, static_argnums=(2,))
def _greedy_sample(logits: jax.Array, batch: SamplingBatch, native: bool = False) -> SamplerOutput:
    """Every row's argmax (K = 0: `with_top_logprobs` adds the top log-probs)."""
    raw = logits.astype(jnp.float32)
    token_ids, lse, finite = _row_stats(process_logits(raw, batch), raw, native)
    return _raw_logprobs(raw, token_ids, 0, lse, finite)


def _row_stats(processed: jax.Array, raw: jax.Array, native: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(argmax(processed) i32[S], logsumexp(raw) f32[S, 1], all(isfinite(raw)) bool[S]): a greedy token and what
    a token's raw log-prob needs. native (static): one call of cpu_sampler.row_stats_cpu (three passes a row, its
    sums in double: at 32 x 49k 0.7 ms against XLA:CPU's 2.4); else XLA's ops. Same ids either way (rows with a
    NaN aside: flagged, never emitted); log-sum-exps within float32 rounding of each other."""
    if native:
        ids, lse, finite = cpu_sampler.row_stats_cpu(processed, raw)
        return ids, lse[:, None], finite
    return _argmax(processed), _logsumexp(raw), jnp.all(jnp.isfinite(raw), axis=-1)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _candidate_sample(logits: jax.Array, batch: SamplingBatch, kp: int, native: bool):
    """Greedy rows: argmax. Random rows: temperature, the min_p / top_k / top_p cut, Gumbel-max over
    each row's kp largest logits (no sort of the vocabulary).

    Returns an unfinished SamplerOutput (K = 0) with scaled f32[S, V] (the tempered, min_p-cut logits), threshold
    f32[S] and flags bool[2, S] = (covered, exact); see `_candidate_tokens`.
    """
    raw = logits.astype(jnp.float32)
    processed = process_logits(raw, batch)
    greedy_ids, lse, finite = _row_stats(processed, raw, native)
    scaled, min_p_threshold = _scale(processed, batch, native)
    token_ids, threshold, flags = _candidate_tokens(greedy_ids, scaled, min_p_threshold, batch, kp, native)
    return dataclasses.replace(_raw_logprobs(raw, token_ids, 0, lse, finite), scaled=scaled, threshold=threshold,
                               flags=flags)


def _scale(processed: jax.Array, batch: SamplingBatch, native: bool = False) -> tuple[jax.Array, jax.Array]:
    """(scaled f32[S, V]: processed / temperature (1 for greedy rows), tokens below the min_p cut at -inf;
    the min_p threshold f32[S], -inf when off). native (static): one call of cpu_sampler.scale_cpu, which
    computes what XLA:CPU does (it multiplies by 1 / temperature), bit for bit."""
    is_greedy = batch.temperature < GREEDY_TEMPERATURE_EPS  # bool[S]
    temperature = jnp.where(is_greedy, 1.0, batch.temperature)  # f32[S]
    if native:
        return cpu_sampler.scale_cpu(processed, 1.0 / temperature, jnp.log(batch.min_p))
    scaled = processed / temperature[:, None]  # f32[S, V]
    min_p_threshold = jnp.max(scaled, axis=-1) + jnp.log(batch.min_p)  # f32[S]; -inf when off
    return jnp.where(scaled >= min_p_threshold[:, None], scaled, -jnp.inf), min_p_threshold


def _candidate_tokens(greedy_ids: jax.Array, scaled: jax.Array, min_p_threshold: jax.Array, batch: SamplingBatch,
                      kp: int, native: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token_ids i32[S], threshold f32[S], flags bool[2, S] = (covered, exact)) of `_candidate_sample`;
    greedy_ids i32[S]: argmax of the processed logits (`_row_stats`), the greedy rows' tokens.

    The cut is a per-row threshold (keep logits >= it) read off the candidates (`_prefilter_threshold`;
    `exact` when they decide it). A random row's token is final when no other token can beat its best
    candidate score (`covered`): every kept token is a candidate, or the score exceeds the last
    candidate's logit + the largest noise the stream can draw (GUMBEL_MAX). native (the CPU): a row with
    its cut but not its token (temperature alone over a flat distribution: most such rows) is covered by
    a native pass over its whole row, which names a few candidates its exact argmax is certainly among
    (cpu_sampler.gumbel_candidates_cpu) and scores them exactly here. Other rows are resampled by
    `_resample_rows`; either way a row's sample is argmax(kept logits + its noise), ties to the
    lowest id. Greedy rows take greedy_ids.
    """
    V = scaled.shape[-1]
    kp = min(kp, V)
    # f32[S, kp] descending, i32[S, kp]; the native call is lax.top_k's result, without its partial sort of each row
    values, ids = cpu_sampler.top_k_cpu(scaled, kp) if native else _top_k(scaled, kp)
    threshold, exact, valid = _prefilter_threshold(scaled, values, batch.top_k, batch.top_p, V)
    threshold = jnp.maximum(threshold, min_p_threshold)  # f32[S]
    token_ids, best = _gumbel_argmax(values, ids, threshold, batch.key_data, batch.steps)
    last = values[:, -1]  # f32[S]; no other token's logit is above it
    covered = (exact & (threshold > last)) | (valid & (best > last + GUMBEL_MAX)) | (kp == V)  # bool[S]
    is_greedy = batch.temperature < GREEDY_TEMPERATURE_EPS  # bool[S]
    if native:  # rows with their cut but not their token (flat, e.g. temperature alone): the whole row, natively
        need = exact & ~covered & ~is_greedy  # bool[S]
        keys = _row_keys(batch.key_data, batch.steps)  # u32[S, 2]
        whole_ids, ok = cpu_sampler.gumbel_candidates_cpu(scaled, threshold, keys, need, GUMBEL_CANDIDATES)
        whole_values = jnp.take_along_axis(scaled, whole_ids, axis=-1)  # f32[S, C]
        whole_token, _ = _gumbel_argmax(whole_values, whole_ids, threshold, batch.key_data, batch.steps)
        decided = need & ok
        token_ids, covered = jnp.where(decided, whole_token, token_ids), covered | decided
    token_ids = jnp.where(is_greedy, greedy_ids, token_ids)
    return token_ids, threshold, jnp.stack([covered, exact])


@functools.partial(jax.jit, static_argnums=(12,))
def _resample_rows(logits, token_ids, logprobs, scaled, threshold, top_k, top_p, min_p, key_data, steps, index, bisect,
                   cut: str):
    """(token_ids i32[S], logprobs f32[S]) with the rows at `index` i32[R] (S: padding) resampled over the whole
    vocabulary: Gumbel noise at every token against the row's threshold, first replaced by the exact cut
    where bisect bool[R], found as `cut` (static, one of CUT_METHODS) says. A row's noise and cut depend on
    that row only: gathered, it draws what it would in place."""
    def take(x):  # x[index] along the rows; padding reads row S - 1 (clipped) and is dropped below
        return jnp.take(x, index, axis=0, mode="clip")

    rows_scaled, rows_threshold = take(scaled), take(threshold)  # f32[R, V], f32[R]
    if cut != "none":
        if cut == "native":
            exact = cpu_sampler.threshold_cpu(rows_scaled, take(top_k), take(top_p))  # f32[R]
        else:
            exact = _bisect_threshold(rows_scaled, take(top_k), take(top_p), cut == "bisect_top_k")
        min_p_threshold = jnp.max(rows_scaled, axis=-1) + jnp.log(take(min_p))  # f32[R]
        rows_threshold = jnp.where(bisect, jnp.maximum(exact, min_p_threshold), rows_threshold)
    R, V = rows_scaled.shape
    all_ids = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (R, V))
    ids, _ = _gumbel_argmax(rows_scaled, all_ids, rows_threshold, take(key_data), take(steps))  # i32[R]
    raw = take(logits).astype(jnp.float32)  # f32[R, V]
    # on the CPU the log-sum-exp of the candidate pass (`_row_stats`, native): a resampled row's log-prob is then the
    # same whichever R rows were gathered with it (XLA's reduction order changes with the row count)
    lse = cpu_sampler.row_stats_cpu(raw, raw)[1] if cut == "native" else _logsumexp(raw)[:, 0]  # f32[R]
    rows_logprobs = jnp.take_along_axis(raw, ids[:, None], axis=-1)[:, 0] - lse
    return token_ids.at[index].set(ids, mode="drop"), logprobs.at[index].set(rows_logprobs, mode="drop")


def _raw_logprobs(raw: jax.Array, token_ids: jax.Array, k: int, lse: jax.Array | None = None,
                  finite: jax.Array | None = None) -> SamplerOutput:
    """Log-probs under log_softmax(raw) of the sampled ids and of the raw top-k; lse f32[S, 1] and finite
    bool[S] of raw when the caller has them (`_row_stats`)."""
    lse = _logsumexp(raw) if lse is None else lse  # f32[S, 1]
    sampled = jnp.take_along_axis(raw, token_ids[:, None], axis=-1) - lse  # f32[S, 1]
    if k == 0:
        top_values = jnp.zeros((raw.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
    else:
        top_values, top_ids = _top_k(raw, k)  # f32[S, K], i32[S, K]
    return SamplerOutput(token_ids=token_ids, logprobs=sampled[:, 0],
                         top_token_ids=top_ids.astype(jnp.int32), top_logprobs=top_values - lse,
                         finite=jnp.all(jnp.isfinite(raw), axis=-1) if finite is None else finite)

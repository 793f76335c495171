"""Sampler: pick the next token of every sequence slot of a batch, on device (vLLM v1's Sampler).

Host side, once per step: `make_sampling_batch(rows, num_rows, vocab_size)`
turns one `RowInfo` per live slot into a `SamplingBatch`, a pytree of fixed
shape numpy arrays (S = num_rows, the padded batch bucket). Rows beyond
`len(rows)` are padding: greedy and neutral, their results are garbage.
The runner builds the same batch from constants it keeps per request across
steps (`RowConstants`: its params' scalars, its seed's key data) and RowInfos
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

The fused step (jaxpaged/worker/model_runner.py, `fuse_sampler`) traces `sample_in_step` into the step's own
program instead: the same operations as the parts above (so the same samples), every optional array present
(`neutral_arrays` when absent), in two programs the host picks between as above (greedy-only batches:
argmax; else the candidate pass); `finish_in_step` runs the fallback when its flags ask and
`_top_logprobs` when a row asks for logprobs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.worker.kept_rows import KeptRows
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from pallas_kernels import cpu_sampler

MAX_BIAS_ENTRIES = 320  # OpenAI allows 300 logit_bias entries; the rest is room for banned ids
GREEDY_TEMPERATURE_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it sample greedily
_PRNG_IMPL = "threefry2x32"
# Above any Gumbel noise the stream draws: u <= 1 - 2**-24, so -log(-log(u)) <= 16.64
GUMBEL_MAX = 17.0
PREFILTER_K = 256  # candidates per row of the sort-free top_k / top_p / min_p cut
GUMBEL_CANDIDATES = 4  # tokens the native whole-row pass names per row (cpu_sampler.gumbel_candidates_cpu)
_U32_MASK = 0xFFFFFFFF
_U64_MASK = 0xFFFFFFFFFFFFFFFF


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
        banned = self.banned_token_ids
        object.__setattr__(self, "banned_token_ids", tuple(int(t) for t in banned) if banned else ())
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"RowInfo.params must be a SamplingParams, got {type(self.params).__name__}")
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise ValueError(f"RowInfo.seed={self.seed!r}: must be an integer")
        if not isinstance(self.step, (int, np.integer)) or not 0 <= self.step <= _U32_MASK:
            raise ValueError(f"RowInfo.step={self.step!r}: must be an integer in [0, 2**32)")

    @property
    def uses_penalties(self) -> bool:
        return self.params.uses_penalties


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
    return seeds_key_data([seed])[0]


def seeds_key_data(seeds: Sequence[int]) -> np.ndarray:
    """u32[N, 2]: `seed_key_data` of each seed (high 32 bits, low 32 bits of the seed mod 2**64)."""
    wide = np.array([int(seed) & _U64_MASK for seed in seeds], np.uint64).reshape(-1)  # u64[N]
    return np.stack([wide >> np.uint64(32), wide & np.uint64(_U32_MASK)], axis=1).astype(np.uint32)


def step_key(seed: int, step: int) -> jax.Array:
    """The typed PRNG key a row with this (seed, step) samples with (for tests and debugging)."""
    key = jax.random.wrap_key_data(jnp.asarray(seed_key_data(seed)), impl=_PRNG_IMPL)
    return jax.random.fold_in(key, np.uint32(step))


def make_sampling_batch(rows: Sequence[RowInfo], num_rows: int, vocab_size: int, *,
                        max_bias_entries: int = MAX_BIAS_ENTRIES,
                        token_bitmask: np.ndarray | None = None) -> SamplingBatch:
    """Host arrays for one step: rows[i] fills slot i, slots len(rows).. are greedy padding.

    token_bitmask: i32[num_rows, ceil(vocab_size / 32)] of allowed tokens (structured outputs), or None."""
    scalars, key_data, steps = row_constants(rows, vocab_size)
    special = {i: row for i, row in enumerate(rows) if needs_row_info(row.params, row.banned_token_ids)}
    return assemble_sampling_batch(scalars, key_data, steps, special, num_rows, vocab_size,
                                   max_bias_entries=max_bias_entries, token_bitmask=token_bitmask)


def row_constants(rows: Sequence[RowInfo], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(f64[n, 7] `row_scalars`, u32[n, 2] key data, i64[n] key steps) of n rows."""
    scalars = np.array([row_scalars(row.params, vocab_size) for row in rows], np.float64).reshape(len(rows), 7)
    return scalars, seeds_key_data([row.seed for row in rows]), np.array([row.step for row in rows], np.int64)


def needs_row_info(params: SamplingParams, banned_token_ids: Sequence[int]) -> bool:
    """Whether a row of these params and banned ids needs more than its constants (its RowInfo, a special row of
    `assemble_sampling_batch`): a logit bias, banned ids or penalties."""
    return bool(banned_token_ids or params.logit_bias or params.uses_penalties)


def assemble_sampling_batch(scalars: np.ndarray, key_data: np.ndarray, steps: Sequence[int] | np.ndarray,
                            special: dict[int, RowInfo], num_rows: int, vocab_size: int, *,
                            max_bias_entries: int = MAX_BIAS_ENTRIES,
                            token_bitmask: np.ndarray | None = None) -> SamplingBatch:
    """`make_sampling_batch` from n rows' constants: scalars f64[n, 7] (`row_scalars`), key data u32[n, 2]
    (`seeds_key_data`) and key steps [n]; special {row i: its RowInfo} for every row `needs_row_info` says needs
    more (the rows not in it have no bias, banned ids or penalties). Slots n.. are greedy padding."""
    n = len(scalars)
    _check_token_bitmask(token_bitmask, num_rows, vocab_size)
    if not isinstance(num_rows, int) or num_rows < max(1, n):
        raise ValueError(f"num_rows={num_rows!r}: must be an integer >= max(1, len(rows)={n})")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r}: must be an integer >= 1")
    if not isinstance(max_bias_entries, int) or max_bias_entries < 1:
        raise ValueError(f"max_bias_entries={max_bias_entries!r}: must be an integer >= 1")
    steps = np.asarray(steps, np.int64).reshape(-1)
    if len(key_data) != n or len(steps) != n or (n and not (0 <= steps.min() and steps.max() <= _U32_MASK)):
        raise ValueError(f"{n} rows need {n} key data rows and key steps in [0, 2**32), got {len(key_data)} "
                         f"and {steps.tolist()}")
    S, B = num_rows, max_bias_entries
    table = np.empty((S, 7), np.float64)  # the padding rows: greedy, neutral
    table[:n], table[n:] = scalars, _PADDING_SCALARS
    temperature, top_k, top_p, min_p, presence, frequency, repetition = table.T
    padded_key_data = np.zeros((S, 2), np.uint32)
    padded_key_data[:n] = key_data
    padded_steps = np.zeros((S,), np.uint32)
    padded_steps[:n] = steps
    bias_ids = np.full((S, B), -1, np.int32)
    bias_values = np.zeros((S, B), np.float32)
    for i, row in special.items():
        if row.banned_token_ids or row.params.logit_bias:
            _fill_bias_row(bias_ids[i], bias_values[i], row, vocab_size, i)
    counts, prompt_mask = _penalty_arrays(special, S, vocab_size)
    f32 = np.float32
    return SamplingBatch(
        temperature=temperature.astype(f32), top_k=top_k.astype(np.int32), top_p=top_p.astype(f32),
        min_p=min_p.astype(f32), presence_penalty=presence.astype(f32), frequency_penalty=frequency.astype(f32),
        repetition_penalty=repetition.astype(f32), key_data=padded_key_data, steps=padded_steps, bias_ids=bias_ids,
        bias_values=bias_values, output_counts=counts, prompt_mask=prompt_mask, token_bitmask=token_bitmask)


class RowConstants:
    """Each scheduled request's sampler constants (its params' `row_scalars`, its seed's key data), kept across its
    steps by request id (`kept_rows.KeptRows`): a step gathers them instead of reading every row's params again.
    A request's row is made again whenever its params object or seed is not the one it was made from."""

    def __init__(self, vocab_size: int, capacity: int):
        self.vocab_size = vocab_size
        self._kept = KeptRows(capacity, 9, np.float64)  # f64[C, 9]: row_scalars, then the key data's two words

    def __len__(self) -> int:
        return len(self._kept)

    def gather(self, rows: Sequence[tuple[str, SamplingParams, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(f64[n, 7] scalars, u32[n, 2] key data) of n rows given as (request id, params, seed), distinct ids."""
        table = self._kept.rows([rid for rid, _, _ in rows], [(params, seed) for _, params, seed in rows],
                                self._make, _same_params_and_seed)
        return table[:, :7], table[:, 7:].astype(np.uint32)

    def _make(self, source: tuple[SamplingParams, int]) -> tuple:
        params, seed = source
        RowInfo(params, seed)  # validates
        return (*row_scalars(params, self.vocab_size), *seed_key_data(seed).tolist())

    def release(self, request_ids) -> None:
        """Forget these requests (finished); an id not kept is ignored."""
        self._kept.release(request_ids)


def _same_params_and_seed(kept: tuple[SamplingParams, int], source: tuple[SamplingParams, int]) -> bool:
    return kept[0] is source[0] and kept[1] == source[1]


def _check_token_bitmask(bitmask: np.ndarray | None, S: int, V: int) -> None:
    if bitmask is None:
        return
    width = (V + 31) // 32
    if not isinstance(bitmask, np.ndarray) or bitmask.dtype != np.int32 or bitmask.shape != (S, width):
        raise ValueError(f"token_bitmask must be an int32 numpy array of shape {(S, width)}, got "
                         f"{getattr(bitmask, 'dtype', type(bitmask).__name__)} {getattr(bitmask, 'shape', '')}")


# (temperature, top_k, top_p, min_p, presence, frequency, repetition) of a padding row: greedy, neutral
_PADDING_SCALARS = (0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0)


def row_scalars(p: SamplingParams, vocab_size: int) -> tuple[float, ...]:
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


def _penalty_arrays(rows: dict[int, RowInfo], S: int, V: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Dense output counts i32[S, V] and prompt mask bool[S, V] of {slot: row}, or (None, None) when no row needs
    them."""
    if not any(row.uses_penalties for row in rows.values()):
        return None, None
    counts = np.zeros((S, V), np.int32)
    prompt_mask = np.zeros((S, V), np.bool_)
    for i, row in rows.items():
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
    out, scaled, threshold, flags = _candidate_sample(logits, batch, prefilter_k, native)
    out = with_top_logprobs(out, logits, num_top_logprobs)
    return functools.partial(_finish_random, logits, batch, random_rows, out, scaled, threshold, flags)


def with_top_logprobs(out: SamplerOutput, raw: jax.Array, num_top_logprobs: int) -> SamplerOutput:
    """out with the top log-probs of raw f32[S, V] (the logits the sampler read, after any token bitmask) when
    num_top_logprobs > 0: `_top_logprobs`, a program of its own dispatched only then, so that the sampler's
    parts have no variant per num_top_logprobs (half the programs to compile at warm-up)."""
    if not num_top_logprobs:
        return out
    top_ids, top_logprobs = _top_logprobs(raw, num_top_logprobs, native_kernels(raw))
    return dataclasses.replace(out, top_token_ids=top_ids, top_logprobs=top_logprobs)


def _finish_random(logits, batch: SamplingBatch, random_rows: np.ndarray, out: SamplerOutput, scaled, threshold,
                   flags) -> SamplerOutput:
    """The fallbacks of a batch with random rows, decided from `_candidate_sample`'s flags (read back here):
    only the rows that need them are resampled, gathered into R = `fallback_rows(n, S)` rows."""
    covered, exact = np.asarray(flags)  # bool[2, S]
    rows = np.flatnonzero(random_rows & ~covered)  # the n rows whose candidates did not decide the token
    if rows.size == 0:
        return out
    S = len(random_rows)
    index = np.full(fallback_rows(rows.size, S), S, np.int32)  # i32[R]; S: padding (read clipped, never written)
    index[:rows.size] = rows
    bisect = np.zeros(index.shape, bool)  # bool[R]: rows whose cut the candidates did not decide
    bisect[:rows.size] = ~exact[rows]
    with_top_k = bool((np.asarray(batch.top_k)[rows][bisect[:rows.size]] > 0).any())
    token_ids, logprobs = _resample_rows(logits, out.token_ids, out.logprobs, scaled, threshold, batch.top_k,
                                         batch.top_p, batch.min_p, batch.key_data, batch.steps, index, bisect,
                                         _cut_method(scaled, bisect.any(), with_top_k))
    return dataclasses.replace(out, token_ids=token_ids, logprobs=logprobs)


FALLBACK_ROW_BUCKETS = (1, 4, 16)  # R of a fallback below S: one program per (S, R) and cut method
CUT_METHODS = ("none", "native", "bisect", "bisect_top_k")  # how `_resample_rows` finds the exact cut


def native_kernels(x: jax.Array) -> bool:
    """Whether the sampler's parts over x (a concrete array) use the native CPU kernels (cpu_sampler.cc): the
    candidates' top-k, the fallback's exact cut and the rows' argmax / log-sum-exp (`_row_stats`). Where x
    lives on the CPU and the kernels build."""
    return all(d.platform == "cpu" for d in x.devices()) and cpu_sampler.load_cpu_sampler()


def _cut_method(x: jax.Array, any_inexact: bool, with_top_k: bool) -> str:
    """`_resample_rows`' cut: "native" (cpu_sampler.cc) for arrays on the CPU where it builds, also when the
    candidates decided every row's cut (rows not marked keep theirs; the cut adds 0-7% to the fallback's noise
    over the vocabulary, docs/benchmarks.md, and each (S, R) then has one program, not two, to compile at
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


# ---- the sampler inside the step program (ModelRunner's fused step) ----------


@dataclasses.dataclass(frozen=True, eq=False)
class StepSample:
    """The sampler's part of a fused step program (`sample_in_step`): S rows over V. A pytree."""

    out: SamplerOutput  # K = 0 (finish_in_step adds the top log-probs)
    logits: jax.Array  # f32[S, V]: raw logits after the token bitmask (the fallbacks and top log-probs read them)
    scaled: jax.Array | None  # f32[S, V]: tempered, min_p-cut logits; None in the greedy program
    threshold: jax.Array | None  # f32[S]: each random row's cut; idem
    flags: jax.Array | None  # bool[2, S]: (covered, exact) of `_candidate_tokens`; idem
    steps: jax.Array | None = None  # u32[S]: the key steps the rows drew with (the fallbacks draw with them); idem


jax.tree_util.register_dataclass(
    StepSample, data_fields=["out", "logits", "scaled", "threshold", "flags", "steps"], meta_fields=[])


def neutral_arrays(num_rows: int, vocab_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Device arrays standing in for a batch's absent optional fields in the fused step, so that one program
    serves every batch: output counts i32[S, V] of zeros, prompt mask bool[S, V] all False (penalties then
    change nothing) and a token bitmask i32[S, ceil(V / 32)] allowing every token. Made once per S."""
    width = (vocab_size + 31) // 32
    return (jnp.zeros((num_rows, vocab_size), jnp.int32), jnp.zeros((num_rows, vocab_size), jnp.bool_),
            jnp.full((num_rows, width), -1, jnp.int32))


def with_neutral_arrays(batch: SamplingBatch, neutral: tuple[jax.Array, jax.Array, jax.Array]) -> SamplingBatch:
    """`batch` with its absent counts, prompt mask and token bitmask taken from `neutral_arrays`."""
    counts, prompt_mask, bitmask = neutral
    if batch.output_counts is None:
        batch = dataclasses.replace(batch, output_counts=counts, prompt_mask=prompt_mask)
    return batch if batch.token_bitmask is not None else dataclasses.replace(batch, token_bitmask=bitmask)


def sample_in_step(logits: jax.Array, batch: SamplingBatch, fed_token_ids: jax.Array, *, random: bool,
                   prefilter_k: int = PREFILTER_K, native: bool = False) -> StepSample:
    """`sample_deferred`'s device part, traced inside the step's own program (pure; not jitted here).

    logits f32[S, V]; batch: every field present (`with_neutral_arrays`); fed_token_ids i32[S, F]: output
    tokens of each row's request the host's counts do not hold yet (async scheduling: the previous step's token,
    fed this step as a placeholder, the drafts it accepted and the drafts fed before the row:
    `model_runner.outputs_in_flight`), -1 for none. random (static, the host's choice, as `sample` makes it):
    some row samples at random, so the candidate pass runs (else argmax only). native (static): the step
    runs on the CPU, so the candidates' top-k is the native call (as `native_kernels` says for the parts)
    where it builds. No top log-probs (`finish_in_step` adds them when asked). Same operations as the
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
        out = _raw_logprobs(raw, greedy_ids, 0, lse)
        return StepSample(dataclasses.replace(out, finite=finite), raw, None, None, None)
    scaled, min_p_threshold = _scale(processed, batch, native)
    token_ids, threshold, flags = _candidate_tokens(greedy_ids, scaled, min_p_threshold, batch, prefilter_k, native)
    out = _raw_logprobs(raw, token_ids, 0, lse)
    return StepSample(dataclasses.replace(out, finite=finite), raw, scaled, threshold, flags, batch.steps)


def _count_fed_tokens(counts: jax.Array, fed_token_ids: jax.Array) -> jax.Array:
    """i32[S, V]: counts with one more for each of a row's fed tokens i32[S, F] (-1: none); elementwise (F
    compares an element, F small: 2k + 1 for k drafts a row), it fuses with its users."""
    vocabulary = jnp.arange(counts.shape[-1], dtype=jnp.int32)[None, :]  # i32[1, V]
    for f in range(fed_token_ids.shape[1]):
        counts = counts + (vocabulary == fed_token_ids[:, f, None]).astype(counts.dtype)
    return counts


def finish_in_step(state: StepSample, batch: SamplingBatch, num_top_logprobs: int) -> Callable[[], SamplerOutput]:
    """`sample_deferred`'s `finish` for a fused step. Its token_ids are `state.out.token_ids` themselves
    unless a random row needed a fallback (the flags are read back only when some row samples at random):
    `_resample_rows`, a separate program run only when the flags ask, over those rows only (O(V) passes
    per row, 32 halvings and noise over the whole vocabulary, that the candidate pass almost always makes
    unnecessary). num_top_logprobs > 0 (some row asks): `_top_logprobs` adds the raw top-k, also a
    separate program, as a top-k over the vocabulary in every step (XLA:GPU sorts for k = 20) would cost
    more than one small dispatch on the steps that ask."""
    def finish() -> SamplerOutput:
        out = state.out
        if state.flags is not None:  # keyed as the program drew (its steps may have moved: async scheduling)
            random_rows = np.asarray(batch.temperature) >= GREEDY_TEMPERATURE_EPS  # host copy (a numpy batch)
            out = _finish_random(state.logits, dataclasses.replace(batch, steps=state.steps), random_rows, out,
                                 state.scaled, state.threshold, state.flags)
        return with_top_logprobs(out, state.logits, num_top_logprobs)
    return finish


@functools.partial(jax.jit, static_argnums=(1, 2))
def _top_logprobs(raw: jax.Array, k: int, native: bool = False) -> tuple[jax.Array, jax.Array]:
    """(i32[S, K] ids, f32[S, K] log-probs) of the raw distribution's k most likely tokens (`_raw_logprobs`'),
    under the log-sum-exp the parts give the sampled token's log-prob (`_row_stats`; native: static)."""
    raw = raw.astype(jnp.float32)
    _, lse, finite = _row_stats(raw, raw, native)
    out = _raw_logprobs(raw, jnp.zeros(raw.shape[:1], jnp.int32), k, lse, finite)
    return out.top_token_ids, out.top_logprobs


def num_top_logprobs_for(requested: Sequence[int | None]) -> int:
    """The num_top_logprobs a step needs: MAX_LOGPROBS when any row asks for logprobs, else 0
    (two compile variants; the engine warms up both)."""
    return MAX_LOGPROBS if any(k is not None for k in requested) else 0


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
    out, scaled, threshold, _ = lowered[-1].out_info  # the fallback reads the candidate pass's outputs
    methods = sorted({_cut_method(logits, any_inexact, with_top_k) for any_inexact in (False, True)
                      for with_top_k in (False, True)})  # those this device takes
    for num_fallback_rows in sorted({fallback_rows(n, num_rows) for n in (*FALLBACK_ROW_BUCKETS, num_rows)}):
        index = np.arange(num_fallback_rows, dtype=np.int32)  # the fallback of every R and cut method
        lowered += [_resample_rows.lower(logits, out.token_ids, out.logprobs, scaled, threshold, batch.top_k,
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


@jax.jit
def _mask_logits(logits: jax.Array, bitmask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits f32[S, V] with the bitmask's disallowed tokens at -inf, finite bool[S] of the unmasked rows)."""
    raw = logits.astype(jnp.float32)
    return apply_token_bitmask(raw, bitmask), jnp.all(jnp.isfinite(raw), axis=-1)


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

    Returns (SamplerOutput (K = 0), scaled f32[S, V] (the tempered, min_p-cut logits), threshold f32[S],
    flags bool[2, S] = (covered, exact)); see `_candidate_tokens`.
    """
    raw = logits.astype(jnp.float32)
    processed = process_logits(raw, batch)
    greedy_ids, lse, finite = _row_stats(processed, raw, native)
    scaled, min_p_threshold = _scale(processed, batch, native)
    token_ids, threshold, flags = _candidate_tokens(greedy_ids, scaled, min_p_threshold, batch, kp, native)
    return _raw_logprobs(raw, token_ids, 0, lse, finite), scaled, threshold, flags


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
    rows_logprobs = jnp.take_along_axis(raw, ids[:, None], axis=-1)[:, 0] - _logsumexp(raw)[:, 0]
    return token_ids.at[index].set(ids, mode="drop"), logprobs.at[index].set(rows_logprobs, mode="drop")


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

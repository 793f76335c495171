"""The sampler's host side: one step's `SamplingBatch`, built from each row's params and seed.

`make_sampling_batch(rows, num_rows, vocab_size)` turns one `RowInfo` per live slot into a `SamplingBatch`, a
pytree of fixed-shape numpy arrays (S = num_rows, the padded batch bucket; rows past `len(rows)` are greedy,
neutral padding). The runner builds the same batch from constants it keeps per request across steps
(`worker.input_batch.InputBatch`: its params' scalars, its seed's key data) and RowInfos only for the rows that need more
(`assemble_sampling_batch`). Shapes are documented on `SamplingBatch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling_params import SamplingParams

MAX_BIAS_ENTRIES = 320  # OpenAI allows 300 logit_bias entries; the rest is room for banned ids
GREEDY_TEMPERATURE_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it sample greedily
_PRNG_IMPL = "threefry2x32"
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

    A fused step (jaxpaged/worker/step_program.py `fused_step`, which runs the sampler in the step's program)
    takes its batch with every optional array present (`in_step.with_neutral_arrays`) and the fields after
    `token_bitmask` set (`ModelRunner._step_sampling`): what the step takes from the step in flight (async
    scheduling) and its packed drafts (T tokens, R = max_num_seqs, k drafts a row). The separate sampler's batches
    leave them None.

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
    bias_ids: np.ndarray | None  # i32[S, B]; -1 = unused slot (None: no row has one, for a fused step only)
    bias_values: np.ndarray | None  # f32[S, B]; -inf for banned ids (idem)
    output_counts: np.ndarray | None = None  # i32[S, V]; only when some row uses penalties
    prompt_mask: np.ndarray | None = None  # bool[S, V]; idem
    token_bitmask: np.ndarray | None = None  # i32[S, W], W = ceil(V / 32); only when some row is constrained
    # ---- a fused step's only ----
    previous_tokens: jax.Array | None = None  # i32[R]: the previous step's sampled tokens, zero-padded
    sources: np.ndarray | None = None  # i32[T]: the row of previous_tokens each placeholder position takes, else -1
    previous_rejected: jax.Array | None = None  # i32[R]: the previous step's rejected drafts per row (its carry)
    shifts: np.ndarray | None = None  # i32[T]: the row of previous_rejected each position moves back by, else -1
    previous_accepted: jax.Array | None = None  # i32[R, k]: the previous step's accepted drafts per row, -1 past them
    count_from: np.ndarray | None = None  # i32[S]: each row's first fed token its penalty counts lack (T: none)
    draft_rows: np.ndarray | None = None  # i32[S, k]: packed drafts: slot m's draft rows (else 0)
    draft_ids: np.ndarray | None = None  # i32[S, k]: slot m's drafts, -1 for none (never accepted)
    redraft: object | None = None  # spec_decode.verify.Redraft: the drafts the device proposes

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def has_penalties(self) -> bool:
        return self.output_counts is not None


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
                            max_bias_entries: int = MAX_BIAS_ENTRIES, token_bitmask: np.ndarray | None = None,
                            neutral_bias: bool = False) -> SamplingBatch:
    """`make_sampling_batch` from n rows' constants: scalars f64[n, 7] (`row_scalars`), key data u32[n, 2]
    (`seeds_key_data`) and key steps [n]; special {row i: its RowInfo} for every row `needs_row_info` says needs
    more (the rows not in it have no bias, banned ids or penalties). Slots n.. are greedy padding.
    neutral_bias: leave bias_ids and bias_values None when no row has a bias or banned ids (a fused step's batch:
    `in_step.with_neutral_arrays` gives it the device's neutral pair, so nothing [S, B] is made or sent)."""
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
    biased = {i: row for i, row in special.items() if row.banned_token_ids or row.params.logit_bias}
    bias_ids = bias_values = None
    if biased or not neutral_bias:
        bias_ids, bias_values = np.full((S, B), -1, np.int32), np.zeros((S, B), np.float32)
    for i, row in biased.items():
        _fill_bias_row(bias_ids[i], bias_values[i], row, vocab_size, i)
    counts, prompt_mask = _penalty_arrays(special, S, vocab_size)
    f32 = np.float32
    return SamplingBatch(
        temperature=temperature.astype(f32), top_k=top_k.astype(np.int32), top_p=top_p.astype(f32),
        min_p=min_p.astype(f32), presence_penalty=presence.astype(f32), frequency_penalty=frequency.astype(f32),
        repetition_penalty=repetition.astype(f32), key_data=padded_key_data, steps=padded_steps, bias_ids=bias_ids,
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

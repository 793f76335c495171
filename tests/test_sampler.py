"""The sampler against NumPy references of vLLM's formulas (CPU, small vocabularies).

Most tests share one shape (S=8, V=64) so they share `sample_jit`'s compiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from jaxpaged.sample.sampling_batch import (MAX_BIAS_ENTRIES, RowInfo, SamplingBatch, assemble_sampling_batch,
                                           make_sampling_batch, needs_row_info, seed_key_data, step_key)
from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.sample.sampler import SamplerOutput, sample, sample_jit
from jaxpaged.sample.ops import process_logits
from jaxpaged.sample import in_step
from jaxpaged.sample.sampler import compiled_variants, warmup
from jaxpaged.sampling_params import SamplingParams as SP

S, V = 8, 64


def logits_of(seed: int, rows: int = S, vocab: int = V, scale: float = 2.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal((rows, vocab))).astype(np.float32)


def run(logits, rows, num_rows=None, k=20) -> SamplerOutput:
    batch = make_sampling_batch(rows, num_rows or logits.shape[0], logits.shape[1])
    return jax.device_get(sample_jit(jnp.asarray(logits), batch, num_top_logprobs=k))


def draws(logit_row: np.ndarray, params: SP, num: int, seed0: int = 0, step: int = 0) -> np.ndarray:
    """`num` samples of one logits row: one batch row per seed seed0.. (independent keys)."""
    rows = [RowInfo(params, seed=seed0 + i, step=step) for i in range(num)]
    return run(np.tile(logit_row, (num, 1)), rows, k=0).token_ids


# ---- NumPy references ----------------------------------------------------------


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_process(logit_row, params: SP, prompt=(), output=(), banned=()):
    """vLLM's order: logit_bias (+ banned ids), repetition, frequency and presence penalties."""
    x = np.asarray(logit_row, np.float64).copy()
    for t, b in params.logit_bias or ():
        x[t] += b
    x[list(banned)] = -np.inf
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x))
    seen = (counts > 0) | np.isin(np.arange(len(x)), prompt)
    rp = params.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def np_kept(logit_row, params: SP) -> np.ndarray:
    """bool[V]: tokens that survive temperature, min_p, then top_k, then top_p (each on what is left)."""
    x = np.asarray(logit_row, np.float64) / params.temperature
    keep = np.exp(np_log_softmax(x)) >= params.min_p * np.exp(np_log_softmax(x)).max()
    if 0 < params.top_k < len(x):
        keep &= x >= np.sort(x[keep])[::-1][min(params.top_k, keep.sum()) - 1]
    if params.top_p < 1.0:
        order = np.argsort(-np.where(keep, x, -np.inf), kind="stable")
        probs = np.exp(np_log_softmax(np.where(keep, x, -np.inf)))[order]
        mass_before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        n = max(1, int((mass_before < params.top_p).sum()))
        keep &= x >= x[order[n - 1]]
    return keep


def np_distribution(logit_row, params: SP) -> np.ndarray:
    x = np.asarray(logit_row, np.float64) / params.temperature
    x = np.where(np_kept(logit_row, params), x, -np.inf)
    return np.exp(np_log_softmax(x))


# ---- greedy, temperature, truncation ---------------------------------------------


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = logits_of(0)
    logits[3, [7, 9, 40]] = 50.0  # a three-way tie: the lowest id wins
    out = run(logits, [RowInfo(SP(temperature=0.0), seed=i) for i in range(S)])
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, -1))
    assert out.token_ids[3] == 7


def test_tiny_temperature_is_greedy():
    logits = logits_of(1)
    out = run(logits, [RowInfo(SP(temperature=1e-6, top_k=3), seed=i) for i in range(S)])
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, -1))


@pytest.mark.parametrize("params", [
    SP(temperature=0.7),
    SP(temperature=1.5),
    SP(temperature=1.0, top_k=3),
    SP(temperature=1.0, top_p=0.8),
    SP(temperature=1.0, min_p=0.2),
    SP(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
], ids=["t0.7", "t1.5", "topk", "topp", "minp", "combined"])
def test_sampling_frequencies_match_reference(params):
    logit_row = np.array([2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -0.9, -1.6], np.float32)
    tokens = np.concatenate([draws(logit_row, params, 2048, seed0=0, step=s) for s in range(4)])
    expected = np_distribution(logit_row, params)
    observed = np.bincount(tokens, minlength=len(logit_row))
    assert observed[expected == 0].sum() == 0, (observed, expected)
    support = expected > 0
    result = stats.chisquare(observed[support], expected[support] * len(tokens))
    assert result.pvalue > 1e-3, (observed, expected * len(tokens))


@pytest.mark.parametrize("params", [
    SP(temperature=1.0, top_k=5), SP(temperature=1.0, top_p=0.6), SP(temperature=0.5, min_p=0.1),
    SP(temperature=2.0, top_k=10, top_p=0.7), SP(temperature=1.0, top_k=1), SP(temperature=1.0, top_p=0.01),
])
def test_truncation_support_is_exactly_the_reference_set(params):
    """Enough draws hit every kept token and none of the others (V=64, random logits)."""
    logit_row = logits_of(2, rows=1, scale=1.0)[0]
    kept = np_kept(logit_row, params)
    tokens = draws(logit_row, params, 2048)
    assert set(np.unique(tokens)) == set(np.flatnonzero(kept))


def test_top_k_at_least_vocab_and_minus_one_are_off():
    logit_row = logits_of(3, rows=1, scale=0.1)[0]
    for top_k in (-1, 0, V, V + 5):
        assert len(np.unique(draws(logit_row, SP(temperature=1.0, top_k=top_k), 2048))) == V


# ---- bias, banned ids, penalties ----------------------------------------------------


def test_logit_bias_forces_and_bans():
    logits = logits_of(4, scale=1.0)
    rows = [RowInfo(SP(temperature=1.0, logit_bias=((17, 100.0),)), seed=i) for i in range(4)]
    rows += [RowInfo(SP(temperature=0.0, logit_bias=((int(np.argmax(logits[i])), -100.0),)), seed=i)
             for i in range(4, S)]
    out = run(logits, rows)
    assert (out.token_ids[:4] == 17).all()
    np.testing.assert_array_equal(out.token_ids[4:], np.argsort(-logits[4:], axis=-1)[:, 1])


def test_banned_ids_are_never_sampled():
    banned = tuple(range(0, V, 2))
    logit_row = np.zeros(V, np.float32)
    logit_row[list(banned[:5])] = 30.0  # even the most likely banned ids lose
    params = SP(temperature=5.0)
    rows = [RowInfo(params, seed=i, banned_token_ids=banned) for i in range(2048)]
    tokens = run(np.tile(logit_row, (2048, 1)), rows, k=0).token_ids
    assert not np.isin(tokens, banned).any()
    assert len(np.unique(tokens)) == V // 2


@pytest.mark.parametrize("params", [
    SP(repetition_penalty=1.7), SP(repetition_penalty=0.6), SP(frequency_penalty=0.8),
    SP(presence_penalty=-1.2), SP(frequency_penalty=-0.5, presence_penalty=1.5, repetition_penalty=1.3,
                                  logit_bias=((5, 3.0), (9, -2.0))),
])
def test_penalties_match_numpy(params):
    logits = logits_of(5)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, V, size=int(rng.integers(0, 20))).tolist() for _ in range(S)]
    outputs = [rng.integers(0, V, size=int(rng.integers(0, 30))).tolist() for _ in range(S)]
    rows = [RowInfo(params, seed=i, prompt_token_ids=prompts[i], output_token_ids=outputs[i],
                    banned_token_ids=(i,)) for i in range(S)]
    batch = make_sampling_batch(rows, S, V)
    assert batch.has_penalties
    got = np.asarray(process_logits(jnp.asarray(logits), batch))
    want = np.stack([np_process(logits[i], params, prompts[i], outputs[i], (i,)) for i in range(S)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    greedy = [RowInfo(SP(temperature=0.0, **_penalty_fields(params)), seed=0, prompt_token_ids=prompts[i],
                      output_token_ids=outputs[i], banned_token_ids=(i,)) for i in range(S)]
    np.testing.assert_array_equal(run(logits, greedy).token_ids, np.argmax(got, -1))


def _penalty_fields(params: SP) -> dict:
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    return {name: getattr(params, name) for name in names}


def test_penalty_arrays_only_when_needed():
    plain = make_sampling_batch([RowInfo(SP(temperature=0.5, logit_bias=((1, 2.0),)), seed=0)], S, V)
    assert plain.output_counts is None and plain.prompt_mask is None and not plain.has_penalties
    mixed = make_sampling_batch([RowInfo(SP(), seed=0, output_token_ids=[3, 3]),
                                 RowInfo(SP(frequency_penalty=1.0), seed=1, output_token_ids=[3, 3, 4])], S, V)
    assert mixed.output_counts.shape == (S, V) and mixed.output_counts.dtype == np.int32
    assert mixed.output_counts[0].sum() == 0  # neutral row: counts never read, not filled
    assert mixed.output_counts[1, 3] == 2 and mixed.output_counts[1, 4] == 1
    assert not mixed.prompt_mask.any()  # no repetition penalty: the prompt is not read


# ---- log-probs ---------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_raw_log_softmax(temperature):
    logits = logits_of(7)
    rows = [RowInfo(SP(temperature=temperature, repetition_penalty=1.5, logit_bias=((3, 10.0),)), seed=i,
                    output_token_ids=[1, 2]) for i in range(S)]
    out = run(logits, rows, k=20)
    ref = np_log_softmax(logits)
    assert out.top_token_ids.shape == (S, 20) and out.top_logprobs.shape == (S, 20)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(S), out.token_ids], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.top_token_ids, np.argsort(-logits, axis=-1, kind="stable")[:, :20])
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, out.top_token_ids, -1), atol=1e-5)


def test_zero_top_logprobs():
    out = run(logits_of(8), [RowInfo(SP(), seed=0)], k=0)
    assert out.top_token_ids.shape == (S, 0) and out.top_logprobs.shape == (S, 0)
    assert np.isfinite(out.logprobs[0])


# ---- seeds and reproducibility ------------------------------------------------------


def test_key_derivation_matches_fold_in_of_prng_key():
    for seed, step in [(0, 0), (5, 3), (2**32 - 1, 7), (123456, 2**31)]:
        want = jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), step))
        np.testing.assert_array_equal(jax.random.key_data(step_key(seed, step)), want)
    np.testing.assert_array_equal(seed_key_data(2**40 + 9), [256, 9])
    np.testing.assert_array_equal(seed_key_data(-1), [2**32 - 1, 2**32 - 1])


def test_seeded_row_is_independent_of_batch_and_row():
    params = SP(temperature=1.3, top_p=0.95)
    row = RowInfo(params, seed=1234, step=9)
    logit_row = logits_of(9, rows=1, vocab=V, scale=0.3)[0]
    alone = run(logit_row[None], [row]).token_ids[0]
    others = logits_of(10)
    for other_params in (SP(temperature=0.0), SP(temperature=2.0, top_k=3, min_p=0.1)):
        logits = others.copy()
        logits[5] = logit_row
        rows = [RowInfo(other_params, seed=i) for i in range(5)] + [row]
        assert run(logits, rows).token_ids[5] == alone


def test_streams_differ_across_steps_and_seeds():
    logit_row = np.zeros(1000, np.float32)  # flat: every token equally likely
    params = SP(temperature=1.0)

    def stream(seed):
        rows = [RowInfo(params, seed=seed, step=step) for step in range(S)]
        return tuple(run(np.tile(logit_row, (S, 1)), rows, k=0).token_ids)

    a, b = stream(42), stream(43)
    assert a == stream(42)
    assert len(set(a)) > S // 2 and a != b


def test_n_children_with_seed_plus_i_differ_and_reproduce():
    logit_row = np.zeros(1000, np.float32)
    params = SP(n=4, temperature=2.0, seed=77)
    rows = [RowInfo(params, seed=params.seed + i, step=0) for i in range(4)]
    first = run(np.tile(logit_row, (4, 1)), rows, k=0).token_ids
    assert len(set(first.tolist())) == 4
    np.testing.assert_array_equal(run(np.tile(logit_row, (4, 1)), rows, k=0).token_ids, first)


def test_padding_rows_do_not_affect_live_rows():
    rows = [RowInfo(SP(temperature=1.0, top_k=10), seed=i, step=3) for i in range(3)]
    clean = logits_of(11)
    clean[3:] = 0.0
    dirty = clean.copy()
    dirty[3:] = np.nan
    dirty[4] = np.inf
    a, b = run(clean, rows), run(dirty, rows)
    np.testing.assert_array_equal(a.token_ids[:3], b.token_ids[:3])
    np.testing.assert_array_equal(a.logprobs[:3], b.logprobs[:3])
    batch = make_sampling_batch(rows, S, V)
    assert (batch.temperature[3:] == 0).all() and (batch.bias_ids[3:] == -1).all()


# ---- validation ---------------------------------------------------------------


def test_bias_overflow_and_bad_ids_raise():
    bias = tuple((i, 1.0) for i in range(300))
    make_sampling_batch([RowInfo(SP(logit_bias=bias), seed=0, banned_token_ids=tuple(range(20)))], 1, 1000)
    with pytest.raises(ValueError, match="max_bias_entries"):
        make_sampling_batch([RowInfo(SP(logit_bias=bias), seed=0, banned_token_ids=tuple(range(21)))], 1, 1000)
    with pytest.raises(ValueError, match="max_bias_entries"):
        make_sampling_batch([RowInfo(SP(logit_bias=((1, 1.0), (2, 1.0))), seed=0)], 1, V, max_bias_entries=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_sampling_batch([RowInfo(SP(logit_bias=((V, 1.0),)), seed=0)], 1, V)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_sampling_batch([RowInfo(SP(presence_penalty=1.0), seed=0, output_token_ids=[V])], 1, V)
    assert make_sampling_batch([], 2, V).bias_ids.shape == (2, MAX_BIAS_ENTRIES)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="num_rows"):
        make_sampling_batch([RowInfo(SP(), seed=0)] * 3, 2, V)
    with pytest.raises(ValueError, match="step"):
        RowInfo(SP(), seed=0, step=-1)
    with pytest.raises(TypeError, match="SamplingParams"):
        RowInfo({"temperature": 1.0}, seed=0)
    batch = make_sampling_batch([RowInfo(SP(), seed=0)], S, V)
    with pytest.raises(ValueError, match="rows"):
        sample(jnp.zeros((S + 1, V)), batch)
    with pytest.raises(ValueError, match="num_top_logprobs"):
        sample(jnp.zeros((S, V)), batch, num_top_logprobs=V + 1)


def _kept_constants(batch: InputBatch, rows) -> tuple[np.ndarray, np.ndarray]:
    """(scalars, key data) of rows given as (request id, params, seed), through the runner's persistent batch."""
    entries = [ScheduledRequest(rid, (0,), 0, (1,), True, params, 1, seed=seed) for rid, params, seed in rows]
    index = batch.apply(entries)
    return batch.scalars[index], batch.key_data[index]


def test_row_constants_are_the_params_scalars_and_the_seeds_key_data():
    batch = InputBatch(capacity=3, max_pages=1, vocab_size=V)
    greedy, hot = SP(temperature=0.0, top_k=5), SP(temperature=0.5, top_k=V + 5, top_p=0.25, min_p=0.125)
    scalars, keys = _kept_constants(batch, [("a", greedy, 1), ("b", hot, 2)])
    # (temperature, top_k, top_p, min_p, presence, frequency, repetition): greedy rows cut nothing, top_k >= V is off
    assert scalars.tolist() == [[0, 0, 1, 0, 0, 0, 1], [0.5, 0, 0.25, 0.125, 0, 0, 1]]
    assert keys.tolist() == [seed_key_data(1).tolist(), seed_key_data(2).tolist()] and len(batch) == 2
    with pytest.raises(ValueError, match="seed"):
        _kept_constants(batch, [("f", greedy, 1.5)])


def test_assembled_batch_checks_its_steps():
    scalars, keys = _kept_constants(InputBatch(2, 1, V), [("a", SP(), 0)])
    assert assemble_sampling_batch(scalars, keys, [2**32 - 1], {}, S, V).steps.tolist() == [2**32 - 1] + [0] * 7
    for steps in ([-1], [2**32], []):
        with pytest.raises(ValueError, match="key steps"):
            assemble_sampling_batch(scalars, keys, steps, {}, S, V)


# ---- random params -------------------------------------------------------------------


@st.composite
def random_row(draw):
    params = SP(
        temperature=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0, 2.5])),
        top_k=draw(st.sampled_from([-1, 0, 1, 5, V])), top_p=draw(st.sampled_from([1.0, 0.9, 0.3, 1e-3])),
        min_p=draw(st.sampled_from([0.0, 0.1, 1.0])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, -2.0, 2.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 1.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 0.5, 2.0])),
        logit_bias=tuple(draw(st.lists(st.tuples(st.integers(0, V - 1), st.floats(-100, 100)), max_size=4))))
    ids = st.lists(st.integers(0, V - 1), max_size=12)
    return RowInfo(params, seed=draw(st.integers(0, 2**63)), step=draw(st.integers(0, 10_000)),
                   prompt_token_ids=draw(ids), output_token_ids=draw(ids),
                   banned_token_ids=tuple(draw(st.lists(st.integers(0, V - 1), max_size=3))))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_params_outputs_are_sane(data):
    num_live = data.draw(st.integers(1, S))
    rows = [data.draw(random_row()) for _ in range(num_live)]
    logits = logits_of(data.draw(st.integers(0, 2**31)), scale=data.draw(st.sampled_from([0.01, 3.0, 30.0])))
    batch = make_sampling_batch(rows, S, V)
    out = jax.device_get(sample_jit(jnp.asarray(logits), batch))
    processed = np.asarray(process_logits(jnp.asarray(logits), batch))
    tokens = out.token_ids[:num_live]
    assert ((0 <= tokens) & (tokens < V)).all()
    assert np.isfinite(out.logprobs).all() and np.isfinite(out.top_logprobs).all()
    for i, row in enumerate(rows):
        assert tokens[i] not in row.banned_token_ids
        assert np.isfinite(processed[i, tokens[i]])
        if row.params.temperature == 0.0:
            assert tokens[i] == np.argmax(processed[i])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_kept_row_constants_give_the_batch_of_the_rows(data):
    """A batch from the constants the runner's persistent batch kept (made in an earlier step's order) and RowInfos
    only for the rows that need more (`needs_row_info`) is the batch of the rows themselves."""
    rows = [data.draw(random_row()) for _ in range(data.draw(st.integers(0, S)))]
    table = InputBatch(capacity=2 * S, max_pages=1, vocab_size=V)
    kept = [(f"r{i}", row.params, row.seed) for i, row in enumerate(rows)]
    _kept_constants(table, data.draw(st.permutations(kept)))  # an earlier step's order
    scalars, keys = _kept_constants(table, kept)
    special = {i: row for i, row in enumerate(rows) if needs_row_info(row.params, row.banned_token_ids)}
    batch = assemble_sampling_batch(scalars, keys, [row.step for row in rows], special, S, V)
    want = make_sampling_batch(rows, S, V)
    for field in dataclasses.fields(SamplingBatch):
        got, expected = getattr(batch, field.name), getattr(want, field.name)
        assert (got is None) == (expected is None), field.name
        if got is not None:
            assert got.dtype == expected.dtype and np.array_equal(got, expected), field.name
    # a fused step's batch (neutral_bias): no [S, B] bias arrays made unless a row has a bias or banned ids; the
    # device's neutral pair then stands in for them (`in_step.with_neutral_arrays`), the same values
    lean = assemble_sampling_batch(scalars, keys, [row.step for row in rows], special, S, V, neutral_bias=True)
    biased = any(row.banned_token_ids or row.params.logit_bias for row in rows)
    assert (lean.bias_ids is None) is (lean.bias_values is None) is (not biased)
    filled = in_step.with_neutral_arrays(lean, in_step.neutral_arrays(S, V))
    assert np.array_equal(filled.bias_ids, want.bias_ids) and np.array_equal(filled.bias_values, want.bias_values)


# ---- compiles ------------------------------------------------------------------


def traces_and_compiles(fn) -> list[str]:
    """The jaxpr traces and backend compiles (a jit cache miss, then its compile) while fn() runs."""
    events = []

    def listener(event, duration, **_):
        if event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return events


@pytest.mark.parametrize("vocab", [V, 1024])
def test_warmup_compiles_every_part_no_recompile_across_param_values(vocab):
    """After `warmup` (which compiles what `lower_parts` lowers, running nothing), no batch traces or compiles
    anything: greedy, random, penalties, logprobs on or off, and (vocab 1024 > the prefilter's 256) the
    bisection and full-vocabulary fallbacks."""
    logits = jnp.asarray(logits_of(12, vocab=vocab, scale=0.1))  # flat rows: the fallbacks run
    assert traces_and_compiles(lambda: warmup(S, vocab))  # it compiles (or loads) what the calls below run

    def call(rows, k):
        jax.block_until_ready(sample_jit(logits, make_sampling_batch(rows, S, vocab), num_top_logprobs=k))

    variants = [
        [RowInfo(SP(temperature=0.0), seed=0)],
        [RowInfo(SP(temperature=0.9, top_k=7, top_p=0.5, min_p=0.1, logit_bias=((3, 1.0),)), seed=5, step=9)],
        [RowInfo(SP(temperature=2.0), seed=2**40, banned_token_ids=(1, 2))] * S,
        [RowInfo(SP(temperature=1.0, top_k=500, top_p=0.99), seed=1)] * 3,
        [RowInfo(SP(temperature=0.0, top_p=0.2), seed=1)] * 3,
        [RowInfo(SP(repetition_penalty=1.2), seed=0, prompt_token_ids=[1])],
        [RowInfo(SP(presence_penalty=-1.0, temperature=0.0), seed=3, output_token_ids=[4])],
    ]
    for rows in variants:
        for k in (0, 20):
            assert traces_and_compiles(lambda: call(rows, k)) == [], (rows, k)
    before = compiled_variants()
    call([RowInfo(SP(temperature=0.0), seed=0)], 5)  # a new num_top_logprobs: the top log-probs' program only
    assert compiled_variants() == before + 1
    assert isinstance(make_sampling_batch([], S, V), SamplingBatch)


# ---- the sort-free filter draws what the sort did ------------------------------------


def tied_logits(seed: int, rows: int = S, vocab: int = V) -> np.ndarray:
    """Few distinct values (many exact ties), some rows all equal."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 3, (rows, vocab)).astype(np.float32) * rng.choice([0.5, 1.0, 4.0])
    x[rng.integers(0, rows)] = 1.0
    return x


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_same_tokens_as_the_sorting_sampler(data):
    """Same seeds, same settings, same logits: the sort-free sampler (prefilter candidates from 1 to
    V, so the candidate path, the full-row path and the bisection fallback all run) draws exactly the
    tokens of the previous full-sort implementation (tests/sampler_oracle.py), ties included."""
    from tests.sampler_oracle import oracle_token_ids_jit

    rows = [data.draw(random_row()) for _ in range(data.draw(st.integers(1, S)))]
    seed = data.draw(st.integers(0, 2**31))
    if data.draw(st.booleans()):
        logits = tied_logits(seed)
    else:
        logits = logits_of(seed, scale=data.draw(st.sampled_from([0.01, 3.0, 30.0])))
    batch = make_sampling_batch(rows, S, V)
    expected = np.asarray(oracle_token_ids_jit(jnp.asarray(logits), batch))
    for kp in (1, 8, V):
        got = jax.device_get(sample_jit(jnp.asarray(logits), batch, num_top_logprobs=0, prefilter_k=kp))
        np.testing.assert_array_equal(got.token_ids[:len(rows)], expected[:len(rows)], err_msg=f"kp={kp}")


@pytest.mark.parametrize("params", [SP(temperature=0.8, top_p=0.95), SP(temperature=1.0, top_k=40),
                                    SP(temperature=0.7, top_k=300, top_p=0.9, min_p=0.02),
                                    SP(temperature=1.3), SP(temperature=1.0, top_p=0.999)])
def test_same_tokens_as_the_sorting_sampler_large_vocabulary(params):
    """A 4096-token vocabulary at the default prefilter (256): the candidate path on peaked rows,
    the fallbacks on flat ones (top_k above the prefilter, mass spread past it), over many seeds."""
    from tests.sampler_oracle import oracle_token_ids_jit

    vocab, rows = 4096, 16
    logits = np.concatenate([logits_of(7, rows // 2, vocab, scale=4.0), logits_of(8, rows // 2, vocab, scale=0.3)])
    for seed in range(0, 96, rows):
        batch = make_sampling_batch([RowInfo(params, seed=seed + i, step=3 * i) for i in range(rows)], rows, vocab)
        expected = np.asarray(oracle_token_ids_jit(jnp.asarray(logits), batch))
        got = jax.device_get(sample_jit(jnp.asarray(logits), batch, num_top_logprobs=0))
        np.testing.assert_array_equal(got.token_ids, expected)


def test_threefry2x32_is_jax_primitive_bit_for_bit():
    """The sampler's written-out Threefry-2x32 equals JAX's primitive (the noise stream is unchanged)."""
    from jax.extend.random import threefry2x32_p

    from jaxpaged.sample.ops import threefry2x32

    rng = np.random.default_rng(7)
    keys = rng.integers(0, 2**32, size=(4, 2), dtype=np.uint64).astype(np.uint32)
    counters = rng.integers(0, 2**32, size=(2, 4, 1000), dtype=np.uint64).astype(np.uint32)
    counters[:, 0, :3] = [[0, 1, 0xFFFFFFFF], [0, 0, 0xFFFFFFFF]]  # the edges of the word
    k0, k1 = jnp.asarray(keys[:, :1]), jnp.asarray(keys[:, 1:])
    c0, c1 = jnp.asarray(counters[0]), jnp.asarray(counters[1])
    want = jax.jit(lambda *a: threefry2x32_p.bind(*a))(*jnp.broadcast_arrays(k0, k1, c0, c1))
    got = jax.jit(threefry2x32)(k0, k1, c0, c1)
    for w, g in zip(want, got):
        assert g.dtype == jnp.uint32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

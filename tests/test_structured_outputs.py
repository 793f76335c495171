"""Structured outputs: the constraint params, the llguidance manager (tiny byte tokenizer) and the
sampler's bitmask step (CPU). Engine and server paths: tests/test_engine.py, tests/server/."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.sampler import RowInfo, apply_token_bitmask, make_sampling_batch, sample_jit
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams
from jaxpaged.structured_outputs import (GrammarError, StructuredOutputManager, StructuredOutputsConfig,
                                         bitmask_width, unpack_bitmask)
from tests.conftest import tiny_tokenizer

V = 300  # the tiny tokenizer has 260 ids: the model's vocabulary may be larger (padded embedding)
EOS = 257


@pytest.fixture(scope="module")
def manager():
    m = StructuredOutputManager(tiny_tokenizer(), V, [EOS])
    yield m
    m.shutdown()


# ---- StructuredOutputsParams -----------------------------------------------------


def test_params_need_exactly_one_valid_constraint():
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    for kwargs, match in [({}, "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"),
                          (dict(json="{not json"), "not valid JSON"), (dict(json=[1]), "must be an object"),
                          (dict(choice=[]), "non-empty"), (dict(choice=["a", ""]), "non-empty"),
                          (dict(choice="ab"), "non-empty list"), (dict(regex="  "), "non-empty string")]:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    a = StructuredOutputsParams(json={"b": 1, "a": {"type": "string"}})
    assert a.key_text == StructuredOutputsParams(json={"a": {"type": "string"}, "b": 1}).key_text
    assert hash(a) == hash(StructuredOutputsParams(json={"a": {"type": "string"}, "b": 1}))


# ---- compiling ----------------------------------------------------------------------


@pytest.mark.parametrize("spec, match", [
    (StructuredOutputsParams(json={"type": "objectx"}), "Invalid type"),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 2}), "Unsatisfiable"),
    (StructuredOutputsParams(json={"properties": {"a": {"$ref": "#/$defs/gone"}}}), "does not exist"),
    (StructuredOutputsParams(regex="(unclosed"), "regex"),
    (StructuredOutputsParams(grammar="start: foo\nfoo: ("), "Expected token"),
    (StructuredOutputsParams(json={"type": "object", "description": "x" * 300_000}), "too large"),
])
def test_bad_constraints_fail_fast_with_the_reason(manager, spec, match):
    start = time.perf_counter()
    with pytest.raises(GrammarError, match=match):
        manager.compile_blocking(spec)
    assert time.perf_counter() - start < 1.0


def test_compile_is_cached_and_times_out(manager):
    spec = StructuredOutputsParams(regex=r"[a-z]{2,5}")
    assert manager.compile(spec) is manager.compile(StructuredOutputsParams(regex=r"[a-z]{2,5}"))
    slow = StructuredOutputsParams(json={"type": "object", "properties": {
        f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 7 + 40}}}"} for i in range(400)}})
    with pytest.raises(GrammarError, match="longer than"):
        manager.compile_blocking(slow, timeout=1e-4)
    with pytest.raises(ValueError, match="compile_timeout_s"):
        StructuredOutputsConfig(compile_timeout_s=0)


def test_matcher_masks_advances_and_terminates(manager):
    tok = tiny_tokenizer()
    matcher = manager.matcher(manager.compile_blocking(StructuredOutputsParams(choice=["yes", "no"])))
    bitmask = np.full((3, bitmask_width(V)), -1, np.int32)
    manager.fill_bitmask([(matcher, 1)], bitmask)
    allowed = unpack_bitmask(bitmask, V)
    assert allowed[0].all() and allowed[2].all()  # other rows untouched
    assert sorted(tok.decode([t]) for t in np.nonzero(allowed[1])[0]) == ["n", "y"]
    assert not allowed[1, 260:].any()  # ids past the tokenizer are never allowed
    for t in tok("ye", add_special_tokens=False)["input_ids"]:
        assert matcher.accept(t) and not matcher.is_terminated
    assert matcher.accept(tok("s", add_special_tokens=False)["input_ids"][0])
    assert matcher.is_terminated and matcher.error is None
    other = manager.matcher(manager.compile_blocking(StructuredOutputsParams(choice=["yes", "no"])))
    assert not other.accept(tok("x", add_special_tokens=False)["input_ids"][0]) and other.error


def test_json_matcher_allows_eos_only_when_complete(manager):
    tok = tiny_tokenizer()
    matcher = manager.matcher(manager.compile_blocking(StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})))
    for t in tok('{"a": 12', add_special_tokens=False)["input_ids"]:
        bitmask = np.full((1, bitmask_width(V)), -1, np.int32)
        manager.fill_bitmask([(matcher, 0)], bitmask)
        assert unpack_bitmask(bitmask, V)[0, t] and not unpack_bitmask(bitmask, V)[0, EOS]
        assert matcher.accept(t)
    assert matcher.accept(tok("}", add_special_tokens=False)["input_ids"][0])
    assert matcher.is_terminated


# ---- the sampler's bitmask step -------------------------------------------------------


S = 8


def _bitmask(allowed: np.ndarray) -> np.ndarray:
    """Pack bool[S, V] into llguidance's i32[S, W]."""
    S_, V_ = allowed.shape
    padded = np.zeros((S_, bitmask_width(V_) * 32), bool)
    padded[:, :V_] = allowed
    words = (padded.reshape(S_, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def test_apply_token_bitmask_matches_the_reference():
    rng = np.random.default_rng(0)
    allowed = rng.random((S, V)) < 0.3
    allowed[:, 299] = True  # the last partial word
    bitmask = _bitmask(allowed)
    assert (unpack_bitmask(bitmask, V) == allowed).all()
    logits = rng.standard_normal((S, V)).astype(np.float32)
    out = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(bitmask)))
    assert (out == np.where(allowed, logits, -np.inf)).all()


def test_sampler_only_picks_allowed_tokens_and_logprobs_follow_the_mask():
    rng = np.random.default_rng(1)
    logits = (3 * rng.standard_normal((S, V))).astype(np.float32)
    allowed = rng.random((S, V)) < 0.05
    allowed[:, 7] = True
    allowed[0] = True  # row 0 unconstrained
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.95, top_k=50),
              SamplingParams(temperature=1.0, repetition_penalty=1.2), SamplingParams(temperature=0.7)] * 2
    rows = [RowInfo(p, seed=i, output_token_ids=[3]) for i, p in enumerate(params)]
    for step in range(5):
        rows = [RowInfo(r.params, seed=r.seed, step=step, output_token_ids=[3]) for r in rows]
        batch = make_sampling_batch(rows, S, V, token_bitmask=_bitmask(allowed))
        out = jax.device_get(sample_jit(jnp.asarray(logits), batch, num_top_logprobs=5))
        for i in range(S):
            assert allowed[i, out.token_ids[i]], (i, step)
            top = out.top_token_ids[i][np.isfinite(out.top_logprobs[i])]
            assert allowed[i, top].all()
        assert out.token_ids[0] == np.argmax(logits[0])  # unconstrained greedy row unchanged
        masked = np.where(allowed[4], logits[4], -np.inf)
        assert out.token_ids[4] == np.argmax(masked)  # constrained greedy row: best allowed
        assert out.finite.all()  # the grammar's -inf is not a broken row


def test_bitmask_shape_is_checked_and_values_never_recompile():
    logits = jnp.asarray(np.zeros((S, V), np.float32))
    rows = [RowInfo(SamplingParams(temperature=0.8), seed=1)]
    with pytest.raises(ValueError, match="token_bitmask"):
        make_sampling_batch(rows, S, V, token_bitmask=np.zeros((S, 9), np.int32))
    with pytest.raises(ValueError, match="token_bitmask"):
        make_sampling_batch(rows, S, V, token_bitmask=np.zeros((S, 10), np.int64))
    full = np.full((S, bitmask_width(V)), -1, np.int32)
    jax.block_until_ready(sample_jit(logits, make_sampling_batch(rows, S, V, token_bitmask=full)))
    size = sample_jit._cache_size()
    for seed in range(3):
        bm = _bitmask(np.random.default_rng(seed).random((S, V)) < 0.5)
        jax.block_until_ready(sample_jit(logits, make_sampling_batch(rows, S, V, token_bitmask=bm)))
    assert sample_jit._cache_size() == size
    assert json.dumps(make_sampling_batch(rows, S, V).token_bitmask) == "null"

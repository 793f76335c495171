"""Structured outputs: the constraint params, the llguidance manager (tiny byte tokenizer) and the
sampler's bitmask step (CPU). Engine and server paths: tests/test_engine.py, tests/server/."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.sample.sampling_batch import RowInfo, make_sampling_batch
from jaxpaged.sample.ops import apply_token_bitmask
from jaxpaged.sample.sampler import compiled_variants, sample_jit
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams
from jaxpaged.sample.structured_outputs import (GrammarError, StructuredOutputManager, StructuredOutputsConfig,
                                         bitmask_width)
from tests.conftest import tiny_tokenizer

V = 300  # the tiny tokenizer has 260 ids: the model's vocabulary may be larger (padded embedding)
EOS = 257


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[S, V] from i32[S, W] (host reference of the sampler's device unpack)."""
    bits = (bitmask.astype(np.int64)[:, :, None] >> np.arange(32)) & 1  # [S, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


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
        manager.compile(spec).result()
    assert time.perf_counter() - start < 1.0


def test_compile_is_cached(manager):
    spec = StructuredOutputsParams(regex=r"[a-z]{2,5}")
    assert manager.compile(spec) is manager.compile(StructuredOutputsParams(regex=r"[a-z]{2,5}"))
    with pytest.raises(ValueError, match="compile_timeout_s"):
        StructuredOutputsConfig(compile_timeout_s=0)


def test_matcher_masks_advances_and_terminates(manager):
    tok = tiny_tokenizer()
    matcher = manager.matcher(manager.compile(StructuredOutputsParams(choice=["yes", "no"])).result())
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
    other = manager.matcher(manager.compile(StructuredOutputsParams(choice=["yes", "no"])).result())
    assert not other.accept(tok("x", add_special_tokens=False)["input_ids"][0]) and other.error


def test_tokenizer_larger_than_the_model_vocabulary():
    """Ids the tokenizer has beyond the embedding are cut from the sampler's bitmask."""
    small = StructuredOutputManager(tiny_tokenizer(), 200, [EOS])
    assert small.mask_width == bitmask_width(260) and small.sampler_width == bitmask_width(200)
    matcher = small.matcher(small.compile(StructuredOutputsParams(choice=["ok"])).result())
    bitmask = np.full((1, small.mask_width), -1, np.int32)
    small.fill_bitmask([(matcher, 0)], bitmask)
    allowed = unpack_bitmask(bitmask[:, :small.sampler_width], 200)[0]
    assert list(np.nonzero(allowed)[0]) == [ord("o")]
    small.shutdown()


def test_json_matcher_allows_eos_only_when_complete(manager):
    tok = tiny_tokenizer()
    matcher = manager.matcher(manager.compile(StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})).result())
    for t in tok('{"a": 12', add_special_tokens=False)["input_ids"]:
        bitmask = np.full((1, bitmask_width(V)), -1, np.int32)
        manager.fill_bitmask([(matcher, 0)], bitmask)
        assert unpack_bitmask(bitmask, V)[0, t] and not unpack_bitmask(bitmask, V)[0, EOS]
        assert matcher.accept(t)
    assert matcher.accept(tok("}", add_special_tokens=False)["input_ids"][0])
    assert matcher.is_terminated


def test_masks_with_drafts_are_those_after_each_draft(manager):
    """Speculative decoding: forced_tokens are what the grammar forces next; valid_prefix counts the leading
    drafts the grammar allows; the mask of each position a verification samples (after 0..d drafts) lands in
    its target row, equal to the mask the matcher gives after consuming those drafts one by one; the matcher
    does not move."""
    tok = tiny_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    compiled = manager.compile(StructuredOutputsParams(json=PERSON)).result()
    matcher, other = manager.matcher(compiled), manager.matcher(compiled)
    assert tok.decode(matcher.forced_tokens()) == '{"name": "'  # the schema's first key: forced
    for t in ids('{"name": "ab'):
        assert matcher.accept(t) and other.accept(t)
    assert matcher.forced_tokens() == []  # inside a string: nothing forced, and asking moved nothing
    drafts = ids('c", "age": 4')
    assert matcher.valid_prefix(drafts) == len(drafts) and matcher.valid_prefix([]) == 0
    assert matcher.valid_prefix(ids('c", "x')) == 5 and matcher.valid_prefix(ids('"}')) == 1
    bitmask = np.zeros((len(drafts) + 4, bitmask_width(V)), np.int32)
    targets = [5, 0, 7, 2, 8, 9, 10, 11, 12, 13, 14, 15, 3][:len(drafts) + 1]
    manager.fill_bitmask_with_drafts([(matcher, drafts, targets), (other, [], [1])], bitmask)
    got = unpack_bitmask(bitmask, V)
    for j, target in enumerate(targets):
        expected = np.full((1, bitmask_width(V)), 0, np.int32)
        manager.fill_bitmask([(other, 0)], expected)
        assert (got[target] == unpack_bitmask(expected, V)[0]).all(), j
        if j == 0:
            assert (got[1] == got[target]).all()  # the draftless row: its plain mask
        if j < len(drafts):
            assert other.accept(drafts[j])
    assert not got[4].any() and not got[6].any()  # rows not targeted: untouched
    assert matcher.accept(drafts[0])  # it had not moved: "c" could not follow the drafts' "4"
    with pytest.raises(ValueError, match="d \\+ 1 target rows"):
        manager.fill_bitmask_with_drafts([(other, drafts, [0])], bitmask)


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
    size = compiled_variants()
    for seed in range(3):
        bm = _bitmask(np.random.default_rng(seed).random((S, V)) < 0.5)
        jax.block_until_ready(sample_jit(logits, make_sampling_batch(rows, S, V, token_bitmask=bm)))
    assert compiled_variants() == size
    assert json.dumps(make_sampling_batch(rows, S, V).token_bitmask) == "null"


# ---- the engine (tiny random model, byte tokenizer: it tries everything the grammar allows) ----------------

import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402

import jsonschema  # noqa: E402

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.models.loader import load_model  # noqa: E402
from tests.test_engine import count_traces  # noqa: E402

ENGINE_ARGS = EngineArgs(model="unused", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
                         num_pages=200, compilation_cache_dir=None)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_engine(tiny_checkpoints):
    return LLMEngine(ENGINE_ARGS, loaded=load_model(str(tiny_checkpoints["gqa4"]), dtype="float32"))


def _run(engine: LLMEngine, params_list, prompt=(1, 2, 3, 4, 5)) -> dict:
    for i, params in enumerate(params_list):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(prompt) + [i]}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages
    return done


def _so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def test_engine_outputs_obey_their_constraint(tiny_engine):
    person = _so(json=PERSON)
    params = [SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=person),
              SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=100, logprobs=2, structured_outputs=person),
              SamplingParams(temperature=1.2, top_p=0.9, seed=2, max_tokens=40,
                             structured_outputs=_so(regex=r"[a-f]{3}-\d{2,4}")),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, repetition_penalty=1.3,
                             structured_outputs=_so(choice=["red", "green", "blue"])),
              SamplingParams(temperature=0.0, max_tokens=12)]  # unconstrained, in the same batch
    done = _run(tiny_engine, params)
    for out in done["r0"].outputs + done["r1"].outputs:
        jsonschema.validate(json.loads(out.text), PERSON)
        assert out.finish_reason == "stop"
    assert len({o.text for o in done["r1"].outputs}) > 1  # n samples differ
    for entry, token_id in zip(done["r1"].outputs[0].logprobs, done["r1"].outputs[0].token_ids):
        assert np.isfinite(entry[token_id].logprob)  # of the masked distribution: disallowed ids are -inf
        assert all(np.isfinite(e.logprob) or e.rank > 1 for e in entry.values())
    assert re.fullmatch(r"[a-f]{3}-\d{2,4}", done["r2"].outputs[0].text)
    assert done["r3"].outputs[0].text in ("red", "green", "blue")
    assert done["r4"].outputs[0].finish_reason == "length"


def test_engine_seeded_constrained_sample_reproduces_in_any_batch(tiny_engine):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=100, structured_outputs=_so(json=PERSON))
    alone = _run(tiny_engine, [params])["r0"].outputs[0]
    others = [SamplingParams(temperature=0.9, seed=s, max_tokens=20) for s in range(3)]
    mixed = _run(tiny_engine, others + [params])["r3"].outputs[0]
    # the same prompt (r3's differs by its last id): compare with a batch where it is r0's prompt
    again = _run(tiny_engine, [params] + others)["r0"].outputs[0]
    assert again.token_ids == alone.token_ids
    jsonschema.validate(json.loads(mixed.text), PERSON)


def test_grammar_completion_stops_even_with_ignore_eos(tiny_engine):
    """The matcher reports termination: without it, ignore_eos would run on (EOS only) to max_tokens."""
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True,
                            structured_outputs=_so(choice=["yes", "no"]))
    out = _run(tiny_engine, [params])["r0"].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) == len(out.text)  # byte tokens: nothing after the choice


def test_stop_strings_and_preemption_with_constraints(tiny_checkpoints):
    loaded = load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")
    engine = LLMEngine(dataclasses.replace(ENGINE_ARGS, num_pages=14), loaded=loaded)  # small pool: preemption
    regex = _so(regex=r"(ab|cd){20}")  # 40 tokens each: 6 pages a request, 13 in the pool
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=regex) for s in range(6)]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=60, stop=["cd"], structured_outputs=regex))
    done = _run(engine, params, prompt=list(range(20, 60)))
    assert engine.scheduler.num_preemptions > 0
    for i in range(6):
        assert re.fullmatch(r"(ab|cd){20}", done[f"r{i}"].outputs[0].text)
    stopped = done["r6"].outputs[0]
    assert stopped.finish_reason == "stop" and "cd" not in stopped.text and re.fullmatch(r"(ab)*", stopped.text)


def test_request_waits_for_its_grammar_without_blocking_others(tiny_engine, monkeypatch):
    pending: dict[str, concurrent.futures.Future] = {}
    real_compile = tiny_engine.structured_outputs.compile

    def held_compile(spec):  # a compile that finishes when the test says so
        pending[spec.kind] = concurrent.futures.Future()
        return pending[spec.kind]

    monkeypatch.setattr(tiny_engine.structured_outputs, "compile", held_compile)
    tiny_engine.add_request("slow", {"prompt_token_ids": [1, 2, 3]},
                            SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=_so(regex="[ab]{4}")))
    tiny_engine.add_request("bad", {"prompt_token_ids": [1, 2, 3]},
                            SamplingParams(max_tokens=5, structured_outputs=_so(choice=["x"])))
    tiny_engine.add_request("free", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0.0, max_tokens=4))
    seen = []
    for _ in range(6):
        seen += tiny_engine.step()
    assert [o.request_id for o in seen if o.finished] == ["free"]  # it ran; the other two waited
    assert tiny_engine.scheduler.get_request("slow") is None
    pending["choice"].set_exception(GrammarError("invalid choice constraint: test"))
    pending["regex"].set_result(real_compile(_so(regex="[ab]{4}")).result())
    done = {}
    while tiny_engine.has_unfinished_requests():
        done.update({o.request_id: o for o in tiny_engine.step() if o.finished})
    assert done["bad"].outputs[0].finish_reason == "error"
    assert re.fullmatch("[ab]{4}", done["slow"].outputs[0].text)
    with pytest.raises(GrammarError, match="Invalid type"):  # known bad at add time: nothing is queued
        monkeypatch.setattr(tiny_engine.structured_outputs, "compile", real_compile)
        real_compile(_so(json={"type": "nope"})).exception()
        tiny_engine.add_request("x", {"prompt_token_ids": [1]}, SamplingParams(
            structured_outputs=_so(json={"type": "nope"})))
    assert not tiny_engine.has_unfinished_requests()


def test_no_compilation_after_warmup_with_constrained_requests(tiny_engine):
    person = _so(json=PERSON)
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=person),
              SamplingParams(temperature=0.8, top_k=5, seed=1, logprobs=3, structured_outputs=_so(regex="[0-9]{5}")),
              SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, max_tokens=60, structured_outputs=person),
              SamplingParams(n=2, temperature=1.0, stop=["a"], max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=8, logit_bias={3: 5.0})] * 2
    with count_traces() as traces:
        done = _run(tiny_engine, params)
    assert traces == []
    jsonschema.validate(json.loads(done["r0"].outputs[0].text), PERSON)


def test_a_token_the_grammar_rejects_fails_only_its_request(manager):
    from jaxpaged.engine.output_processor import _Child
    from jaxpaged.core.request import Request, RequestStatus

    def child(rid: str) -> _Child:
        c = _Child(0, Request(rid, [1, 2]), None, None)
        c.matcher = manager.matcher(manager.compile(_so(choice=["yes", "no"])).result())
        return c

    bad, good = child("bad"), child("good")
    assert LLMEngine._grammar_verdict(bad, ord("x")) == (RequestStatus.FINISHED_ERROR, None)
    assert LLMEngine._grammar_verdict(good, ord("y")) is None
    assert LLMEngine._grammar_verdict(good, ord("e")) is None
    assert LLMEngine._grammar_verdict(good, ord("s")) == (RequestStatus.FINISHED_STOPPED, None)

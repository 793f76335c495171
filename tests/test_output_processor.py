"""The output processor's lean path: decided once per sample, and the same outputs as the full per-token path."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from jaxpaged.config import EngineArgs
from jaxpaged.core.request import Request
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.output_processor import FloatArray, _Child, might_stop, plan_child
from jaxpaged.models.loader import load_model
from jaxpaged.sampling_params import SamplingParams

BASE = EngineArgs(model="unused", max_model_len=40, max_num_seqs=8, max_num_batched_tokens=64, num_pages=200,
                  compilation_cache_dir=None)


def _child(prompt_len: int, eos: tuple[int, ...], max_model_len: int | None, **params) -> _Child:
    request = Request("r", list(range(1, prompt_len + 1)), SamplingParams(**params), eos_token_ids=eos,
                      max_model_len=max_model_len)
    child = _Child(0, request, None, None)
    plan_child(child)
    return child


@pytest.mark.parametrize("ignore_eos,min_tokens,max_tokens,max_model_len", list(itertools.product(
    (False, True), (0, 2), (None, 3, 7), (None, 9, 12))))
def test_the_screen_lets_through_every_token_check_stop_stops(ignore_eos, min_tokens, max_tokens, max_model_len):
    """might_stop only screens: a token Request.check_stop stops (EOS, a stop id, max_tokens, max_model_len, at any
    count and any place in a step) must never be screened out, or the lean path would run past a stop."""
    if max_tokens is None and max_model_len is None:
        max_tokens = 5
    child = _child(4, (9,), max_model_len, ignore_eos=ignore_eos, min_tokens=min_tokens, max_tokens=max_tokens,
                   stop_token_ids=[4, 7])
    request, stopped = child.request, 0
    for _ in range(12):
        for token, ahead in itertools.product(range(12), range(3)):
            if request.check_stop(token, ahead) is not None:
                stopped += 1
                assert might_stop(child, token, True, ahead), (token, ahead, request.num_output_tokens)
        request.output_token_ids.append(1)
    assert stopped  # the check above ran on stopping tokens
    assert might_stop(child, 1, False)  # a non-finite row always goes to the full verdict


def test_the_screen_passes_a_token_that_cannot_stop():
    child = _child(4, (9,), 40, max_tokens=10, stop_token_ids=[4])
    assert not might_stop(child, 5, True)
    assert might_stop(child, 9, True) and might_stop(child, 4, True)
    child.request.output_token_ids.extend([1] * 9)
    assert might_stop(child, 5, True)  # the 10th output ends it by length


def test_lean_is_decided_by_what_a_token_must_record():
    assert _child(3, (), 40).lean
    request = Request("r", [1, 2], SamplingParams(), max_model_len=40)
    for extra in (dict(logprobs=[]), dict(token_logprobs=FloatArray())):
        child = dataclasses.replace(_Child(0, request, None, None), **extra)
        plan_child(child)
        assert not child.lean
    child = _Child(0, request, object(), None)  # a detokenizer: text per token
    plan_child(child)
    assert not child.lean


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")


@pytest.mark.parametrize("async_scheduling", (True, False))
def test_lean_and_full_paths_give_the_same_outputs(tiny, async_scheduling):
    """Requests that take the lean path (no logprobs, no text) against their twins that record every token
    (logprobs=0, detokenized): the same tokens, finish records, cumulative log-probs and counts, stopping by stop
    id (after min_tokens), max_tokens and max_model_len."""
    engine = LLMEngine(dataclasses.replace(BASE, async_scheduling=async_scheduling), loaded=tiny)
    variants = [dict(max_tokens=12), dict(max_tokens=None), dict(max_tokens=20, stop_token_ids=list(range(0, 120))),
                dict(max_tokens=20, stop_token_ids=list(range(60, 140)), min_tokens=3), dict(max_tokens=6, n=2)]
    for i, variant in enumerate(variants):
        for form, extra in (("lean", dict(detokenize=False)), ("full", dict(logprobs=0))):
            params = SamplingParams(temperature=1.0, seed=i, ignore_eos=i % 2 == 0, **variant, **extra)
            engine.add_request(f"{form}-{i}", {"prompt_token_ids": list(range(5, 15 + i))}, params)
    assert all(c.lean == rid.startswith("lean") for rid, (_, c) in engine._child_to_parent.items())
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    reasons = set()
    for i in range(len(variants)):
        lean, full = final[f"lean-{i}"], final[f"full-{i}"]
        assert lean.metrics.num_generation_tokens == full.metrics.num_generation_tokens
        for a, b in zip(lean.outputs, full.outputs, strict=True):
            assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
            assert a.cumulative_logprob == b.cumulative_logprob
            reasons.add((a.finish_reason, a.stop_reason is not None))
    assert {("length", False), ("stop", True)} <= reasons  # both kinds of stop were met

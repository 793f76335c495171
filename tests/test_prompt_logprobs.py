"""Prompt log-probabilities (SamplingParams.prompt_logprobs): computed from the prefill step's own hidden
states, equal to a plain full forward's, with chunked prefill, prefix caching, preemption, DELTA and n > 1."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxpaged.worker import step_program
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.models import llama
from jaxpaged.models.loader import load_model
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

# 32 tokens a step: the 70-token prompt below is prefilled in three chunks
BASE = EngineArgs(model="unused", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, num_pages=200,
                  compilation_cache_dir=None)
PROMPT = np.random.default_rng(0).integers(3, 256, size=70).tolist()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")


@pytest.fixture(scope="module")
def engine(tiny):
    return LLMEngine(BASE, loaded=tiny)


@pytest.fixture(scope="module")
def reference(tiny):
    """log_softmax of a plain full-causal forward (f32): row q is the distribution of token q + 1."""
    logits = llama.forward(tiny.config, tiny.params, np.asarray([PROMPT], np.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def run(engine: LLMEngine, params: SamplingParams, prompt=PROMPT, rid="r") -> list:
    engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages
    return outputs


def check_against_reference(prompt_logprobs, reference, k: int) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for j in range(1, len(PROMPT)):
        entry, want = prompt_logprobs[j], reference[j - 1]
        token = PROMPT[j]
        assert entry[token].logprob == pytest.approx(want[token], abs=1e-4), j
        assert entry[token].rank == int(np.sum(want > want[token])) + 1
        top = np.argsort(-want)[:k]
        ranked = {t: e for t, e in entry.items() if e.rank is not None and e.rank <= k}
        assert sorted(ranked) == sorted(int(t) for t in top), j
        for t in top:
            assert entry[int(t)].logprob == pytest.approx(want[t], abs=1e-4)


def test_prompt_logprobs_equal_a_full_forward_over_chunked_prefill(engine, reference):
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    (out,) = run(engine, params)
    check_against_reference(out.prompt_logprobs, reference, 3)


def test_a_cached_prefix_still_gets_its_prompt_logprobs(engine, reference):
    """The prompt's pages are cached by a first request; one asking for prompt logprobs skips the cache."""
    plain = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
    run(engine, plain, rid="warm")
    (again,) = run(engine, plain, rid="hit")
    assert again.num_cached_tokens > 0  # the prefix is cached
    (out,) = run(engine, dataclasses.replace(plain, prompt_logprobs=0), rid="asks")
    assert out.num_cached_tokens == 0
    check_against_reference(out.prompt_logprobs, reference, 0)


def test_without_prefix_caching(tiny, reference):
    engine = LLMEngine(dataclasses.replace(BASE, enable_prefix_caching=False), loaded=tiny)
    (out,) = run(engine, SamplingParams(max_tokens=1, prompt_logprobs=2, output_kind=RequestOutputKind.FINAL_ONLY))
    check_against_reference(out.prompt_logprobs, reference, 2)


def test_delta_sends_them_once_and_n_children_share_them(engine, reference):
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1, prompt_logprobs=1,
                            output_kind=RequestOutputKind.DELTA)
    outputs = run(engine, params)
    assert len(outputs) >= 2
    check_against_reference(outputs[0].prompt_logprobs, reference, 1)
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    (final,) = run(engine, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY), rid="f")
    check_against_reference(final.prompt_logprobs, reference, 1)


def test_not_asked_none_and_one_token_prompt(engine):
    (out,) = run(engine, SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY))
    assert out.prompt_logprobs is None
    (out,) = run(engine, SamplingParams(max_tokens=1, prompt_logprobs=2, output_kind=RequestOutputKind.FINAL_ONLY),
                 prompt=[5])
    assert out.prompt_logprobs == [None]


def test_batched_with_others_and_no_compile_after_warmup(engine, reference):
    """Requests that ask share a step with ones that don't; every shape was compiled at warm-up."""
    size = step_program.prompt_logprobs_step._cache_size()
    engine.add_request("other", {"prompt_token_ids": PROMPT[:40][::-1]}, SamplingParams(max_tokens=5))
    engine.add_request("short", {"prompt_token_ids": PROMPT[:9]},
                       SamplingParams(max_tokens=4, prompt_logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY))
    (out,) = run(engine, SamplingParams(max_tokens=4, prompt_logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY))
    check_against_reference(out.prompt_logprobs, reference, 1)
    assert step_program.prompt_logprobs_step._cache_size() == size


def test_prompt_logprobs_on_a_mesh_are_a_clear_error(engine, monkeypatch):
    """The runner computes them on one device; a tensor-parallel engine refuses them, queueing nothing."""
    monkeypatch.setattr(engine, "mesh", "a tensor-parallel mesh")
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with tensor parallelism"):
        engine.add_request("tp", {"prompt_token_ids": PROMPT}, SamplingParams(prompt_logprobs=1))
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished_requests()
    engine.add_request("tp", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1))  # others still go
    engine.abort_request("tp")

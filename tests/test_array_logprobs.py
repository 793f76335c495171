"""SamplingParams(array_logprobs=True): the sampled and prompt tokens' log-probs as float32 arrays on the outputs
(a trainer's rollouts), equal to the per-token entries of the ordinary mode."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.output_processor import FloatArray
from jaxpaged.errors import InvalidRequestError
from jaxpaged.sampling_params import RequestOutputKind

ARGS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_pages=100)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(model=str(tiny_checkpoints["gqa4"]), seed=0, **ARGS)


def test_arrays_equal_the_entries(llm):
    prompt = "a prompt of some length"
    common = dict(n=2, temperature=1.0, seed=5, max_tokens=9, ignore_eos=True)
    entries = llm.generate(prompt, SamplingParams(**common, logprobs=0, prompt_logprobs=0), use_tqdm=False)[0]
    arrays = llm.generate(prompt, SamplingParams(**common, prompt_logprobs=0, array_logprobs=True),
                          use_tqdm=False)[0]
    assert arrays.prompt_logprobs is None
    want_prompt = [next(iter(e.values())).logprob if len(e) == 1 else e[t].logprob
                   for t, e in zip(entries.prompt_token_ids[1:], entries.prompt_logprobs[1:])]
    got_prompt = arrays.prompt_token_logprobs
    assert got_prompt.dtype == np.float32 and got_prompt.shape == (len(arrays.prompt_token_ids),)
    assert np.isnan(got_prompt[0])
    np.testing.assert_array_equal(got_prompt[1:], np.float32(want_prompt))
    for a, e in zip(arrays.outputs, entries.outputs):
        assert a.token_ids == e.token_ids and a.logprobs is None
        assert a.token_logprobs.dtype == np.float32 and a.token_logprobs.shape == (9,)
        np.testing.assert_array_equal(a.token_logprobs,
                                      np.float32([entry[t].logprob for t, entry in zip(e.token_ids, e.logprobs)]))
        assert a.cumulative_logprob == pytest.approx(float(a.token_logprobs.sum()), abs=1e-4)


def test_delta_outputs_carry_their_new_part(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, array_logprobs=True, prompt_logprobs=0,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta", [5, 6, 7, 8], params)
    parts, prompts, done = [], [], False
    while not done:
        for out in engine.step():
            parts.append(out.outputs[0].token_logprobs if out.outputs else np.zeros(0, np.float32))
            prompts.append(out.prompt_token_logprobs)
            done = out.finished
    assert sum(p is not None for p in prompts) == 1 and prompts[0].shape == (4,)  # with the first output only
    whole = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True,
                                                        array_logprobs=True), use_tqdm=False)[0]
    np.testing.assert_array_equal(np.concatenate(parts), whole.outputs[0].token_logprobs)


@pytest.mark.parametrize("bad", [dict(array_logprobs=True, logprobs=3), dict(array_logprobs=True, prompt_logprobs=2),
                                 dict(array_logprobs="yes")])
def test_bad_settings_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_float_array_grows():
    values = FloatArray(2)
    for i in range(37):
        values.append(i / 4)
    np.testing.assert_array_equal(values.copy(), np.arange(37, dtype=np.float32) / 4)
    np.testing.assert_array_equal(values.copy(30), np.arange(30, 37, dtype=np.float32) / 4)

"""What LLMEngine hands back per step: RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), the cost of a
streamed output, and the one finish record (stop strings held back, then released or matched)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxpaged.engine import detokenizer
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.models.loader import load_model
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

BASE = EngineArgs(model="unused", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, num_pages=200,
                  compilation_cache_dir=None)
A = 97  # the tiny tokenizer's ids 0..255 are bytes: 97 is "a"
ONLY_A = {A: 100.0}  # logits are O(1): +100 makes "a" the pick of every sampler


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")


@pytest.fixture(scope="module")
def engine(tiny):
    return LLMEngine(BASE, loaded=tiny)


def run(engine: LLMEngine, params: SamplingParams, prompt=(1, 2, 3, 4, 5)) -> list:
    engine.add_request("r", {"prompt_token_ids": list(prompt)}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages
    return outputs


def concatenated(deltas, n: int) -> list[dict]:
    """Per choice index: the DELTA outputs joined back up."""
    joined = [dict(text="", token_ids=[], logprobs=[], finish=[]) for _ in range(n)]
    for out in deltas:
        for comp in out.outputs:
            j = joined[comp.index]
            j["text"] += comp.text
            j["token_ids"] += comp.token_ids
            j["logprobs"] += comp.logprobs or []
            j["finish"].append(comp.finish_reason)
    return joined


def test_delta_final_only_and_cumulative_agree_for_n_samples_with_logprobs(engine):
    params = SamplingParams(n=3, temperature=1.5, seed=11, max_tokens=9, logprobs=2, ignore_eos=True)
    cumulative = run(engine, params)
    delta = run(engine, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
    final_only = run(engine, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY))

    (final,) = final_only  # one output, at the end, with everything
    last = cumulative[-1]
    assert final.finished and last.finished and len(cumulative) == 9
    assert [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason) for c in final.outputs] == \
        [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason) for c in last.outputs]
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3  # the samples differ
    for before, after in zip(cumulative, cumulative[1:]):  # cumulative: every output holds all so far
        for b, a in zip(before.outputs, after.outputs):
            assert a.token_ids[:len(b.token_ids)] == b.token_ids and a.text.startswith(b.text)

    assert len(delta) == 9 and delta[-1].finished and not any(o.finished for o in delta[:-1])
    for out in delta:  # a delta holds this step's token of each child, no more
        assert all(len(c.token_ids) == 1 and len(c.logprobs) == 1 for c in out.outputs)
    assert delta[-1].metrics.num_generation_tokens == 27
    for comp, joined in zip(last.outputs, concatenated(delta, 3)):
        assert (joined["text"], joined["token_ids"], joined["logprobs"]) == \
            (comp.text, comp.token_ids, comp.logprobs)
        assert joined["finish"] == [None] * 8 + ["length"]


def test_a_cumulative_output_keeps_its_tokens_when_read_after_later_steps(engine):
    """A CUMULATIVE output's token ids are copied when first read (CompletionOutput's span): read only after its
    request finished and another ran, each output holds its own step's tokens, and a read gives the caller a list
    it owns (its changes stay in that output and nowhere else)."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = run(engine, params)
    run(engine, params, prompt=(7, 8, 9))
    replaced = dataclasses.replace(outputs[2].outputs[0], finish_reason="error")  # (AsyncLLM's failed step)
    final = list(outputs[-1].outputs[0].token_ids)
    assert replaced.token_ids == final[:3] and replaced.finish_reason == "error"
    assert [o.outputs[0].token_ids for o in outputs] == [final[:k] for k in range(1, 7)]
    first = outputs[0].outputs[0]
    first.token_ids.append(-1)
    assert first.token_ids == [final[0], -1] and outputs[1].outputs[0].token_ids == final[:2]
    assert outputs[-1].outputs[0].token_ids == final


def test_delta_holds_only_the_children_with_new_tokens(engine):
    params = SamplingParams(n=4, temperature=1.5, seed=21, max_tokens=8, ignore_eos=True)
    samples = [c.token_ids for c in run(engine, params)[-1].outputs]
    # a stop token id that ends the children at different steps (seeded rows don't depend on it)
    first_at = lambda ids, t: ids.index(t) if t in ids else len(ids) - 1  # noqa: E731
    stop_id = next(t for t in samples[0][1:] if len({first_at(ids, t) for ids in samples}) > 1)
    params = dataclasses.replace(params, stop_token_ids=(stop_id,))
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, params)
    engine.abort_request("r")  # aborted: nothing left behind, nothing emitted
    last = run(engine, params)[-1]
    delta = run(engine, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
    for comp, joined in zip(last.outputs, concatenated(delta, 4)):
        assert joined["token_ids"] == comp.token_ids and joined["text"] == comp.text
        # a child appears in one output per token, its finish in the last of them, then no more
        assert joined["finish"] == [None] * (len(comp.token_ids) - 1) + [comp.finish_reason]
    assert len({len(c.token_ids) for c in last.outputs}) > 1
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_stop_string_prefix_is_held_back_then_released(engine, kind):
    # "aab" never completes, but the text always ends with its prefix "aa": held back until the end
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=ONLY_A, stop=("aab",),
                            output_kind=kind)
    outputs = run(engine, params)
    texts = [o.outputs[0].text for o in outputs]
    if kind is RequestOutputKind.FINAL_ONLY:
        assert texts == ["aaaaaa"]
    elif kind is RequestOutputKind.CUMULATIVE:
        assert texts == ["", "", "a", "aa", "aaa", "aaaaaa"]
    else:
        assert texts == ["", "", "a", "a", "a", "aaa"]
        assert [o.outputs[0].token_ids for o in outputs] == [[A]] * 6  # ids are not held back
    assert outputs[-1].outputs[0].finish_reason == "length" and outputs[-1].outputs[0].stop_reason is None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_stop_string_match_and_include_stop_str_in_output(engine, kind, include):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias=ONLY_A, stop=("aaa",),
                            include_stop_str_in_output=include, output_kind=kind)
    outputs = run(engine, params)
    text = "".join(o.outputs[0].text for o in outputs) if kind is RequestOutputKind.DELTA else \
        outputs[-1].outputs[0].text
    final = outputs[-1].outputs[0]
    assert text == ("aaa" if include else "")
    assert (final.finish_reason, final.stop_reason) == ("stop", "aaa")
    assert outputs[-1].metrics.num_generation_tokens == 3


def test_stop_string_wins_over_length_on_the_same_token(engine):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias=ONLY_A, stop=("aaa",))
    final = run(engine, params)[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason, final.text, len(final.token_ids)) == ("stop", "aaa", "", 3)


def test_long_delta_stream_costs_each_step_only_its_delta(tiny, monkeypatch):
    """A 2,000-token stream: every token id, logprob and character is handed out (and read from the
    text buffer) once; a cumulative output re-copies them all each step (O(n^2) over the stream)."""
    num_tokens = 2000
    config = dataclasses.replace(tiny.config, max_position_embeddings=num_tokens + 64)
    engine = LLMEngine(dataclasses.replace(BASE, max_model_len=num_tokens + 64, max_num_seqs=4,
                                           max_num_batched_tokens=16), loaded=dataclasses.replace(tiny, config=config))
    chars_read = []
    read = detokenizer._TextBuffer.read

    def counting_read(self, start, end=None):
        text = read(self, start, end)
        chars_read.append(len(text))
        return text

    def no_whole_text(self):
        raise AssertionError("the whole text was read")

    monkeypatch.setattr(detokenizer._TextBuffer, "read", counting_read)
    monkeypatch.setattr(detokenizer._TextBuffer, "getvalue", no_whole_text)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=num_tokens, ignore_eos=True, logprobs=1,
                            output_kind=RequestOutputKind.DELTA)
    outputs = run(engine, params)
    comps = [o.outputs[0] for o in outputs]
    assert len(outputs) == num_tokens and outputs[-1].finished
    assert sum(len(c.token_ids) for c in comps) == num_tokens  # every id handed out exactly once
    assert sum(len(c.logprobs) for c in comps) == num_tokens
    assert max(len(c.token_ids) for c in comps) == 1
    token_ids = [t for c in comps for t in c.token_ids]
    text = "".join(c.text for c in comps)
    assert text == engine.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert len(text) > num_tokens // 2
    assert sum(chars_read) <= len(text)  # each character read from the text buffer once

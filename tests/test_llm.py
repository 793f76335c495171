"""The offline LLM API (vLLM's names): prompts as text or token ids, chat, ordering, metrics."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.errors import InvalidRequestError
from tests.greedy_oracle import greedy_generate

ARGS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_pages=100)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(model=str(tiny_checkpoints["gqa4"]), dtype="float32", seed=0, **ARGS)


def test_generate_text_and_token_prompts_in_order(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["hello there", {"prompt_token_ids": [5, 6, 7]}, "a much longer prompt " * 3]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello there", None, "a much longer prompt " * 3]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert outs[0].prompt_token_ids == tok("hello there")["input_ids"]
    engine = llm.llm_engine
    for out in outs:
        expected = greedy_generate(engine.model.config, engine.model.params, out.prompt_token_ids, 6)
        completion = out.outputs[0]
        assert completion.token_ids == expected
        assert completion.text == tok.decode(expected, skip_special_tokens=True)
        assert completion.finish_reason == "length"
        assert out.finished and out.metrics.time_to_first_token is not None
        assert 0 <= out.metrics.time_to_first_token <= out.metrics.e2e_latency
        assert out.metrics.num_generation_tokens == 6


def test_one_params_per_prompt(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 3, 5)]
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3, 5]
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], params, use_tqdm=False)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == "<|user|>hi<|eos|><|assistant|>"
    assert out.prompt_token_ids == llm.get_tokenizer()(out.prompt, add_special_tokens=False)["input_ids"]
    assert len(out.outputs[0].token_ids) == 4


def test_logprobs_and_n(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, logprobs=4, ignore_eos=True)
    out = llm.generate("xyz", params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert len(completion.logprobs) == 5
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            assert token_id in entry and len(entry) in (4, 5)
            ranked = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank and lp.rank <= 4)
            assert [r for r, _ in ranked] == [1, 2, 3, 4]
            assert all(a >= b for (_, a), (_, b) in zip(ranked, ranked[1:]))
        total = sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_bad_prompt_leaves_engine_clean(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ok", "x" * 200], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    pool = llm.llm_engine.scheduler.pool
    assert pool.num_free_pages == pool.num_usable_pages


@pytest.mark.parametrize("bad, param", [(dict(logit_bias={260: 3.0}), "logit_bias"),
                                        (dict(stop_token_ids=[10**6]), "stop_token_ids")])
def test_bad_token_id_raises_before_any_step(llm, monkeypatch, bad, param):
    """An offline user's out-of-range id is a clear error at generate, before any step runs; the other
    prompts of the call are withdrawn and the next call runs as usual."""
    engine = llm.llm_engine
    steps = []
    monkeypatch.setattr(engine.runner, "execute_model", lambda out, *rest: steps.append(out))
    good = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as err:
        llm.generate(["first", "second", "third"], [good, SamplingParams(max_tokens=3, **bad), good],
                     use_tqdm=False)
    assert err.value.param == param and isinstance(err.value, ValueError)
    assert not steps and not engine.has_unfinished_requests()
    monkeypatch.undo()
    outs = llm.generate(["first", "third"], good, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


def test_unknown_engine_argument_is_rejected(tiny_checkpoints):
    with pytest.raises(TypeError, match="unknown engine arguments \\['max_num_seq'\\]"):
        LLM(model=str(tiny_checkpoints["gqa4"]), max_num_seq=4)


def test_start_up_progress_shows_without_logging_configured(tiny_checkpoints):
    """A script that configured no logging still sees LLM(...)'s start-up: each step shape as it is compiled
    (or loaded from the cache), then the ready line naming the model; nothing of it once LLM(...) returns."""
    import subprocess
    import sys

    script = ("import sys; from jaxpaged import LLM; "
              f"llm = LLM(model=sys.argv[1], dtype='float32', **{ARGS!r}); "
              "import logging; logging.getLogger('jaxpaged.engine').info('after LLM(...) returned')")
    done = subprocess.run([sys.executable, "-c", script, str(tiny_checkpoints["gqa4"])], capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    shapes = [line for line in lines if "INFO jaxpaged.worker.compilation: step shape " in line]
    assert shapes and shapes[0].split("step shape ")[1].startswith("1/"), done.stderr[-3000:]
    ready = [line for line in lines if "INFO jaxpaged.engine.llm_engine: jaxpaged ready in " in line]
    assert len(ready) == 1 and f": {tiny_checkpoints['gqa4']} (float32" in ready[0], ready
    assert "after LLM(...) returned" not in done.stderr

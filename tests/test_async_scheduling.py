"""Async scheduling (EngineArgs.async_scheduling): the overlapped loop equals the synchronous one, token for token.

The synchronous loop is the reference. Both engines run the same mixed workload (greedy, seeded top-p/top-k,
penalties, logprobs, prompt logprobs, n > 1, min_tokens, stop strings, stop ids, max_tokens) with the same
aborts (after a request has delivered k tokens), and must deliver the same outputs; pages are all free after.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxpaged.config import CPU_ASYNC_MAX_TOKENS, EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.models.loader import load_model
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from tests.test_engine import count_traces, mixed_prompts

OVERLAP_ALL = 1 << 20  # async_scheduling_max_tokens above any step: every step stays in flight
BASE = EngineArgs(model="unused", max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, num_pages=200,
                  compilation_cache_dir=None, warmup=False, async_scheduling_max_tokens=OVERLAP_ALL)
CONFIGS = {
    "cache": {},
    "nocache": dict(enable_prefix_caching=False),
    "preempt": dict(num_pages=24),  # small KV pool: preemption by recompute
    "chunked": dict(max_num_batched_tokens=16, max_num_seqs=8),
}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")


def make_engine(loaded, async_scheduling: bool, **overrides) -> LLMEngine:
    engine = LLMEngine(dataclasses.replace(BASE, async_scheduling=async_scheduling, **overrides), loaded=loaded)
    assert engine.async_scheduling is async_scheduling
    return engine


def mix(i: int) -> SamplingParams:
    """Request i's params: every feature whose host state could lag behind the overlapped loop."""
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=10),
        SamplingParams(temperature=1.0, top_k=5, logprobs=3, seed=i, max_tokens=9),
        SamplingParams(temperature=1.0, seed=i, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.2, max_tokens=14),
        SamplingParams(n=2, temperature=1.0, top_p=0.999, seed=i, max_tokens=8),  # past the 256 candidates
        SamplingParams(temperature=0.0, min_tokens=4, max_tokens=6, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2),
    ][i % 8]


def run(engine: LLMEngine, requests: dict, abort_after: dict[str, int] | None = None, log: dict | None = None):
    """Run requests {id: (prompt ids, params)} to the end; abort request r once it has delivered
    abort_after[r] tokens. Returns each request's last output. `log` counts each child's sampling entries."""
    abort_after = abort_after or {}
    if log is not None:
        schedule = engine.scheduler.schedule

        def logged():
            out = schedule()
            for e in out.scheduled_requests:
                log[e.request_id] = log.get(e.request_id, 0) + e.samples
            return out
        engine.scheduler.schedule = logged
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    last = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            last[out.request_id] = out
            if not out.finished and max(len(o.token_ids) for o in out.outputs) >= abort_after.get(out.request_id, 1e9):
                engine.abort_request(out.request_id)
        engine.scheduler.check_invariants()
    else:
        pytest.fail("the workload did not finish")
    pool = engine.scheduler.pool
    assert pool.num_free_pages == pool.num_usable_pages
    assert all(pool.ref_count(p) == 0 for p in range(1, pool.num_pages))
    return last


def summary(out) -> list:
    """What must match between the loops: per sample, tokens, text, finish and logprobs."""
    rows = []
    for o in out.outputs:
        logprobs = None if o.logprobs is None else [{t: round(lp.logprob, 4) for t, lp in d.items()}
                                                    for d in o.logprobs]
        rows.append((o.index, tuple(o.token_ids), o.text, o.finish_reason, o.stop_reason,
                     round(o.cumulative_logprob, 3), logprobs))
    prompt = None if out.prompt_logprobs is None else [
        None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()} for d in out.prompt_logprobs]
    return [rows, prompt]


def workload(tiny) -> dict:
    """The mix over 24 prompts, plus stop strings and stop ids cut from greedy outputs (so they do stop)."""
    prompts = mixed_prompts(24, seed=11)
    requests = {str(i): (p, mix(i)) for i, p in enumerate(prompts)}
    reference = run(make_engine(tiny, False), {str(i): requests[str(i)] for i in (0, 8, 16)})
    for j, rid in enumerate(("0", "8", "16")):
        ids, text = reference[rid].outputs[0].token_ids, reference[rid].outputs[0].text
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        if len(text) > 6:
            requests[f"stop-str-{j}"] = (prompts[int(rid)], dataclasses.replace(greedy, stop=[text[4:6]]))
        requests[f"stop-id-{j}"] = (prompts[int(rid)], dataclasses.replace(greedy, stop_token_ids=[ids[3]]))
    return requests


ABORTS = {"1": 3, "3": 2, "4": 1, "9": 4, "12": 1}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_overlapped_equals_synchronous(tiny, config):
    requests = workload(tiny)
    results, logs = {}, {}
    for mode in (False, True):
        engine = make_engine(tiny, mode, **CONFIGS[config])
        logs[mode] = {}
        results[mode] = run(engine, requests, ABORTS, logs[mode])
        if config == "preempt":
            assert engine.scheduler.num_preemptions > 0
    assert results[True].keys() == results[False].keys() == requests.keys()
    for rid in requests:
        if rid in ABORTS and requests[rid][1].n > 1:  # aborted once either sample has k tokens: when the
            for a, b in zip(results[True][rid].outputs, results[False][rid].outputs):  # other one gets its
                n = min(len(a.token_ids), len(b.token_ids))  # tokens depends on the chunking: prefixes
                assert a.token_ids[:n] == b.token_ids[:n], rid
            continue
        assert summary(results[True][rid]) == summary(results[False][rid]), rid
    finishes = {o.finish_reason for out in results[True].values() for o in out.outputs}
    assert {"length", "stop"} <= finishes
    assert any(out.outputs[0].stop_reason is not None for out in results[True].values())
    # Wasted slots: the synchronous loop samples each token once; the overlapped one at most once more
    # per request (a stop it learns a step late), never for a length stop.
    for mode, log in logs.items():
        for rid, out in results[mode].items():
            for o in out.outputs:
                child = rid if len(out.outputs) == 1 else f"{rid}#{o.index}"
                extra = log[child] - len(o.token_ids)
                if not mode or o.finish_reason == "length":
                    assert extra == 0, (mode, child, o.finish_reason)
                else:
                    assert 0 <= extra <= 1, (child, o.finish_reason)


@pytest.mark.parametrize("config", ["cache", "preempt"])
def test_only_small_steps_stay_in_flight(tiny, config):
    """async_scheduling_max_tokens: a step feeding more tokens is handled before the next is scheduled (which
    then feeds no placeholder), a smaller one stays in flight; the outputs are still the synchronous loop's."""
    requests = workload(tiny)
    reference = run(make_engine(tiny, False, **CONFIGS[config]), requests, ABORTS)
    engine = make_engine(tiny, True, async_scheduling_max_tokens=4, **CONFIGS[config])
    kept, handled, scheduled = [], [], []
    step, schedule = engine.step, engine.scheduler.schedule

    def logged_schedule():
        out = schedule()
        if not (kept and kept[-1] is scheduled[-1]):  # the step before was handled (or there was none)
            assert not any(e.placeholder for e in out.scheduled_requests)
        scheduled.append(out)
        return out

    def logged_step():
        before = len(scheduled)
        outputs = step()
        if len(scheduled) > before and not scheduled[-1].is_empty:
            (kept if engine._in_flight is not None else handled).append(scheduled[-1])
        return outputs
    engine.step, engine.scheduler.schedule = logged_step, logged_schedule
    results = run(engine, requests, ABORTS)
    assert kept and handled
    assert max(o.num_scheduled_tokens for o in kept) <= 4 < min(o.num_scheduled_tokens for o in handled)
    for rid in requests:
        if rid in ABORTS and requests[rid][1].n > 1:  # see test_overlapped_equals_synchronous
            continue
        assert summary(results[rid]) == summary(reference[rid]), rid


def constrained_params() -> list[SamplingParams]:
    """Four constrained requests (JSON greedy, JSON sampled n=2 with logprobs, regex top_p, choice with a
    repetition penalty): the structured-output mix of the overlapped and fused-step tests."""
    from jaxpaged.sampling_params import StructuredOutputsParams as SO
    from tests.test_structured_outputs import PERSON
    return [SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=SO(json=PERSON)),
            SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=100, logprobs=2,
                           structured_outputs=SO(json=PERSON)),
            SamplingParams(temperature=1.2, top_p=0.9, seed=2, max_tokens=40,
                           structured_outputs=SO(regex=r"[a-f]{3}-\d{2,4}")),
            SamplingParams(temperature=0.8, seed=3, max_tokens=40, repetition_penalty=1.3,
                           structured_outputs=SO(choice=["red", "green", "blue"]))]


def test_structured_outputs_and_penalties_need_no_fallback(tiny):
    """The overlapped loop dispatches a step's sampler after the previous step's tokens reached the host, so
    grammar masks (the matcher advanced by them) and penalties (their counts) are those of the synchronous loop."""
    pytest.importorskip("llguidance")
    params = constrained_params() + [SamplingParams(temperature=0.0, max_tokens=12)]
    requests = {f"r{i}": ([1, 2, 3, 4, 5, i], p) for i, p in enumerate(params)}
    results = [run(make_engine(tiny, mode, max_num_seqs=8, max_num_batched_tokens=32), requests)
               for mode in (False, True)]
    for rid in requests:
        assert summary(results[1][rid]) == summary(results[0][rid]), rid
    assert results[1]["r0"].outputs[0].finish_reason == "stop"


def test_aborted_id_reused_while_its_step_is_in_flight(tiny):
    """The step in flight holds the aborted request; a new request with its id must not get its token."""
    prompts = mixed_prompts(2, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = run(make_engine(tiny, False), {"x": (prompts[1], greedy)})["x"]
    engine = make_engine(tiny, True)
    engine.add_request("x", {"prompt_token_ids": prompts[0]}, dataclasses.replace(greedy, max_tokens=20))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None and "x" in [e.request_id for e in engine._in_flight.entries]
    engine.abort_request("x")
    got = run(engine, {"x": (prompts[1], greedy)})["x"]
    assert summary(got) == summary(expected)


def fail_results_when(engine: LLMEngine, picked) -> None:
    """Make the tokens of the steps `picked(scheduler_output, previous)` selects fail to come to the host: asked
    when the engine reads a step's tokens back (so it sees the engine as it is then), where the error is raised."""
    dispatch = engine.runner.dispatch

    def failing_dispatch(scheduler_output, previous):
        pending = dispatch(scheduler_output, previous)
        result = pending.result

        def result_or_failure():
            if picked(scheduler_output, previous):
                raise RuntimeError("injected")
            return result()
        pending.result = result_or_failure
        return pending
    engine.runner.dispatch = failing_dispatch


def run_through_failures(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict, list]:
    """Add `requests` {id: (prompt ids, DELTA params)} and step to the end; after each injected failure abort the
    running requests (as AsyncLLM does). Checks that every token the engine appended was delivered and that the
    pages all came back. Returns each request's delivered tokens and, per failure, the ids that were running."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    scheduled = {rid: engine.scheduler.get_request(rid) for rid in requests}
    delivered, failures = {rid: [] for rid in requests}, []
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except RuntimeError as err:
            assert str(err) == "injected"
            failures.append([rid for rid in requests if engine.is_request_running(rid)])
            engine.abort_request(failures[-1])
            continue
        for out in outputs:
            delivered[out.request_id] += out.outputs[0].token_ids
    for rid, request in scheduled.items():
        assert delivered[rid] == request.output_token_ids, rid
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages
    engine.scheduler.check_invariants()
    return delivered, failures


@pytest.mark.parametrize("async_scheduling,max_tokens,site", [(False, None, "sampler"), (True, OVERLAP_ALL, "sampler"),
                                                             (True, 1, "sampler"), (True, 1, "result")])
def test_failed_step_loses_no_delivered_token(tiny, async_scheduling, max_tokens, site):
    """A step that fails in the sampler (or, handled at once under async_scheduling_max_tokens, when its tokens
    come to the host): every token the engine appended was delivered first (the overlapped loop returns the
    previous step's outputs and raises on the next call); the caller aborts the running requests (as AsyncLLM
    does) and the waiting one then runs as if nothing happened."""
    prompts = mixed_prompts(3, seed=9)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    cumulative = dataclasses.replace(greedy, output_kind=RequestOutputKind.CUMULATIVE)
    expected = run(make_engine(tiny, False), {"2": (prompts[2], cumulative)})["2"]

    def failing(entries) -> bool:
        return any(e.request_id == "1" and e.samples and e.num_output_tokens == 3 for e in entries)

    def fault(entries, logits):
        if site == "sampler" and failing(entries):
            raise RuntimeError("injected")
        return logits

    engine = LLMEngine(dataclasses.replace(BASE, async_scheduling=async_scheduling, max_num_seqs=2,
                                           async_scheduling_max_tokens=max_tokens), loaded=tiny, fault_injector=fault)
    if site == "result":
        fail_results_when(engine, lambda out, _: failing(out.scheduled_requests))
    delivered, failures = run_through_failures(engine, {str(i): (p, greedy) for i, p in enumerate(prompts)})
    assert failures == [["0", "1"]]
    assert delivered["2"] == list(expected.outputs[0].token_ids)


def test_failure_of_a_step_handled_at_once_keeps_the_step_before(tiny):
    """A small step in flight, then a large one (a prefill joins) handled at once whose tokens fail to come to
    the host: step() still returns the small step's outputs (their tokens were appended) and raises on the
    next call; nothing appended is lost, and the pages all come back."""
    prompts = mixed_prompts(3, seed=9)
    engine = make_engine(tiny, True, max_num_seqs=2, async_scheduling_max_tokens=2)
    picked = []

    def first_with_request_2(scheduler_output, previous) -> bool:
        if picked or not any(e.request_id == "2" for e in scheduler_output.scheduled_requests):
            return False
        assert previous is not None and scheduler_output.num_scheduled_tokens > 2
        picked.append(scheduler_output)
        return True
    fail_results_when(engine, first_with_request_2)
    requests = {rid: (prompts[int(rid)], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                        output_kind=RequestOutputKind.DELTA))
                for rid, max_tokens in {"0": 3, "1": 10, "2": 10}.items()}
    delivered, failures = run_through_failures(engine, requests)
    assert len(failures) == 1 and picked
    assert len(delivered["1"]) >= 3  # its tokens up to the failure, the one from the step before included


def compiles_while(fn) -> tuple[list, list]:
    """(jaxpr traces, backend compiles) while fn() runs."""
    compiles = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with count_traces() as traces:
            fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return traces, compiles


def test_no_compilation_after_warmup(tiny):
    engine = make_engine(tiny, True, num_pages=40, warmup=True)  # small pool: preemption too
    prompts = mixed_prompts(20, seed=4)
    requests = {str(i): (p, mix(i)) for i, p in enumerate(prompts)}
    traces, compiles = compiles_while(lambda: run(engine, requests, {"1": 2, "4": 1}))
    assert traces == [] and compiles == []
    assert engine.scheduler.num_preemptions > 0


def test_smollm2_overlapped_equals_synchronous(smollm2):
    prompts = [list(smollm2.tokenizer(text)["input_ids"]) for text in
               ("The capital of France is", "def fibonacci(n):", "Once upon a time, there was a", "1, 2, 3,")]
    params = [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=0.7, top_p=0.9, seed=5,
              max_tokens=16), SamplingParams(temperature=0.0, max_tokens=16, stop=[","]),
              SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=12)]
    requests = {str(i): (p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}
    overrides = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_pages=64)
    results = [run(make_engine(smollm2, mode, **overrides), requests, {"1": 5}) for mode in (False, True)]
    for rid in requests:
        assert summary(results[1][rid]) == summary(results[0][rid]), rid


def test_async_scheduling_must_be_a_bool_or_auto(tiny):
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model="unused", async_scheduling="yes")
    assert EngineArgs(model="unused", async_scheduling=True,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="async_scheduling_max_tokens"):
        EngineArgs(model="unused", async_scheduling_max_tokens=0)
    auto = LLMEngine(dataclasses.replace(BASE, async_scheduling=None, async_scheduling_max_tokens=None), loaded=tiny)
    assert auto.async_scheduling is True
    assert auto.async_max_tokens == (None if jax.default_backend() == "gpu" else CPU_ASYNC_MAX_TOKENS)
    for requested, expected in ((None, True), (False, False)):  # speculation: steps verifying drafts synchronous
        spec = LLMEngine(dataclasses.replace(BASE, async_scheduling=requested, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3}), loaded=tiny)
        assert spec.async_scheduling is expected


def test_cli_flag_reaches_the_engine_args():
    from server.__main__ import build_parser, engine_args
    parser = build_parser()
    assert engine_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert engine_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert engine_args(parser.parse_args([])).async_scheduling is EngineArgs.async_scheduling is None
    assert engine_args(parser.parse_args([])).async_scheduling_max_tokens is None
    assert engine_args(parser.parse_args(["--async-scheduling-max-tokens", "16"])).async_scheduling_max_tokens == 16


def test_placeholder_step_needs_dispatch(tiny):
    """execute_model (the synchronous call) cannot fill placeholder tokens: a clear error, not garbage."""
    engine = make_engine(tiny, True)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))
    engine.scheduler.schedule()
    out = engine.scheduler.schedule()
    assert out.scheduled_requests[0].placeholder
    with pytest.raises(ValueError, match="placeholder"):
        engine.runner.execute_model(out)
    assert np.asarray(out.scheduled_requests[0].token_ids).tolist() == [-1]

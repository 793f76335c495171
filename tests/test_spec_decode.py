"""N-gram speculative decoding: the config, the proposer, and the engine with speculation on, which must emit
token for token what it emits without (greedy, seeded, penalties, logprobs, stops), sample from the model's
distribution, keep its pages exact and compile nothing after warm-up."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from jaxpaged.sample import in_step
from jaxpaged.engine.drafting import RESERVE_AFTER_ACCEPT
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.worker.runner_config import RunnerConfig
from jaxpaged.worker.dispatch_count import count_dispatches
from jaxpaged.models.llama import forward
from jaxpaged.models.loader import load_model
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxpaged.core.request import Request
from jaxpaged.spec_decode import verify
from jaxpaged.spec_decode.ngram import (DraftLengthPolicy, NgramProposer, SpecDecodingStats, SpeculativeConfig,
                                  max_drafts_for, ngram_drafts)
from tests.greedy_oracle import greedy_generate
from tests.test_async_scheduling import fail_results_when, run_through_failures
from tests.test_engine import count_traces, mixed_prompts
from tests.test_structured_outputs import PERSON

# Every proposed draft verified, so a test decides where verification accepts and rejects; the adaptive draft
# length (the default, whose cuts follow this machine's step times) has its own tests (ADAPTIVE).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "adaptive_draft_length": False}
ADAPTIVE = {**SPEC, "adaptive_draft_length": True}
BASE = EngineArgs(model="unused", max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, num_pages=200,
                  compilation_cache_dir=None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
OVERLAP = dict(async_scheduling_max_tokens=1024)  # every step stays in flight (CPU default: steps of <= 8 tokens)


# ---- config -------------------------------------------------------------------------------


def test_config_defaults_and_conversion():
    c = SpeculativeConfig.from_dict(SPEC)
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 3, 1)
    assert SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min == 5  # vLLM's defaults: 5 and 5
    only_max = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.from_dict('{"num_speculative_tokens": 3, "prompt_lookup_min": 2}').prompt_lookup_max == 2
    assert c.disable_by_batch_size is None  # vLLM's default: always draft
    assert SpeculativeConfig(num_speculative_tokens=2).adaptive_draft_length and not c.adaptive_draft_length
    assert SpeculativeConfig.from_dict({**SPEC, "disable_by_batch_size": 2}).disable_by_batch_size == 2
    args = dataclasses.replace(BASE, speculative_config=SPEC)
    assert args.speculative_config == c and dataclasses.replace(args).speculative_config == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_speculative_tokens = 3


@pytest.mark.parametrize("config, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4"),
    ({"num_speculative_tokens": 2, "model": "x"}, "unknown keys"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size=1"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 4.0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "adaptive_draft_length": 1}, "adaptive_draft_length=1: must be true or false"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
])
def test_bad_configs_are_clear_errors(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(BASE, speculative_config=config)


def test_speculation_is_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="tensor parallelism"):
        dataclasses.replace(BASE, speculative_config=SPEC, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config must be"):
        dataclasses.replace(BASE, speculative_config=4)


# ---- proposer -----------------------------------------------------------------------------


def propose(tokens, k=3, lo=2, hi=3, max_drafts=None, skip=0):
    config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
    return NgramProposer(config).propose(tokens, max_drafts, skip=skip)


def reference_propose(tokens, k, lo, hi, max_drafts=None):
    """The definition: n from hi down to lo, the earliest occurrence of the last n tokens before them."""
    k = k if max_drafts is None else min(k, max_drafts)
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k] if k > 0 else []
    return []


def test_proposer_examples():
    assert propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    assert propose([0, 1, 2, 7, 3, 1, 2, 8, 0, 1, 2]) == [7, 3, 1]  # the 3-gram beats a later 2-gram
    assert propose([1, 2, 5, 1, 2, 6, 1, 2]) == [5, 1, 2]  # earliest of equal matches (vLLM's choice)
    assert propose([1, 2, 3, 4, 5]) == []  # nothing repeats
    assert propose([1, 2, 3, 1], lo=2) == []  # a 1-gram is below prompt_lookup_min
    assert propose([1, 2, 3, 1], lo=1) == [2, 3, 1]
    assert propose([1, 2, 3, 4, 1, 2], max_drafts=1) == [3] and propose([1, 2, 3, 4, 1, 2], max_drafts=0) == []
    assert propose([7, 7, 7, 7], k=5, lo=1, hi=3) == [7]  # drafts run to the end of what is known
    assert propose([7], lo=1) == [] and propose([], lo=1) == []
    # skip: the drafts after the match's next token (async scheduling's guess past the token in flight)
    assert propose([1, 2, 3, 4, 1, 2], skip=1) == [4, 1, 2] and propose([1, 2, 3, 4, 1, 2], skip=3) == [2]
    assert propose([1, 2, 3, 1, 2], skip=1) == [1, 2] and propose([1, 2, 1, 2], skip=2) == []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(1, 5), lo=st.integers(1, 4),
       extra=st.integers(0, 3), max_drafts=st.none() | st.integers(0, 6))
def test_proposer_matches_its_definition(tokens, k, lo, extra, max_drafts):
    assert propose(tokens, k, lo, lo + extra, max_drafts) == reference_propose(tokens, k, lo, lo + extra, max_drafts)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=4), k=st.integers(1, 5),
       lo=st.integers(1, 4), extra=st.integers(0, 3))
def test_device_lookup_matches_the_proposer(rows, k, lo, extra):
    """`ngram_drafts` (the lookup on the device, one sequence a row, garbage past each row's length) proposes
    what NgramProposer.continuation does, -1 past what it found."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo,
                               prompt_lookup_max=lo + extra)
    tokens = np.full((4, 48), 2, np.int32)  # past each sequence: tokens a match could (wrongly) read
    for m, row in enumerate(rows):
        tokens[m, :len(row)] = row
    lengths = np.array([len(row) for row in rows] + [1] * (4 - len(rows)), np.int32)
    got = ngram_drafts(jnp.asarray(tokens), jnp.asarray(lengths), k, lo, lo + extra).tolist()[:len(rows)]
    expect = [NgramProposer(config).continuation(row, k) for row in rows]
    assert got == [e + [-1] * (k - len(e)) for e in expect]


def test_max_drafts_bounds_and_stats():
    assert max_drafts_for(num_tokens=10, num_output_tokens=2, max_tokens=5, max_model_len=100) == 2
    assert max_drafts_for(num_tokens=97, num_output_tokens=2, max_tokens=None, max_model_len=100) == 2
    assert max_drafts_for(num_tokens=99, num_output_tokens=2, max_tokens=None, max_model_len=100) == 0
    s = SpecDecodingStats(3)
    s.observe(3, 2)
    s.observe(2, 0)
    assert s.as_stats() == {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 5,
                            "spec_decode_num_accepted_tokens": 2,
                            "spec_decode_num_accepted_tokens_per_pos": (1, 1, 0)}


# ---- the adaptive draft length ------------------------------------------------------------


def policy_with(step_ms: dict[int, float], k: int = 7) -> DraftLengthPolicy:
    policy = DraftLengthPolicy(k)
    for rows, ms in step_ms.items():
        policy.observe_step(rows, 1.0)  # the first step of a size is not timed
        for _ in range(DraftLengthPolicy.MIN_SAMPLES):
            policy.observe_step(rows, ms / 1e3)
    return policy


def geometric(alpha: float, count: int) -> np.ndarray:
    return alpha ** np.arange(1, count + 1)  # each draft accepted with probability alpha given the ones before


def test_plan_keeps_the_drafts_that_pay_for_their_rows():
    flat = policy_with({1: 10.0, 8: 10.5})  # rows nearly free (weights' read bound): every draft pays
    assert flat.plan(1, [geometric(0.8, 7)]) == [7] and flat.plan(1, [geometric(0.3, 3)]) == [3]
    # 6 of 7 drafts would be 0.3% faster (the 7th adds 0.5^7 = 0.008 tokens): within MARGIN, all stay
    assert flat.plan(1, [geometric(0.5, 7)]) == [7]
    assert flat.plan(1, [geometric(0.02, 7)]) == [1]  # 1.02 / 10.07 ms beats 1.0204 / 10.5 ms by 4%
    costly = policy_with({1: 10.0, 2: 11.0, 4: 13.0, 8: 20.0})  # rows cost arithmetic (int8 on a CPU)
    # alpha 0.3: 1 draft gives 1.3 / 11 ms, 2 give 1.39 / 12 ms, none 1 / 10 ms
    assert costly.plan(1, [geometric(0.3, 7)]) == [1]
    assert costly.plan(1, [geometric(0.7, 7)]) == [3]  # 2.533 / 13 ms beats 2.773 / 14.75 ms, 3.192 / 20 ms
    assert costly.plan(1, [geometric(0.95, 7)]) == [7]
    assert costly.plan(1, [geometric(0.9, 7)]) == [7]  # 6: 5.217 / 18.25 ms, only 0.4% > 5.695 / 20 ms
    assert costly.plan(1, [geometric(0.9, 2)]) == [2]  # the proposer found 2
    assert costly.plan(1, [geometric(0.05, 7)]) == [0]  # 1.05 / 11 ms < 1 / 10 ms
    # two decodes: the likelier request's drafts first, the other's none (base 2 rows; 6 rows 12 ms, 7: 14)
    two = policy_with({2: 10.0, 4: 10.5, 6: 12.0, 10: 20.0})
    assert two.plan(2, [geometric(0.9, 4), geometric(0.2, 4)]) == [4, 0]
    assert two.plan(2, [geometric(0.2, 4), geometric(0.9, 4)]) == [0, 4]
    assert DraftLengthPolicy(7).plan(1, [geometric(0.1, 5), np.zeros(2)]) == [5, 2]  # nothing measured: all
    assert costly.plan(3, []) == []
    once = policy_with({1: 10.0})  # a size larger than any timed costs what the largest did: it gets tried
    assert once.plan(1, [geometric(0.2, 7)]) == [7]
    # a decode without drafts shares the step: drafts may add at most SLOWDOWN (5%) to it, however well they pay
    assert two.plan(2, [geometric(0.9, 4)]) == [4] and two.plan(2, [geometric(0.9, 4)], without_drafts=1) == [2]
    synchronous = policy_with({2: 10.0, 3: 16.0, 6: 17.0})  # async scheduling: a verification step costs the host
    assert synchronous.plan(2, [geometric(0.9, 4)]) == [4]  # 5.1 tokens / 17 ms beat 2 / 10 ms
    assert synchronous.plan(2, [geometric(0.9, 4)], without_drafts=1) == [0]  # the other request's step: 1.6x


def test_step_times_are_medians_and_never_fall_with_rows():
    policy = DraftLengthPolicy(7)
    policy.observe_step(4, 5.0)  # the first 4-row step (it may have compiled): not timed
    assert policy.step_seconds() == {} and policy.plan(4, [geometric(0.01, 3)]) == [3]
    for seconds in (0.010, 0.011, 2.0, 0.012):  # one pause among them
        policy.observe_step(4, seconds)
    assert policy.step_seconds() == {4: pytest.approx(0.0115)}
    for _ in range(10):  # only the last STEP_SAMPLES count
        policy.observe_step(4, 0.02)
    assert policy.step_seconds() == {4: 0.02}
    # 5 rows timed 3 times at 8 ms, 4 rows 4 times (median 10): pooled, weighted 4 : 3; 6 rows above stays
    policy = policy_with({1: 6.0, 4: 10.0, 5: 8.0, 6: 12.0})
    policy.observe_step(4, 0.012)
    rows, seconds = policy.step_cost()
    assert rows == [1, 4, 5, 6] and 1e3 * seconds == pytest.approx([6.0, 64 / 7, 64 / 7, 12.0])
    # so a noisy cheap 5 does not make the plan stop at 5 drafts when 8 rows cost about the same
    noisy = policy_with({1: 21.1, 2: 23.2, 3: 23.2, 4: 25.7, 5: 23.0, 6: 23.3, 7: 23.7, 8: 24.1})
    assert noisy.plan(1, [np.array([0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1])]) == [7]
    # a pause in one of a size's first samples: a mean, it would cut the drafts beside a decode without any, and
    # being cut, the size would never be timed again; under MIN_SAMPLES it is not timed yet, so it is tried
    paused = policy_with({3: 30.0})
    for seconds in (1.0, 0.030, 0.045):
        paused.observe_step(7, seconds)
    assert 7 not in paused.step_seconds() and paused.plan(3, [geometric(0.9, 4)], without_drafts=2) == [4]
    paused.observe_step(7, 0.030)
    assert paused.step_seconds()[7] == 0.030 and paused.plan(3, [geometric(0.9, 4)], without_drafts=2) == [4]


def test_acceptance_follows_recent_verifications_and_the_engines_rates_by_position():
    policy = DraftLengthPolicy(4)
    request = Request("r", [1, 2, 3])
    assert policy.first_draft_rate(request) == 0.5 and policy.position_rates().tolist() == [0.5] * 4
    policy.observe_verification(request, 4, 4)
    assert (request.spec_first_accepted, request.spec_first_rejected) == (1, 0)
    # c_1 = (1 + 1) / (1 + 2); each next: (1 + 2 c_before) / (1 + 2)
    assert policy.position_rates() == pytest.approx([2 / 3, 7 / 9, 23 / 27, 73 / 81])
    assert policy.first_draft_rate(request) == pytest.approx((1 + 2 / 3) / 2)
    policy.observe_verification(request, 3, 1)  # position 1 accepted, 2 rejected, 3 not verified
    d = DraftLengthPolicy.POSITION_DECAY
    assert policy.verified.tolist() == pytest.approx([d + 1, d + 1, d, d])
    assert policy.accepted.tolist() == pytest.approx([d + 1, d, d, d])
    assert (request.spec_first_accepted, request.spec_first_rejected) == (pytest.approx(1.7), 0)
    c1 = (d + 2) / (d + 3)
    c2 = (d + 2 * c1) / (d + 3)
    c3 = (d + 2 * c2) / (d + 2)
    assert policy.position_rates() == pytest.approx([c1, c2, c3, (d + 2 * c3) / (d + 2)])
    policy.observe_verification(request, 2, 0)
    assert (request.spec_first_accepted, request.spec_first_rejected) == (pytest.approx(1.19), 1)
    p = (1.19 + policy.position_rates()[0]) / 3.19
    assert policy.first_draft_rate(request) == pytest.approx(p)
    assert policy.gains(request, 3) == pytest.approx(p * np.cumprod([1, *policy.position_rates()[1:3]]))
    never = DraftLengthPolicy(3)  # positions never verified take the rate of the one before
    for _ in range(50):
        never.observe_verification(Request("x", [1]), 1, 1)
    assert never.position_rates()[0] > 0.95 and never.position_rates()[2] == pytest.approx(never.position_rates()[0])


def test_trim_cuts_drafts_and_a_request_that_verifies_none_forgets_a_little():
    policy = policy_with({1: 10.0, 2: 11.0, 4: 13.0, 8: 20.0}, k=3)
    for _ in range(20):  # the engine's drafts so far: all accepted (c_2, c_3 ~ 0.95)
        policy.observe_verification(Request("old", [1]), 3, 3)
    sure, unsure, idle = Request("a", [1]), Request("b", [1]), Request("c", [1])
    sure.spec_first_accepted, unsure.spec_first_rejected = 30.0, 30.0
    sure.spec_token_ids, unsure.spec_token_ids = [5, 6, 7], [8, 9]
    policy.trim([sure, unsure])  # 2 decodes: 2 rows 11 ms, 5 rows 14.75 ms (interpolated)
    assert (sure.spec_token_ids, unsure.spec_token_ids) == ([5, 6, 7], [])
    assert unsure.spec_first_rejected == pytest.approx(21.0) and sure.spec_first_accepted == 30
    policy.trim([sure, idle])  # a decode without drafts beside: no draft costs the step <= 5% more here
    assert (sure.spec_token_ids, idle.spec_token_ids) == ([], [])



def test_draft_slots_weigh_as_any_drafts():
    """Async scheduling: a request in flight's draft slots (their content the device's) weigh as drafts the host
    proposed. The engine's first drafts are accepted, its second ones rarely (c_2 ~ 0.09): a sure request keeps
    its first draft, its drafts known or slots."""
    policy = policy_with({1: 10.0, 2: 11.0, 4: 13.0, 8: 20.0}, k=3)
    for _ in range(20):
        policy.observe_verification(Request("old", [1]), 3, 1)
    request = Request("a", [1])
    request.spec_first_accepted, request.spec_token_ids = 30.0, [5, 6, 7]
    policy.trim([request])
    assert request.spec_token_ids == [5]
    request.spec_token_ids = [0, 0, 0]
    policy.trim([request])
    assert request.spec_token_ids == [0]


def test_drafts_a_grammar_forces_are_kept_and_teach_nothing():
    """A constrained request's leading drafts that its grammar forces: never trimmed (a token a row, counted in
    the plan's rows), and its verifications count only the drafts after them, once those were all accepted."""
    policy = policy_with({1: 10.0, 2: 11.0, 4: 13.0, 8: 20.0}, k=6)
    request = Request("j", [1])
    request.spec_first_rejected = 30.0  # its n-gram drafts: never accepted so far
    request.spec_token_ids, request.spec_num_forced = [5, 6, 7, 8, 9], 3
    policy.trim([request])
    assert request.spec_token_ids == [5, 6, 7]  # the forced 3 stay, the 2 guesses after them go
    only_forced = Request("f", [1])
    only_forced.spec_token_ids, only_forced.spec_num_forced = [5, 6], 2
    policy.trim([only_forced])
    assert only_forced.spec_token_ids == [5, 6]
    # 3 forced, 5 drafts: 4 accepted = the forced 3 and the first guess -> a verification of 2, 1 accepted
    fresh = policy_with({1: 10.0}, k=6)
    fresh.observe_verification(request, 5, 4, num_forced=3)
    assert fresh.verified.tolist() == [1, 1, 0, 0, 0, 0] and fresh.accepted.tolist() == [1, 0, 0, 0, 0, 0]
    before = (fresh.verified.copy(), request.spec_first_accepted, request.spec_first_rejected)
    fresh.observe_verification(request, 5, 2, num_forced=3)  # a forced draft rejected: the guesses unverified
    fresh.observe_verification(request, 3, 3, num_forced=3)  # only forced drafts: nothing to learn
    assert (fresh.verified.tolist(), request.spec_first_accepted, request.spec_first_rejected) == \
        (before[0].tolist(), *before[1:])


# ---- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa4"]), dtype="float32")


@pytest.fixture(scope="module")
def plain(tiny):
    return LLMEngine(BASE, loaded=tiny)


@pytest.fixture(scope="module")
def spec(tiny):
    return make_engine(tiny)


def make_engine(loaded, **overrides) -> LLMEngine:
    """A speculating engine; greedy verification steps overlapped as on a GPU (CPU's default: synchronous)."""
    overrides = {"speculative_config": SPEC, "overlap_verification": True, **overrides}
    return LLMEngine(dataclasses.replace(BASE, **overrides), loaded=loaded)


def scheduled_requests(flight) -> dict:
    """The step in flight's entries' Requests as scheduled, by request id."""
    out = flight.scheduler_output
    return {entry.request_id: request for entry, request in zip(out.scheduled_requests, out.requests)}


def run_all(engine: LLMEngine, prompts, params=GREEDY, check=True) -> dict[str, object]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            engine.scheduler.check_invariants()
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages
    return done


def repetitive_prompts(count, seed=0):
    """Prompts a model may copy from: a random phrase repeated, with random tails."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        phrase = rng.integers(0, 256, size=rng.integers(3, 12)).tolist()
        prompts.append(rng.integers(0, 256, size=rng.integers(0, 5)).tolist() + phrase * int(rng.integers(2, 5)))
    return prompts


def tokens(done):
    return {rid: [list(o.token_ids) for o in out.outputs] for rid, out in done.items()}


def accepted(engine) -> tuple[int, int]:
    s = engine.stats()
    return s["spec_decode_num_accepted_tokens"], s["spec_decode_num_draft_tokens"]


class OracleProposer:
    """Proposes what a run without speculation emitted next (so drafts are accepted), optionally wrong from
    the `wrong_at`-th draft on: a test's control over where verification accepts and rejects."""

    def __init__(self, prompts, outputs, k=4, wrong_at=None):
        self.runs = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
        self.k, self.wrong_at = k, wrong_at

    def continuation(self, token_ids):
        token_ids = list(token_ids)
        for prompt, output in self.runs:
            done = token_ids[len(prompt):]
            if token_ids[:len(prompt)] == prompt and output[:len(done)] == done:
                return output[len(done):]
        return []

    def propose(self, token_ids, max_drafts=None, skip=0):
        return self._wrong(self.continuation(token_ids)[skip:skip + min(self.k, max_drafts)])

    def _wrong(self, drafts):
        if self.wrong_at is not None and len(drafts) > self.wrong_at:
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 256
        return drafts


def device_oracle(prompts, outputs, wrong_at=None):
    """`ngram_drafts`' stand-in for the device's drafts of rows in flight (same signature): OracleProposer's
    drafts, computed on the device. A row whose first lengths[m] tokens are a prompt and the start of its run's
    output gets the next k tokens of that output (the `wrong_at`-th one wrong), -1 past its end; other rows -1."""
    runs = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    width = max(map(len, runs))
    table = np.full((len(runs), width), -1, np.int32)  # i32[P, W]: each run's prompt and output, -1 past its end
    for i, run in enumerate(runs):
        table[i, :len(run)] = run
    starts = np.array([len(p) for p in prompts], np.int32)  # i32[P]

    def drafts(tokens, lengths, k, lookup_min, lookup_max):
        M, H = tokens.shape
        W = max(width, H)
        seq = jnp.pad(tokens, ((0, 0), (0, W - H)))  # i32[M, W]
        runs_ = jnp.pad(jnp.asarray(table), ((0, 0), (0, W - width)), constant_values=-1)  # i32[P, W]
        inside = jnp.arange(W)[None] < lengths[:, None]  # bool[M, W]
        same = (runs_[None] == seq[:, None]) | ~inside[:, None]  # bool[M, P, W]
        match = jnp.all(same, axis=-1) & (lengths[:, None] >= jnp.asarray(starts)[None])  # bool[M, P]
        at = lengths[:, None] + jnp.arange(k)[None]  # i32[M, k]
        out = jnp.take_along_axis(runs_[jnp.argmax(match, axis=1)], jnp.minimum(at, W - 1), axis=1)
        out = jnp.where((at < W) & jnp.any(match, axis=1)[:, None], out, -1)
        if wrong_at is not None and wrong_at < k:
            out = out.at[:, wrong_at].set(jnp.where(out[:, wrong_at] >= 0, (out[:, wrong_at] + 1) % 256, -1))
        return out
    return drafts


@pytest.fixture
def drafts_on_device(monkeypatch):
    """Install `device_oracle` as the device's lookup for rows in flight (before the engine compiles it); the
    lookup's compiled programs are dropped on the way in and out, so no other test runs the oracle's."""
    def install(prompts, outputs, wrong_at=None):
        monkeypatch.setattr(verify, "ngram_drafts", device_oracle(prompts, outputs, wrong_at))
        verify.redraft_in_flight.clear_cache()
    yield install
    verify.redraft_in_flight.clear_cache()


@pytest.mark.parametrize("overrides, expect", [
    ({}, "cache"),
    (dict(enable_prefix_caching=False), "nocache"),
    (dict(num_pages=24), "preempt"),
    (dict(max_num_batched_tokens=16, max_num_seqs=8), "chunked"),
])
def test_greedy_equals_plain_forward_with_speculation(tiny, overrides, expect):
    prompts = mixed_prompts(10, seed=1) + repetitive_prompts(14, seed=2)
    engine = make_engine(tiny, **overrides)
    done = run_all(engine, prompts)
    for i, prompt in enumerate(prompts):
        expected = greedy_generate(tiny.config, tiny.params, prompt, GREEDY.max_tokens)
        assert done[str(i)].outputs[0].token_ids == expected, f"prompt {i} (len {len(prompt)})"
    num_accepted, num_drafted = accepted(engine)
    assert 0 < num_accepted < num_drafted  # both acceptance and rejection happened
    if expect == "preempt":
        assert engine.scheduler.num_preemptions > 0


def test_verify_buckets_give_small_verifications_their_own_lm_head_rows():
    config = RunnerConfig(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=128, page_size=16,
                          num_pages=200, min_token_bucket=1, min_seq_bucket=1, num_speculative_tokens=4)
    assert [(t, s) for t, s, _ in config.verify_buckets] == [(8, 4), (16, 4), (32, 4), (32, 16), (64, 4), (64, 16)]
    assert dataclasses.replace(config, num_speculative_tokens=0).verify_buckets == ()


def test_verification_samples_drafts_from_the_steps_own_lm_head(tiny):
    """Drafts that do not fit in S logits rows take T rows of the step's own LM head (T <= 64); a step with a
    long prefill chunk beside them (T = 128: drafts fill its padding) computes them in `draft_logits`. Both:
    greedy output exact, no compile."""
    engine = make_engine(tiny, max_num_batched_tokens=128)
    runner, shapes = engine.runner, []
    pack = runner.pack

    def spy(entries):
        step, rows = pack(entries)
        drafts = sum(len(e.spec_token_ids) for e in entries)
        shapes.append((len(step.token_ids), len(step.kv_lens), len(step.logits_indices), len(entries) + drafts))
        return step, rows

    runner.pack = spy
    drafting, long = repetitive_prompts(12, seed=7), mixed_prompts(4, seed=7, max_len=100)
    long = [p + p[:90 - len(p)] if len(p) < 90 else p for p in (q or [1] for q in long)]  # 90-token prefills
    with count_traces() as traces, count_dispatches(runner) as calls:
        for i, prompt in enumerate(drafting):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
        done = {}
        for step in range(200):
            if step in (4, 8, 12, 16):  # the drafting requests decode while these prefill, one at a time: 90
                # tokens beside <= 12 decodes leave >= 26 of the T = 128 bucket's rows to drafts (_draft_room)
                i = step // 4 - 1
                engine.add_request(str(len(drafting) + i), {"prompt_token_ids": long[i]}, GREEDY)
            done.update({o.request_id: o for o in engine.step() if o.finished})
            if not engine.has_unfinished_requests():
                break
    runner.pack = pack
    assert traces == []
    for i, prompt in enumerate(drafting + long):
        assert done[str(i)].outputs[0].token_ids == greedy_generate(tiny.config, tiny.params, prompt, 24), i
    in_tokens = [(t, s) for t, s, rows, need in shapes if rows == t > s]
    assert in_tokens and all(need <= t <= 64 for t, s, rows, need in shapes if rows == t > s)
    assert all(rows == s for t, s, rows, need in shapes if not rows == t > s)
    assert calls["draft_logits"] == sum(1 for t, s, rows, need in shapes if need > rows) > 0
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages


def test_seeded_sampling_is_identical_and_batch_independent_with_speculation(plain, spec):
    prompts = repetitive_prompts(8, seed=3)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s, max_tokens=30, ignore_eos=True)
              for s, (t, p, k) in enumerate([(0.1, 1.0, -1), (0.3, 0.9, -1), (0.8, 1.0, 20), (1.0, 0.95, 50)] * 2)]
    expected = tokens(run_all(plain, prompts, params))
    assert tokens(run_all(spec, prompts, params)) == expected
    alone = tokens(run_all(spec, prompts[5:6], params[5:6]))["0"]
    assert alone == expected["5"]
    # drafts the sampler accepts all along (an oracle), then wrong from the third on: the same tokens again
    # (4 requests: every one's drafts find a partial-prefill slot, so all verify; see Scheduler._draft_room)
    outputs = [expected[str(i)][0] for i in range(4)]
    for wrong_at in (None, 2):
        spec.proposer = OracleProposer(prompts[:4], outputs, wrong_at=wrong_at)
        before = accepted(spec)
        try:
            assert tokens(run_all(spec, prompts[:4], params[:4])) == {str(i): expected[str(i)] for i in range(4)}
        finally:
            spec.proposer = NgramProposer(spec.args.speculative_config)
        after = accepted(spec)
        assert after[0] - before[0] == (after[1] - before[1] if wrong_at is None else after[0] - before[0]) > 0


SMOL_PROMPTS = [  # chat prompts whose answers copy from them, and open ones with little to copy
    "Copy the following paragraph exactly, word for word:\n\nPhotosynthesis is the process by which green "
    "plants use sunlight, water and carbon dioxide to make glucose and oxygen.",
    "Fix the spelling mistakes in this text and write out the corrected text:\n\nThe quick brown fox jumpd "
    "over the lazy dog. The dog was not amused, and it barkd loudly at the fox.",
    "Rename the function `add` to `add_numbers` in this Python code. Output the full code.\n\n"
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Rewrite this list as a numbered list:\n\n- two cups of flour\n- one teaspoon of baking soda\n- two eggs",
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
]


SMOL_EXTRACTION = (  # answered under a JSON schema: a BPE vocabulary's forced tokens and multi-token masks
    "Extract the product details from this listing as JSON.\n\nListing: The Contoso UltraQuiet 3000 is a bladeless "
    "desk fan with three speed settings and a remote control. It costs $89.99 and ships from Seattle, Washington.",
    {"type": "object", "properties": {"name": {"type": "string"}, "features": {"type": "array", "items": {
        "type": "string"}}, "price_usd": {"type": "number"}, "ships_from": {"type": "string"}},
     "required": ["name", "features", "price_usd", "ships_from"], "additionalProperties": False})


def test_smollm2_mixed_batch_with_speculation_equals_without(smollm2):
    """The real model and vocabulary: ten chats at once, copy-heavy and open, greedy and seeded (top-p), two
    of them extractions under a JSON schema, speculating with every draft verified and with the adaptive draft
    length: token for token the plain engine's outputs, drafts both accepted and rejected, every page back."""
    pytest.importorskip("llguidance")

    tok = smollm2.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for text in SMOL_PROMPTS + [SMOL_EXTRACTION[0]] * 2]
    params = [SamplingParams(temperature=0.0, max_tokens=32) if i % 3 else
              SamplingParams(temperature=0.7, top_p=0.95, seed=i, max_tokens=32) for i in range(len(prompts))]
    schema = StructuredOutputsParams(json=SMOL_EXTRACTION[1])
    params[-2:] = [dataclasses.replace(p, structured_outputs=schema, max_tokens=48) for p in params[-2:]]
    base = dataclasses.replace(BASE, max_model_len=256, max_num_seqs=8, num_pages=120)
    expected = tokens(run_all(LLMEngine(base, loaded=smollm2), prompts, params))
    for config in (SPEC, ADAPTIVE):
        engine = LLMEngine(dataclasses.replace(base, speculative_config={**config, "num_speculative_tokens": 5}),
                           loaded=smollm2)
        assert tokens(run_all(engine, prompts, params)) == expected, config
        num_accepted, num_drafted = accepted(engine)
        assert 0 < num_accepted < num_drafted, config


def test_sampling_distribution_is_the_models(tiny):
    """Chi-square: the tokens emitted at a verified draft position (first draft, and second after an accepted
    first) follow the model's distribution there, not the draft's."""
    engine = make_engine(tiny, max_num_partial_prefills=16)
    temperature, prompt = 0.05, repetitive_prompts(1, seed=11)[0]  # the tiny model is flat: sharpen it
    logits_of = jax.jit(lambda ids: forward(tiny.config, tiny.params, ids[None])[0, -1] / temperature)
    probs = functools_cache(lambda ids: np.asarray(jax.nn.softmax(logits_of(jnp.asarray(ids))), np.float64))

    class Forced:  # drafts the model's two most likely tokens, one after the other
        def propose(self, token_ids, max_drafts=None, skip=0):
            for _ in range(skip):  # async scheduling's guess: after the most likely next token
                token_ids = (*token_ids, int(np.argmax(probs(tuple(token_ids)))))
            first = int(np.argmax(probs(tuple(token_ids))))
            return [first, int(np.argmax(probs(tuple(token_ids) + (first,))))][:max_drafts]

    engine.proposer = Forced()
    n = 800
    params = [SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=4, ignore_eos=True) for i in range(n)]
    done = run_all(engine, [prompt] * n, params, check=False)
    outs = [done[str(i)].outputs[0].token_ids for i in range(n)]
    first = [(tuple(prompt + o[:1]), o[1]) for o in outs]  # (context, token at the first draft position)
    drafted = [(ctx + (Forced().propose(ctx)[0],), o[2]) for (ctx, _), o in zip(first, outs)
               if o[1] == Forced().propose(ctx)[0]]
    assert len(drafted) > 80
    for samples in (first, drafted):
        observed = collections.Counter(t for _, t in samples)
        expected = sum(probs(ctx) for ctx, _ in samples)  # f64[V]: sum of each draw's own distribution
        big = [t for t in range(len(expected)) if expected[t] >= 5]
        obs = [observed[t] for t in big] + [len(samples) - sum(observed[t] for t in big)]
        exp = [expected[t] for t in big] + [len(samples) - sum(expected[t] for t in big)]
        assert scipy_stats.chisquare(obs, exp).pvalue > 1e-3, (obs, exp)
    num_accepted, num_drafted = accepted(engine)
    assert 0 < num_accepted < num_drafted


def functools_cache(fn):
    cache = {}
    return lambda key: cache[key] if key in cache else cache.setdefault(key, fn(key))


def test_stops_and_lengths_cut_accepted_drafts(tiny, plain, spec):
    """Stops inside a run of accepted drafts (an oracle proposes what the plain run emits) end the request
    there, as without speculation: stop ids, stop strings, max_tokens, and a stop id banned by min_tokens
    at the first positions of the run but allowed at its last ones."""
    tok = tiny.tokenizer
    prompts = repetitive_prompts(4, seed=21)
    ref = [o[0] for o in tokens(run_all(plain, prompts, dataclasses.replace(GREEDY, max_tokens=30))).values()]
    cases = []
    for prompt, ids in zip(prompts, ref):
        new = [i for i in range(3, 30) if ids[i] not in ids[:i]]
        text = next((t for i in range(6, 28) if (t := tok.decode(ids[i:i + 2], skip_special_tokens=True))), None)
        cases += [(prompt, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))]
        if new:
            cases += [(prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ids[new[0]]]))]
        if new and new[0] <= 5:  # the oracle's first run of drafts covers outputs 1..5
            cases += [(prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=new[0] - 1,
                                              stop_token_ids=[ids[new[0]]]))]
        if text:
            cases += [(prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=[text])),
                      (prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=[text],
                                              include_stop_str_in_output=True))]
    kinds = {(p.min_tokens > 0, bool(p.stop), bool(p.stop_token_ids)) for _, p in cases}
    assert {(True, False, True), (False, True, False), (False, False, True)} <= kinds
    spec.proposer, schedule, spanning = OracleProposer(prompts, ref), spec.scheduler.schedule, []

    def scheduled():  # verifications whose drafts span the min_tokens limit (a ban at the first position only)
        out = schedule()
        spanning.extend(e.request_id for e in out.scheduled_requests
                        if e.spec_token_ids and e.banned_token_ids and not all(e.spec_banned_token_ids))
        return out

    spec.scheduler.schedule = scheduled
    try:  # the min_tokens cases on their own: in a batch of all the cases their drafts would find no room
        for group in ([c for c in cases if c[1].min_tokens], [c for c in cases if not c[1].min_tokens]):
            case_prompts, case_params = [p for p, _ in group], [v for _, v in group]
            expected, got = run_all(plain, case_prompts, case_params), run_all(spec, case_prompts, case_params)
            for rid, out in expected.items():
                a, b = out.outputs[0], got[rid].outputs[0]
                assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
                    (a.token_ids, a.text, a.finish_reason, a.stop_reason), case_params[int(rid)]
                assert a.finish_reason == ("length" if case_params[int(rid)].max_tokens == 7 else "stop")
            if group[0][1].min_tokens:
                assert spanning, "no verification spanned the min_tokens limit"
    finally:
        spec.proposer, spec.scheduler.schedule = NgramProposer(spec.args.speculative_config), schedule


def test_logprobs_and_penalties_are_those_without_speculation(plain, spec):
    prompts = repetitive_prompts(4, seed=31)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.3),
              SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2, logprobs=1)]
    expected = run_all(plain, prompts, params)
    ref = [expected[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    spec.proposer = OracleProposer(prompts, ref)
    before = accepted(spec)
    try:
        got = run_all(spec, prompts, params)
    finally:
        spec.proposer = NgramProposer(spec.args.speculative_config)
    after = accepted(spec)
    assert after[0] - before[0] == after[1] - before[1] > 0  # every (right) draft accepted: penalties saw drafts
    for rid, out in expected.items():
        a, b = out.outputs[0], got[rid].outputs[0]
        assert b.token_ids == a.token_ids
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
        if a.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                assert [v.logprob for v in y.values()] == pytest.approx([v.logprob for v in x.values()], abs=1e-4)
                assert [v.rank for v in y.values()] == [v.rank for v in x.values()]


def test_prompt_logprobs_are_those_without_speculation(plain, spec):
    """Prompt log-probs come from prefill chunks, which may share a step with other requests' verifications:
    the same as without speculation, next to the same tokens, while drafts are accepted."""
    prompts = repetitive_prompts(6, seed=71)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    expected = run_all(plain, prompts, params)
    before = accepted(spec)
    got = run_all(spec, prompts, params)
    assert accepted(spec)[0] > before[0]
    for rid, out in expected.items():
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids
        assert len(got[rid].prompt_logprobs) == len(out.prompt_logprobs) == len(prompts[int(rid)])
        for x, y in zip(out.prompt_logprobs, got[rid].prompt_logprobs):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.keys() == y.keys()
                assert [v.logprob for v in y.values()] == pytest.approx([v.logprob for v in x.values()], abs=1e-4)


def test_drafts_stay_within_max_model_len(tiny):
    engine = make_engine(tiny, max_model_len=64, num_pages=40)
    prompt = ([5, 6, 7, 8] * 16)[:60]
    always = {"propose": lambda self, ids, max_drafts=None, skip=0: [5, 6, 7, 8][:max_drafts]}
    engine.proposer = type("Always", (), always)()
    done = run_all(engine, [prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None))
    out = done["0"].outputs[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 64
    assert out.token_ids == greedy_generate(tiny.config, tiny.params, prompt, 4)


def test_aborts_and_preemption_keep_pages_exact(tiny):
    engine = make_engine(tiny, num_pages=12, max_num_seqs=8)
    prompts = repetitive_prompts(12, seed=41)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, dataclasses.replace(GREEDY, max_tokens=40))
    done = {}
    for step in range(1000):
        if not engine.has_unfinished_requests():
            break
        if step in (6, 12):
            engine.abort_request([str(i) for i in range(step // 6 - 1, 12, 4)])
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.scheduler.check_invariants()
    pool = engine.scheduler.pool
    assert pool.num_free_pages == pool.num_usable_pages and engine.scheduler.num_preemptions > 0
    assert accepted(engine)[0] > 0
    for rid, out in done.items():
        assert out.outputs[0].token_ids == greedy_generate(tiny.config, tiny.params, prompts[int(rid)], 40)


def test_constrained_requests_with_preemption_and_aborts_keep_pages_exact(tiny, plain):
    """Requests under a JSON schema speculating (forced and n-gram drafts) in a pool too small for the batch,
    two aborted midway: preemption happens, every page comes back, drafts were accepted, and the requests
    that finish emit the plain engine's tokens (a preempted one recomputes; its grammar state is its output's)."""
    pytest.importorskip("llguidance")

    engine = make_engine(tiny, num_pages=12, max_num_seqs=8)
    constrained = SamplingParams(temperature=0.0, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(json=PERSON))
    params = [constrained, dataclasses.replace(GREEDY, max_tokens=40)] * 4
    prompts = repetitive_prompts(8, seed=43)
    expected = tokens(run_all(plain, prompts, params))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    requests, done = {}, {}  # each Request once scheduled (a constrained one waits for its grammar first)
    for step in range(1000):
        if not engine.has_unfinished_requests():
            break
        if step == 8:
            engine.abort_request(["2", "5"])
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        requests.update((r.request_id, r) for r in engine.scheduler.running)
        engine.scheduler.check_invariants()
    pool = engine.scheduler.pool
    assert pool.num_free_pages == pool.num_usable_pages
    assert any(requests[str(i)].num_preemptions for i in (0, 4, 6))  # a constrained request that finishes
    assert accepted(engine)[0] > 0
    assert {rid: [list(o.token_ids) for o in out.outputs] for rid, out in done.items() if rid not in ("2", "5")} \
        == {rid: out for rid, out in expected.items() if rid not in ("2", "5")}


def test_a_failed_verification_in_flight_leaves_a_request_preempted_since_to_go_on(tiny, plain):
    """Overlapped verification in a pool too small for the batch: a verifying step whose tokens fail to reach
    the host after one of its requests was preempted (its drafts still counted as placeholders, as if
    accepted). The caller aborts the running requests (as AsyncLLM does); the preempted one forgets the drafts
    with the token in flight and recomputes: it emits the plain engine's tokens, as the other waiting ones do,
    and no later step fails."""
    prompts = repetitive_prompts(8, seed=41)
    params = dataclasses.replace(GREEDY, max_tokens=40, output_kind=RequestOutputKind.DELTA)
    expected = tokens(run_all(plain, prompts, dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)))
    engine = make_engine(tiny, num_pages=12, max_num_seqs=8, **OVERLAP)
    engine.proposer = OracleProposer(prompts, [expected[str(i)][0] for i in range(len(prompts))])
    stale = []

    def a_request_it_verifies_waits(scheduler_output, _) -> bool:  # once: preempted since, its drafts placeholders
        verifying = {e.request_id for e in scheduler_output.scheduled_requests if e.spec_token_ids}
        waiting = [r.request_id for r in engine.scheduler.waiting
                   if r.request_id in verifying and r.num_draft_placeholders]
        if waiting and not stale:
            stale.extend(waiting)
            return True
        return False
    fail_results_when(engine, a_request_it_verifies_waits)
    delivered, failures = run_through_failures(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert len(stale) == 1 and len(failures) == 1 and stale[0] not in failures[0]
    for rid in set(expected) - set(failures[0]):
        assert delivered[rid] == expected[rid][0], rid
    assert accepted(engine)[0] > 0


def random_params(rng: np.random.Generator) -> SamplingParams:
    """A request's settings drawn at random: greedy or seeded (hot, top-p, top-k, min-p), and at times penalties,
    min_tokens, logprobs, stop ids, a logit bias, two samples, a JSON schema or a regex; EOS honoured or not, 1 to
    30 tokens."""
    kind = rng.choice(["greedy", "seeded", "top_p", "top_k", "min_p"])
    kw = dict(max_tokens=int(rng.integers(1, 31)), ignore_eos=bool(rng.random() < 0.7))
    if kind == "greedy":
        kw["temperature"] = 0.0
    else:
        kw.update(temperature={"seeded": 0.8, "top_p": 3.0, "top_k": 1.5, "min_p": 1.2}[kind],
                  seed=int(rng.integers(1 << 20)), top_p=0.9 if kind == "top_p" else 1.0,
                  top_k=int(rng.choice([1, 3, 20])) if kind == "top_k" else 0, min_p=0.1 if kind == "min_p" else 0.0)
    if rng.random() < 0.4:
        kw.update(presence_penalty=float(rng.choice([0.5, 1.0, -0.5])), frequency_penalty=float(rng.choice([0, 0.7])),
                  repetition_penalty=float(rng.choice([1.0, 1.5, 0.8])))
    if rng.random() < 0.25:
        kw["min_tokens"] = int(rng.integers(0, kw["max_tokens"] + 1))
    if rng.random() < 0.3:
        kw["logprobs"] = int(rng.choice([0, 2]))
    if rng.random() < 0.25:
        kw["stop_token_ids"] = rng.choice(256, size=int(rng.integers(1, 9)), replace=False).tolist()
    if rng.random() < 0.2:
        kw["logit_bias"] = {int(t): float(rng.choice([-100.0, 5.0])) for t in rng.choice(256, size=3)}
    if rng.random() < 0.1 and kind != "greedy":
        kw["n"] = 2
    if rng.random() < 0.15:  # forced and n-gram drafts under a grammar (verified synchronously when overlapped)
        kw["structured_outputs"] = StructuredOutputsParams(json=PERSON) if rng.random() < 0.5 else \
            StructuredOutputsParams(regex="[a-e]{2,8}( [0-9]{1,3}){1,9}")
    return SamplingParams(**kw)


@pytest.mark.parametrize("fuse", ["off", "on"])
def test_random_requests_with_preemption_and_aborts_are_those_without(tiny, plain, fuse):
    """Batches of requests with settings drawn at random (`random_params`: every setting a row's verification
    must honour, mixed in one batch), speculating overlapped (a GPU's engine: the fused program or not) in a pool
    too small for them, one request of some batches aborted at a random step; the drafts the n-gram proposer's or
    an oracle's (all right, or wrong from a random position). Every request that finishes emits what the plain
    engine emits (tokens, finish reason, logprobs), every page comes back, drafts are accepted and rejected."""
    rng = np.random.default_rng(17)
    engine = make_engine(tiny, fuse_sampler=fuse, num_pages=10, max_num_seqs=6, max_num_partial_prefills=6,
                         **OVERLAP)
    for round_ in range(16):
        n = int(rng.integers(1, 7))
        prompts = repetitive_prompts(n, seed=100 + round_) if round_ % 4 else mixed_prompts(n, seed=round_,
                                                                                             max_len=60)
        params = [random_params(rng) for _ in prompts]
        expected = run_all(plain, prompts, params)
        oracle = [expected[str(i)].outputs[0].token_ids for i in range(n)]
        engine.proposer = [NgramProposer(engine.args.speculative_config), OracleProposer(prompts, oracle),
                           OracleProposer(prompts, oracle, wrong_at=int(rng.integers(0, 4)))][round_ % 3]
        abort = (int(rng.integers(0, 12)), str(rng.integers(n))) if rng.random() < 0.4 else (-1, None)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
        done = {}
        for step in itertools.count():
            if not engine.has_unfinished_requests():
                break
            if step == abort[0] and abort[1] not in done:
                engine.abort_request(abort[1])
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            engine.scheduler.check_invariants()
        assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_usable_pages
        assert set(done) | {abort[1]} >= set(expected)
        for rid, out in done.items():
            for a, b in zip(expected[rid].outputs, out.outputs, strict=True):
                assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), (round_, params[int(rid)])
                assert (a.logprobs is None) == (b.logprobs is None)
                for x, y in zip(a.logprobs or (), b.logprobs or (), strict=True):
                    assert x.keys() == y.keys()
                    assert [v.logprob for v in y.values()] == pytest.approx([v.logprob for v in x.values()], abs=1e-4)
    num_accepted, num_drafted = accepted(engine)
    assert 0 < num_accepted < num_drafted and engine.scheduler.num_preemptions > 0


def before_each_step(engine: LLMEngine, fn) -> None:
    """Call fn(scheduler_output, overlapped) before each step runs: synchronous (`execute_model`, where drafts
    are verified; overlapped False) or overlapped (async scheduling's `dispatch`; True)."""
    runner = engine.runner
    execute, dispatch = runner.execute_model, runner.dispatch
    runner.execute_model = lambda out, *rest: fn(out, False) or execute(out, *rest)
    runner.dispatch = lambda out, *rest: fn(out, True) or dispatch(out, *rest)


def slow_steps(engine: LLMEngine, seconds: float, seconds_a_row: float) -> tuple[list[int], list[int]]:
    """Make each step take `seconds` plus seconds_a_row per row fed longer (rows nearly free: a GPU or float32
    on a CPU; rows costly: int8 on a CPU). Returns the lists each proposal's and each step's draft counts go to
    (async scheduling's guesses of drafts after a token in flight are not proposals)."""
    propose, proposed, fed = engine.proposer.propose, [], []

    def slow(out, overlapped):
        fed.append(sum(len(e.spec_token_ids) for e in out.scheduled_requests))
        time.sleep(seconds + seconds_a_row * out.num_scheduled_tokens)

    def counted(*args, skip=0, **kw):
        drafts = propose(*args, skip=skip, **kw)
        if not skip:
            proposed.append(len(drafts))
        return drafts

    before_each_step(engine, slow)
    engine.proposer.propose = counted
    return proposed, fed


@pytest.mark.parametrize("seconds, seconds_a_row, verified", [(0.02, 0.0, (0.75, 1.0)), (0.0, 0.008, (0.0, 0.6))])
def test_adaptive_draft_length_verifies_the_drafts_that_pay_for_their_rows(tiny, seconds, seconds_a_row, verified):
    """Batch 1. Where a row adds little to a step, the adaptive engine verifies most drafts it proposes; where
    each adds 8 ms to a ~2 ms step, few (acceptance here is ~0.6: 4 drafts would give 2.3 tokens for ~4x the
    time; each row count is tried a few times first). Either way it emits the plain greedy tokens, and every
    page comes back. The synchronous loop: every step's cost is the one slept (with async scheduling, below,
    steps without drafts overlap the host's work)."""
    engine = make_engine(tiny, speculative_config=ADAPTIVE, async_scheduling=False)
    proposed, fed = slow_steps(engine, seconds, seconds_a_row)
    for prompt in repetitive_prompts(6, seed=81):
        done = run_all(engine, [prompt])
        assert done["0"].outputs[0].token_ids == greedy_generate(tiny.config, tiny.params, prompt, 24)
    assert engine.draft_policy.step_seconds() and sum(proposed) > 50
    low, high = verified
    assert low * sum(proposed) <= sum(fed) <= high * sum(proposed), (sum(fed), sum(proposed))


SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
PENALISED = dataclasses.replace(SEEDED, presence_penalty=0.5)
MIN_TOKENS = dataclasses.replace(SEEDED, min_tokens=24)  # bans EOS to the end: never verified overlapped
PENALTIES = dict(presence_penalty=1.0, frequency_penalty=0.7, repetition_penalty=1.5)  # strong: counts matter


@pytest.mark.parametrize("kind", ["greedy", "seeded", "penalised", "min_tokens", "greedy, not overlapped"])
def test_async_scheduling_overlaps_verifications_it_can(tiny, plain, kind):
    """Speculation under async scheduling (the default). Greedy, seeded and penalised requests: every step is
    overlapped, those that verify drafts too: the next step is dispatched before their outcome is on the host,
    its drafts proposed on the device (the proposer says only how many), its positions and key steps moved back and
    its penalty counts given the tokens in flight on the device. Requests under min_tokens (their EOS bans follow the tokens in flight on
    the host): a step that verifies drafts runs synchronously, every other step is overlapped. Nothing proposed:
    every step overlapped. An oracle's drafts for every request (all accepted, or wrong from the second). For
    half the requests: on CPU no room for drafts beside decodes without (the scheduler's rule), so every step
    overlapped, and the min_tokens engine stops waiting for tokens in flight to propose drafts that find no room
    (until the batch changes). Greedy requests with overlap_verification off (CPU's default) are verified as the
    min_tokens ones. Outputs: those without speculation."""
    prompts = mixed_prompts(2, seed=91) + repetitive_prompts(2, seed=91)  # all 4 fit the partial-prefill slots
    params = {"seeded": SEEDED, "penalised": PENALISED, "min_tokens": MIN_TOKENS}.get(kind, GREEDY)
    overlapped = kind in ("greedy", "seeded", "penalised")
    expected = [o.outputs[0].token_ids for _, o in sorted(run_all(plain, prompts, params).items())]
    engine = make_engine(tiny, overlap_verification=kind != "greedy, not overlapped", **OVERLAP)
    assert engine.async_scheduling
    steps, proposals = [], []  # (overlapped, drafts fed, drafts fed after a verification in flight) per step
    before_each_step(engine, lambda out, overlapped: steps.append(
        (overlapped, sum(len(e.spec_token_ids) for e in out.scheduled_requests),
         sum(len(e.spec_token_ids) for e in out.scheduled_requests if e.placeholder))))
    propose_drafts = engine._propose_drafts
    engine._propose_drafts = lambda: proposals.append(1) or propose_drafts()
    never = type("Never", (), {"propose": lambda self, ids, max_drafts=None, skip=0: []})()
    for proposer, num_accepted in ((never, None), (OracleProposer(prompts, expected), "all"),
                                   (OracleProposer(prompts, expected, wrong_at=1), "some"),
                                   (OracleProposer(prompts[::2], expected[::2]), None)):
        engine.proposer, before = proposer, accepted(engine)
        steps.clear(), proposals.clear()
        done = run_all(engine, prompts, params)
        assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == expected
        synchronous = [drafts for overlapped, drafts, _ in steps if not overlapped]
        accepted_now, drafted_now = np.subtract(accepted(engine), before)
        if num_accepted is None:
            assert not synchronous and accepted_now == drafted_now == 0, steps
            if proposer is never:  # no guess past a token in flight either: proposals only after prefill chunks
                assert len(proposals) <= 5 < len(steps), (proposals, steps)  # (handled at once: > 8 tokens on CPU)
            continue
        if overlapped:  # the drafts of a request in flight are the device's lookup's, whatever the proposer says
            assert 0 < drafted_now and accepted_now <= drafted_now and (accepted_now > 0 or kind != "greedy")
        else:
            assert accepted_now == drafted_now if num_accepted == "all" else 0 < accepted_now < drafted_now
        if overlapped:
            assert not synchronous and sum(after for _, _, after in steps) >= 0.6 * drafted_now, steps
        else:
            assert all(synchronous) and all(drafts == 0 for kept, drafts, _ in steps if kept)
            assert len(synchronous) >= 4 and len(steps) - len(synchronous) >= 1, steps
    if not overlapped:
        assert 2 <= len(proposals) <= 8 < len(steps)  # the half oracle's: not one a step


@pytest.mark.parametrize("fuse, kind", [(fuse, kind) for kind in ("greedy", "seeded", "penalised", "penalised, hot")
                                         for fuse in ("off", "on")] + [("on", "penalised, hot, 4 slots")])
def test_overlapped_verifications_emit_the_plain_tokens_and_compile_nothing(tiny, plain, fuse, kind, monkeypatch,
                                                                          drafts_on_device):
    """Greedy, seeded and penalised requests (strong presence, frequency and repetition penalties, greedy or hot),
    async scheduling with every step kept in flight: steps scheduled while a verification is in flight (their
    token a placeholder, their positions and key steps moved back and their penalty counts given the tokens in
    flight on the device) that verify drafts of their own, on the fused program (drafts packed in its rows, or
    beside it) or not. One at a time and all at once in a pool too small for them (preemption), the n-gram
    proposer and an oracle wrong from its third draft (for a request in flight only its count of draft slots
    counts: their drafts are the device's: its n-gram lookup for greedy outputs, which copy, an oracle's for hot or
    penalised ones, which copy little): the plain tokens, every page back, drafts accepted and rejected, draft
    slots after a verification in flight, nothing compiled after warm-up. The fused program's candidate pass keeps
    8 candidates a row (any number gives the same samples), so hot rows take its fallbacks too. With 4 sequence
    slots (so at most 4 logits rows a step) the fused program's drafts mostly overflow its rows: sampled beside it
    (after a verification in flight, from its outcome)."""
    monkeypatch.setattr(in_step, "sample_in_step", functools.partial(in_step.sample_in_step, prefilter_k=8))
    prompts = repetitive_prompts(10, seed=61) + mixed_prompts(4, seed=61)
    hot = dataclasses.replace(SEEDED, temperature=3.0, top_p=0.9)
    params = {"greedy": GREEDY, "seeded": hot, "penalised": dataclasses.replace(GREEDY, **PENALTIES),
              "penalised, hot": dataclasses.replace(hot, **PENALTIES)}[kind.removesuffix(", 4 slots")]
    expected = [o.outputs[0].token_ids for _, o in sorted(run_all(plain, prompts, params).items(),
                                                          key=lambda item: int(item[0]))]
    if kind == "greedy":
        assert expected == [greedy_generate(tiny.config, tiny.params, p, GREEDY.max_tokens) for p in prompts]
    else:  # hot or penalised outputs copy little: the device's drafts in flight are an oracle's, wrong from the third
        drafts_on_device(prompts, expected, wrong_at=2)
    slots = {"max_num_seqs": 4, "num_pages": 12} if "4 slots" in kind else {"num_pages": 24}
    engine = make_engine(tiny, fuse_sampler=fuse, max_num_partial_prefills=8, **slots, **OVERLAP)
    assert engine.runner.fuse_sampler is (fuse == "on")
    after = []  # drafts fed after a verification in flight
    before_each_step(engine, lambda out, overlapped: after.extend(
        len(e.spec_token_ids) for e in out.scheduled_requests if e.placeholder and e.spec_token_ids))
    with count_traces() as traces, count_dispatches(engine.runner) as counts:
        for proposer in (NgramProposer(engine.args.speculative_config), OracleProposer(prompts, expected, wrong_at=2)):
            engine.proposer = proposer
            for group in [[0], [1], [2]] + [list(range(len(prompts)))]:
                done = run_all(engine, [prompts[i] for i in group], params)
                assert [done[str(j)].outputs[0].token_ids for j in range(len(group))] == [expected[i] for i in group]
    assert traces == []
    assert (counts["_resample_rows"] > 0) is (fuse == "on" and (kind == "seeded" or "hot" in kind)), counts
    num_accepted, num_drafted = accepted(engine)
    assert 0 < num_accepted < num_drafted and sum(after) > 0.3 * num_drafted, (num_accepted, num_drafted, sum(after))
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("fuse, kind", [("off", "greedy"), ("off", "penalised"), ("on", "penalised")])
def test_drafts_of_rows_in_flight_are_proposed_on_the_device(tiny, plain, fuse, kind, drafts_on_device):
    """Overlapped verification: for a request whose step is in flight the host reserves only a count of draft
    slots; the device proposes their drafts from that step's real outcome (its n-gram lookup on the real sequence:
    the drafts a synchronous step would verify, -1 past what it found), whatever the host's proposer says; a
    request not in flight verifies the host's drafts as proposed. The stats and the policy count the drafts fed,
    fetched with the step's tokens (`ModelRunnerOutput.num_draft_tokens`: the found ones). An oracle proposer (its
    counts only matter in flight); the plain tokens. Penalised requests (strong penalties), fused sampler or not:
    their rows count the drafts as fed, the device's (their outputs copy nothing here, so the device's lookup is an
    oracle's: `device_oracle`)."""
    prompts = repetitive_prompts(3, seed=95)
    params = dataclasses.replace(GREEDY, **PENALTIES) if kind == "penalised" else GREEDY
    expected = [o.outputs[0].token_ids for _, o in sorted(run_all(plain, prompts, params).items())]
    if kind == "greedy":
        assert expected == [greedy_generate(tiny.config, tiny.params, p, GREEDY.max_tokens) for p in prompts]
        continuation = NgramProposer(SpeculativeConfig.from_dict(ADAPTIVE)).continuation
    else:
        drafts_on_device(prompts, expected)
        continuation = lambda ids, d: OracleProposer(prompts, expected).continuation(ids)[:d]  # noqa: E731
    engine = make_engine(tiny, speculative_config=ADAPTIVE, fuse_sampler=fuse, **OVERLAP)
    assert engine.runner_config.prompt_lookup == (1, 3)
    engine.proposer = OracleProposer(prompts, expected)
    engine.draft_policy.plan = lambda n, gains, without_drafts=0: [len(g) for g in gains]
    observed = []
    observe = engine.draft_policy.observe_verification
    engine.draft_policy.observe_verification = lambda request, *a, **kw: observed.append(a[0]) or \
        observe(request, *a, **kw)
    fed = collections.Counter()
    handle = engine._handle_in_flight

    def handled(flight):  # checks the drafts `flight` verified, its outcome still in flight
        layout, result = flight.layout, flight.result()
        verified = np.asarray(layout.verified_ids) if layout is not None else ()
        entries = {e.request_id: e for e in flight.scheduler_output.scheduled_requests}
        for m, rid in enumerate(layout.request_ids if layout is not None else ()):
            request, d = scheduled_requests(flight)[rid], layout.num_drafts[m]
            if entries[rid].placeholder:  # the device's: the lookup on the tokens known now (the step before's outcome)
                real = continuation(request.all_token_ids, d)
                assert verified[m, :d].tolist() == real + [-1] * (d - len(real))
                fed["device"] += 1
            else:  # the host's, fed as proposed
                assert verified[m, :d].tolist() == list(layout.draft_ids[m, :d]) == list(entries[rid].spec_token_ids)
                fed["host"] += 1
            assert result.num_draft_tokens[rid] == int(np.sum(verified[m, :d] >= 0))
            fed["drafts"] += result.num_draft_tokens[rid]
        return handle(flight)

    engine._handle_in_flight = handled
    for i, prompt in enumerate(prompts):
        done = run_all(engine, [prompt], params)
        assert done["0"].outputs[0].token_ids == expected[i]
    assert fed["device"] >= 5, fed
    verifications = engine.spec_decoding_stats.as_stats()["spec_decode_num_drafts"]
    assert len(observed) == verifications and accepted(engine)[1] == sum(observed) == fed["drafts"]
    assert sum(observed) > 0


def test_a_copy_that_breaks_keeps_its_draft_slots_for_a_while(tiny):
    """Overlapped verification: where the host's lookup finds nothing past the step in flight, a request whose
    draft was accepted lately still reserves k draft slots, which the device proposes from the real sequence (the
    host's lookup lags it by that step's outcome), up to RESERVE_AFTER_ACCEPT times after its last accepted draft.
    A proposer with an oracle's drafts that finds nothing past a request's first 6 output tokens: such slots are
    reserved, some find drafts on the device and some nothing, streaks reach the limit and never pass it, and the
    tokens are the plain ones."""
    prompts = repetitive_prompts(3, seed=97) + mixed_prompts(3, seed=97)
    expected = [greedy_generate(tiny.config, tiny.params, p, GREEDY.max_tokens) for p in prompts]
    oracle, prompt_len = OracleProposer(prompts, expected), {len(p) for p in prompts}

    class Lagging:  # the oracle's drafts for a request's first 6 tokens, then nothing past a step in flight
        def propose(self, token_ids, max_drafts=None, skip=0):
            if skip and not any(n < len(token_ids) <= n + 6 and list(token_ids[:n]) in prompts for n in prompt_len):
                return []
            return oracle.propose(token_ids, max_drafts, skip)

    engine = make_engine(tiny, **OVERLAP)
    engine.proposer = Lagging()
    k = engine.runner_config.num_speculative_tokens
    seen, streak, blind = collections.Counter(), collections.Counter(), {}  # blind: {step: its slots reserved blind}
    draft_slots, reserving = engine._draft_slots, set()

    def slots(request, num_in_flight, room):
        found = engine.proposer.propose(request.all_token_ids, room, skip=num_in_flight + 1)
        d = draft_slots(request, num_in_flight, room)
        if not found and d:
            assert d == min(room, k)
            streak[request.request_id] += 1
            assert streak[request.request_id] <= RESERVE_AFTER_ACCEPT, "slots past the limit"
            seen["limit"] += streak[request.request_id] == RESERVE_AFTER_ACCEPT
            reserving.add(request.request_id)
        return d

    def scheduled(out, overlapped):
        blind[id(out)] = set(reserving)
        reserving.clear()

    engine._draft_slots = slots
    before_each_step(engine, scheduled)
    handle = engine._handle_in_flight

    def handled(flight):
        result, reserved = flight.result(), blind.pop(id(flight.scheduler_output), set())
        for rid, num_accepted in result.num_accepted_drafts.items():
            if rid in reserved:
                seen["found" if result.num_draft_tokens[rid] else "nothing"] += 1
            if num_accepted:
                streak[rid] = 0
        return handle(flight)

    engine._handle_in_flight = handled
    for i, prompt in enumerate(prompts):
        done = run_all(engine, [prompt])
        assert done["0"].outputs[0].token_ids == expected[i]
    assert seen["found"] >= 2 and seen["nothing"] >= 1 and seen["limit"] >= 1, seen


@pytest.mark.parametrize("seconds, seconds_a_row", [(0.02, 0.0), (0.0, 0.008)])
def test_async_scheduling_waits_for_drafts_that_pay(tiny, plain, seconds, seconds_a_row):
    """Async scheduling with the adaptive draft length, batch 1 on copying prompts, seeded sampling, its
    verifications synchronous (overlap_verification off, CPU's default): where a row adds little to a step (a synchronous step of a few rows costs
    about an overlapped one), most drafts proposed are verified; where each row adds 8 ms, most decode steps stay
    overlapped (the policy would cut the drafts guessed, so the engine does not wait for the token in flight to
    propose them). The tokens without speculation either way."""
    engine = make_engine(tiny, speculative_config=ADAPTIVE, overlap_verification=False)
    kinds = collections.Counter()  # decode steps: overlapped or synchronous
    proposed, fed = slow_steps(engine, seconds, seconds_a_row)
    before_each_step(engine, lambda out, overlapped: kinds.update(
        ["overlapped" if overlapped else "synchronous"] * all(e.num_tokens == 1 + len(e.spec_token_ids)
                                                              for e in out.scheduled_requests)))
    params = dataclasses.replace(SEEDED, temperature=0.2)  # nearly greedy: the copies are mostly accepted
    for prompt in repetitive_prompts(6, seed=81):
        done = run_all(engine, [prompt], params)
        assert done["0"].outputs[0].token_ids == run_all(plain, [prompt], params)["0"].outputs[0].token_ids
    if seconds_a_row:
        assert kinds["overlapped"] > 2 * kinds["synchronous"], kinds
    else:
        assert sum(proposed) >= 15 and sum(fed) >= 0.6 * sum(proposed), (sum(fed), sum(proposed), kinds)


def test_a_step_left_in_flight_while_the_engine_idles_is_not_timed(tiny, plain):
    """A request that stops on a sampled token leaves the next step in flight (its wasted slot), handled only at the
    engine's next step, after however long it idled: the adaptive policy must not time that step (it would take a
    row count's cost for the idle gap and stop drafting at that size). Seeded requests verifying overlapped, each
    stopping on a token it samples (stop_token_ids), 0.3 s idle between them: no step time near 0.3 s, and the
    policy timed the decode steps."""
    prompts = repetitive_prompts(4, seed=97)
    params = dataclasses.replace(SEEDED, ignore_eos=False)
    expected = [o.outputs[0].token_ids for _, o in sorted(run_all(plain, prompts, params).items(),
                                                          key=lambda item: int(item[0]))]
    engine = make_engine(tiny, speculative_config=ADAPTIVE, **OVERLAP)
    engine.proposer = OracleProposer(prompts, expected, wrong_at=2)
    left_in_flight = 0
    for prompt, tokens in zip(prompts, expected):
        stop = dataclasses.replace(params, stop_token_ids=[tokens[12]])
        done = run_all(engine, [prompt], stop)
        assert done["0"].outputs[0].token_ids == tokens[:tokens.index(tokens[12]) + 1]
        left_in_flight += engine._in_flight is not None
        time.sleep(0.3)
    assert left_in_flight >= 3
    times = [t for samples in engine.draft_policy.step_times.values() for t in samples]
    assert len(times) >= 3 and max(times) < 0.2, engine.draft_policy.step_times


@pytest.mark.parametrize("loop", ["synchronous", "async", "async, penalised", "async, min_tokens"])
def test_a_decode_without_drafts_is_not_slowed_by_verifications(tiny, plain, loop):
    """Issue 17's "in a mixed batch, requests without drafts are not slowed", with the adaptive policy: 3 decodes,
    one with an oracle's drafts (all right). Every step takes 90 ms, a verification's synchronous step under
    async scheduling 144 ms (1.6x: the H200's 7.3 ms against 4.4, its host time no longer hidden). On the
    synchronous loop a draft in the step's padding row costs nothing and is verified; so it is under async
    scheduling, where greedy and penalised requests' verifications are overlapped. Under min_tokens (EOS banned
    on the host), they would run synchronously and slow the two others by 1.6x, so once the policy has timed both
    kinds of step (a first round), the copying request verifies nothing while they run. The tokens without
    speculation every way."""
    prompts = repetitive_prompts(3, seed=93)
    params = {"async, penalised": dataclasses.replace(PENALISED, temperature=0.2),
              "async, min_tokens": dataclasses.replace(MIN_TOKENS, temperature=0.2)}.get(loop, GREEDY)
    expected = [o.outputs[0].token_ids for _, o in sorted(run_all(plain, prompts, params).items())]
    engine = make_engine(tiny, speculative_config=ADAPTIVE, async_scheduling=loop != "synchronous")
    engine.proposer = OracleProposer(prompts[:1], expected[:1])
    steps = []  # (drafts fed) of each step of 3 decodes
    # 90 ms a step: the policy's 5% budget (4.5 ms) stays above a loaded machine's step-time noise (+-3 ms seen)
    before_each_step(engine, lambda out, overlapped: time.sleep(0.090 if overlapped or loop == "synchronous" else 0.144)
                     or steps.append(sum(len(e.spec_token_ids) for e in out.scheduled_requests))
                     if len(out.scheduled_requests) == 3 and all(e.num_tokens == 1 + len(e.spec_token_ids)
                                                                 for e in out.scheduled_requests) else None)
    for _ in range(2):  # the first round times the steps
        steps.clear()
        done = run_all(engine, prompts, params)
        assert [done[str(i)].outputs[0].token_ids for i in range(3)] == expected
    verified = sum(drafts > 0 for drafts in steps)
    assert verified == 0 if "min_tokens" in loop else verified >= 3, steps


def test_overlap_verification_defaults_to_the_platform_and_is_checked(tiny):
    assert EngineArgs(model="x").overlap_verification is None  # None: on with a GPU, off on CPU
    engine = LLMEngine(dataclasses.replace(BASE, speculative_config=SPEC, warmup=False), loaded=tiny)
    assert engine.overlap_verification is (jax.default_backend() == "gpu")
    with pytest.raises(ValueError, match="overlap_verification"):
        EngineArgs(model="x", overlap_verification="yes")


def test_no_compilation_after_warmup_with_speculation(tiny):
    engine = make_engine(tiny, num_pages=40)  # small pool: preemption too
    prompts = repetitive_prompts(16, seed=4) + mixed_prompts(4, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_k=5, logprobs=3), SamplingParams(repetition_penalty=1.3,
              presence_penalty=0.5, max_tokens=20), SamplingParams(n=2, temperature=0.5, stop=["a", "b"]),
              SamplingParams(min_tokens=4, max_tokens=6, logit_bias={3: 5.0})] * 4
    with count_traces() as traces:
        run_all(engine, prompts, params[:20])
    assert traces == []
    assert accepted(engine)[0] > 0


def test_no_drafts_while_more_requests_are_enqueued_than_disable_by_batch_size(tiny):
    """vLLM's disable_by_batch_size, checked every step: 4 requests of different lengths draft nothing while
    more than 2 are enqueued, then speculate as the batch drains; the outputs are the plain greedy ones. Every
    request has drafts (an oracle's, all right), so a step of 4 decodes would have room for them: only the
    limit keeps them out."""
    engine = make_engine(tiny, speculative_config={**SPEC, "disable_by_batch_size": 2})
    prompts = repetitive_prompts(4, seed=71)
    lengths = (6, 10, 30, 40)
    expected = [greedy_generate(tiny.config, tiny.params, p, n) for p, n in zip(prompts, lengths)]
    engine.proposer = OracleProposer(prompts, expected)
    seen = []  # per step: (requests enqueued, whether it fed drafts)
    before_each_step(engine, lambda out, _: seen.append((engine.scheduler.num_running + engine.scheduler.num_waiting,
                                                       any(e.spec_token_ids for e in out.scheduled_requests))))
    done = run_all(engine, prompts, [dataclasses.replace(GREEDY, max_tokens=n) for n in lengths])
    assert [n for n, drafted in seen if drafted] and all(n <= 2 for n, drafted in seen if drafted)
    assert sum(n > 2 for n, _ in seen) >= 6  # the first steps: 4, then 3 requests
    for rid, out in done.items():
        assert out.outputs[0].token_ids == expected[int(rid)]


def test_metrics_expose_the_spec_decode_counters(spec):
    from server.metrics import ServerMetrics

    run_all(spec, repetitive_prompts(2, seed=51))
    stats = spec.stats()
    text = ServerMetrics(type("Engine", (), {"stats": lambda self: stats})(), "m", 64).render().decode()
    assert f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(stats["spec_decode_num_drafts"])}' \
        in text
    for name in ("num_draft_tokens", "num_accepted_tokens"):
        assert f"vllm:spec_decode_{name}_total" in text
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == stats["spec_decode_num_accepted_tokens"] > 0
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} ' \
           f'{float(per_pos[0])}' in text
    plain_stats = {k: v for k, v in stats.items() if not k.startswith("spec_")}
    text = ServerMetrics(type("Engine", (), {"stats": lambda self: plain_stats})(), "m", 64).render().decode()
    assert "spec_decode" not in text


def test_structured_outputs_with_speculation_are_those_without(plain, spec):
    """A constrained request drafts the tokens its grammar forces, then n-gram drafts, only what its grammar
    allows, and each position a verification samples gets the mask after the drafts before it: JSON-schema and
    regex requests (greedy and seeded) beside unconstrained ones emit the plain engine's tokens, with the
    proposer's drafts, with the forced tokens alone (accepted), and with an oracle's (the plain outputs: all
    accepted; then wrong from the second on: cut where the grammar forbids them, else rejected), their drafts
    sampled both in the step's own logits rows and in `draft_logits`'; every page back."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "tags": {"type": "array", "items": {"enum": ["ab", "ba"]},
                                                        "minItems": 1, "maxItems": 4}},
              "required": ["name", "tags"], "additionalProperties": False}
    so = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex="(ab|ba|abc)+ [0-9]{1,3}!")]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so[0]),
              SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=60, structured_outputs=so[0]),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so[1]),
              SamplingParams(temperature=1.0, seed=8, max_tokens=40, structured_outputs=so[1]), GREEDY,
              SamplingParams(temperature=0.8, seed=9, max_tokens=24, ignore_eos=True)]
    prompts = repetitive_prompts(len(params), seed=61)
    expected = tokens(run_all(plain, prompts, params))
    runner, execute, layout_drafts = spec.runner, spec.runner.execute_model, spec.runner._layout_drafts
    drafted, layouts, verify_buckets_before = collections.Counter(), set(), runner._verify_buckets

    def spy(out, *rest):
        for e in out.scheduled_requests:
            matcher = spec._child_to_parent[e.request_id][1].matcher
            if e.spec_token_ids and matcher is not None:
                assert matcher.valid_prefix(e.spec_token_ids) == len(e.spec_token_ids)
                drafted[e.request_id] += 1
        return execute(out, *rest)

    def layout_spy(entries, step):
        layout = layout_drafts(entries, step)
        if any(e.spec_token_ids and e.sampling_params.structured_outputs for e in entries):
            layouts.add(layout.packed)
        return layout

    runner.execute_model, runner._layout_drafts = spy, layout_spy
    try:
        assert tokens(run_all(spec, prompts, params)) == expected
        assert {"0", "2"} <= set(drafted), drafted  # JSON and regex requests drafted
        spec.proposer = type("Never", (), {"propose": lambda self, ids, max_drafts=None, skip=0: []})()
        before = accepted(spec)  # the constrained requests' drafts now only the tokens their grammar forces
        assert tokens(run_all(spec, prompts[:4], params[:4])) == {str(i): expected[str(i)] for i in range(4)}
        assert accepted(spec)[0] - before[0] > 10  # a schema's keys and punctuation: drafts the model accepts
        outputs = [expected[str(i)][0] for i in range(len(prompts))]
        # without verify buckets, drafts that do not fit in the step's S logits rows go to draft_logits
        for verify_buckets, wrong_at in itertools.product((runner._verify_buckets, frozenset()), (None, 1)):
            runner._verify_buckets = verify_buckets
            spec.proposer = OracleProposer(prompts, outputs, wrong_at=wrong_at)
            before = accepted(spec)
            assert tokens(run_all(spec, prompts, params)) == expected, (verify_buckets, wrong_at)
            after = accepted(spec)
            assert after[0] - before[0] == (after[1] - before[1] if wrong_at is None else after[0] - before[0]) > 0
    finally:
        spec.proposer = NgramProposer(spec.args.speculative_config)
        del runner.execute_model, runner._layout_drafts
        runner._verify_buckets = verify_buckets_before
    assert layouts == {True, False}, layouts
    for i in (0, 1):
        jsonschema.validate(json.loads(plain_text := spec.tokenizer.decode(expected[str(i)][0])), schema), plain_text


def test_server_flag_parses_and_a_bad_config_is_a_cli_error(capsys):
    import json

    from server.__main__ import build_parser, engine_args, main

    ns = build_parser().parse_args(["--speculative-config", json.dumps(SPEC)])
    assert engine_args(ns).speculative_config == SpeculativeConfig.from_dict(SPEC)
    assert engine_args(build_parser().parse_args([])).speculative_config is None
    assert engine_args(build_parser().parse_args([])).overlap_verification is None
    assert engine_args(build_parser().parse_args(["--no-overlap-verification"])).overlap_verification is False
    assert engine_args(build_parser().parse_args(["--overlap-verification"])).overlap_verification is True
    for bad, match in [('{"method": "ngram"}', "needs num_speculative_tokens"), ("{oops", "not valid JSON"),
                       ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
                        "prompt_lookup_min=3 must be <= prompt_lookup_max=2")]:
        with pytest.raises(SystemExit) as exit_:
            main(["--speculative-config", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --speculative-config" in err and match in err

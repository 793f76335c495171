"""The scheduler with speculative drafts: exact page ids and counts after acceptance, rejection, aborts and
preemption, and random workloads whose drafts are verified on a simulated paged KV cache."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxpaged.core.page_pool import hash_page
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.scheduler_output import SchedulerOutput
from tests.test_scheduler import EOS, VOCAB, FakeRunner, check_tables, config, make, next_token, reference_output


class SpecFakeRunner(FakeRunner):
    """FakeRunner that verifies drafts as the real runner does: the fake model's token at each fed position,
    read back THROUGH THE PAGE TABLE (drafts included), accepted while it equals the draft."""

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        self.apply(out)
        for e in out.scheduled_requests:
            pages = self.tables[e.request_id]
            assert len(pages) * self.page_size >= e.start_position + e.num_tokens
            for i, token_id in enumerate(e.token_ids):
                self.slots[self._slot(pages, e.start_position + i)] = token_id
        sampled = {}
        for e in out.scheduled_requests:
            if not e.samples:
                continue
            real_end = e.start_position + e.num_tokens - len(e.spec_token_ids)
            emitted = []
            for j in range(len(e.spec_token_ids) + 1):
                context = [self.slots[self._slot(self.tables[e.request_id], p)] for p in range(real_end + j)]
                emitted.append(next_token(context))
                if j == len(e.spec_token_ids) or emitted[-1] != e.spec_token_ids[j]:
                    break
            sampled[e.request_id] = emitted
        return sampled


def true_continuation(request: Request, n: int) -> list[int]:
    tokens = request.all_token_ids
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[request.num_tokens:]


def decode_step(sched: Scheduler, request: Request, drafts: list[int], emitted: list[int]) -> SchedulerOutput:
    request.spec_token_ids = list(drafts)
    out = sched.schedule()
    sched.update_from_output(out, {request.request_id: emitted})
    sched.check_invariants()
    return out


def prefilled(sched: Scheduler, prompt, **params) -> Request:
    request = make("a", prompt, **params)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, {"a": [100]})
    return request


def test_rejected_drafts_roll_back_computed_tokens_pages_and_hashes():
    sched = Scheduler(config(num_pages=16, page_size=4, max_num_partial_prefills=2))
    r = prefilled(sched, [1, 2, 3, 4, 5, 6], ignore_eos=True, max_tokens=20)
    assert r.page_ids == [1, 2] and r.num_computed_tokens == 6 and r.num_tokens == 7
    r.spec_token_ids = [7, 8, 9, 10]
    out = sched.schedule()
    (entry,) = out.scheduled_requests
    assert (entry.token_ids, entry.start_position, entry.spec_token_ids) == ((100, 7, 8, 9, 10), 6, (7, 8, 9, 10))
    assert entry.samples and out.num_scheduled_tokens == 5
    assert r.page_ids == [1, 2, 3] and r.num_computed_tokens == 11 and r.spec_token_ids == []
    assert sched.pool.page_hash(2) is None  # page 2 is not full of real tokens yet: drafts are never hashed
    sched.update_from_output(out, {"a": [7, 42]})  # draft 7 accepted, 8 rejected: 42 sampled instead
    sched.check_invariants()
    assert r.output_token_ids == [100, 7, 42] and r.num_computed_tokens == 8  # KV of 100 and 7 is valid
    assert r.page_ids == [1, 2] and sched.pool.free_page_ids()[-1] == 3  # page 3 (only drafts) went back
    h1 = hash_page(b"", [1, 2, 3, 4])
    assert sched.pool.page_hash(1) == h1 and sched.pool.page_hash(2) == hash_page(h1, [5, 6, 100, 7])
    assert sched.pool.page_hash(3) is None
    out = decode_step(sched, r, [1, 2, 3, 4, 5], [9])  # every draft rejected
    assert out.scheduled_requests[0].token_ids == (42, 1, 2, 3, 4, 5) and r.num_computed_tokens == 9
    assert r.output_token_ids == [100, 7, 42, 9] and r.page_ids == [1, 2, 4]  # 4 and 5 were allocated
    assert sched.pool.free_page_ids()[-2:] == [3, 5]  # 5 held drafts only; 4 holds the valid token 42
    out = decode_step(sched, r, [11, 12], [11, 12, 13])  # both accepted, then the bonus token
    assert r.output_token_ids == [100, 7, 42, 9, 11, 12, 13] and r.num_computed_tokens == 12
    assert r.page_ids == [1, 2, 4]
    sched.abort_requests("a")
    sched.check_invariants()
    assert sched.pool.num_free_pages == 15 and r.page_ids == []


def test_abort_after_scheduling_drafts_frees_every_page_and_ignores_the_result():
    sched = Scheduler(config(num_pages=16, page_size=4))
    r = prefilled(sched, [1, 2, 3, 4, 5, 6, 7], ignore_eos=True, max_tokens=20)
    r.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    assert r.page_ids == [1, 2, 3]
    sched.abort_requests("a")
    assert sched.update_from_output(out, {"a": [1, 2, 3]}) == []
    sched.check_invariants()
    assert sched.pool.num_free_pages == 15 and r.output_token_ids == [100]
    assert sched.pool.free_page_ids()[-3:] == [3, 2, 1]  # freed tail page first


def test_drafts_without_pages_are_dropped_before_anyone_is_preempted():
    # 4 usable pages of 4 slots: b holds 1 page, a holds 2 and needs a third for its drafts
    sched = Scheduler(config(num_pages=5, page_size=4, max_num_batched_tokens=64))
    a = prefilled(sched, [1] * 7, ignore_eos=True, max_tokens=8)
    b = make("b", [2, 3], ignore_eos=True, max_tokens=2)
    sched.add_request(b)
    sched.update_from_output(sched.schedule(), {"a": [5], "b": [6]})
    assert a.page_ids == [1, 2] and b.page_ids == [3] and a.num_computed_tokens == 8
    a.spec_token_ids = [1, 2, 3, 4, 5]  # needs pages up to 14 slots: 2 more; one is free
    out = sched.schedule()
    assert [e.spec_token_ids for e in out.scheduled_requests] == [(), ()]
    assert out.preempted_request_ids == () and sched.num_preemptions == 0
    assert a.page_ids == [1, 2, 4] and a.spec_token_ids == []


def test_a_preempted_request_loses_its_drafts():
    sched = Scheduler(config(num_pages=4, page_size=4, max_num_seqs=2))
    a = prefilled(sched, [1] * 4, ignore_eos=True, max_tokens=8)
    b = make("b", [2] * 4, ignore_eos=True, max_tokens=8)
    sched.add_request(b)
    sched.update_from_output(sched.schedule(), {"a": [5], "b": [6]})
    assert a.page_ids == [1, 2] and b.page_ids == [3]
    b.spec_token_ids = [9, 9]
    sched.update_from_output(sched.schedule(), {"a": [5]})  # b needs a page: preempted (the most recent)
    assert b.status.name == "PREEMPTED" and b.spec_token_ids == [] and b.page_ids == []
    sched.check_invariants()


def test_drafts_take_a_partial_prefill_slot_and_fit_the_budget():
    """Attention tiles a sequence fed several tokens like a prefill chunk and trusts max_num_partial_prefills:
    a request decodes without its drafts when no such slot is left, and drafts are cut to the budget that the
    step's decodes leave (b's decode is never crowded out by a's drafts)."""
    sched = Scheduler(config(num_pages=32, page_size=4, max_num_partial_prefills=1, max_num_batched_tokens=8))
    requests = [make(rid, [1, 2, 3], ignore_eos=True, max_tokens=20) for rid in "ab"]
    for r in requests:
        sched.add_request(r)
    a, b = requests
    sched.update_from_output(sched.schedule(), {"a": [4]})  # b's prompt waits: a's took the one slot
    sched.update_from_output(sched.schedule(), {"a": [4], "b": [4]})
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in requests)
    a.spec_token_ids, b.spec_token_ids = [5, 6, 7, 8, 9], [5, 6]
    out = sched.schedule()
    assert [e.spec_token_ids for e in out.scheduled_requests] == [(5, 6, 7, 8, 9), ()]  # b: no slot left
    assert out.num_scheduled_tokens == 7 and b.spec_token_ids == []
    sched.update_from_output(out, {"a": [5, 6, 77], "b": [7]})
    sched.check_invariants()
    a.spec_token_ids = list(range(10, 18))
    out = sched.schedule()
    assert [e.token_ids for e in out.scheduled_requests] == [(77,) + tuple(range(10, 16)), (7,)]  # cut to 8 - 2
    assert out.num_scheduled_tokens == 8 and a.num_computed_tokens == a.num_tokens + 6


def test_drafts_never_delay_a_prompt():
    """Prefill chunks come before drafts: a waiting prompt gets the one partial-prefill slot and its budget
    (the decode with drafts goes without them), and a running request's next prefill chunk as well."""
    sched = Scheduler(config(num_pages=32, page_size=4, max_num_partial_prefills=1, max_num_batched_tokens=16))
    a = prefilled(sched, [1, 2, 3, 4, 5], ignore_eos=True, max_tokens=20)
    assert a.page_ids == [1, 2] and a.num_computed_tokens == 5
    b = make("b", list(range(20, 40)), ignore_eos=True, max_tokens=4)  # 20 tokens: chunks of 15, then 5
    sched.add_request(b)
    a.spec_token_ids = [6, 7, 8]
    out = sched.schedule()
    assert [(e.request_id, e.num_tokens, e.spec_token_ids) for e in out.scheduled_requests] == \
        [("a", 1, ()), ("b", 15, ())]
    assert a.page_ids == [1, 2] and b.page_ids == [3, 4, 5, 6] and a.num_computed_tokens == 6
    sched.update_from_output(out, {"a": [6]})
    sched.check_invariants()
    a.spec_token_ids = [7, 8, 9]
    out = sched.schedule()  # b's last chunk (5 tokens) takes the slot again; a decodes alone
    assert [(e.request_id, e.num_tokens, e.spec_token_ids) for e in out.scheduled_requests] == \
        [("a", 1, ()), ("b", 5, ())]
    sched.update_from_output(out, {"a": [7], "b": [50]})
    sched.check_invariants()
    a.spec_token_ids, b.spec_token_ids = [8, 9, 10], [51]
    out = sched.schedule()  # no prompt left: a's drafts take the slot, b decodes without its own
    assert [(e.request_id, e.token_ids, e.spec_token_ids) for e in out.scheduled_requests] == \
        [("a", (7, 8, 9, 10), (8, 9, 10)), ("b", (50,), ())]
    assert b.page_ids == [3, 4, 5, 6, 7, 8] and a.page_ids == [1, 2, 9]  # b's decode took its page first
    assert a.num_computed_tokens == 11 and out.num_scheduled_tokens == 5
    sched.update_from_output(out, {"a": [8, 9, 10, 11], "b": [52]})
    sched.check_invariants()
    assert a.output_token_ids == [100, 6, 7, 8, 9, 10, 11] and a.num_computed_tokens == 11


def test_beside_a_request_without_drafts_drafts_only_fill_the_bucket_padding():
    """With the runner's T buckets known, a step that carries a request without drafts takes drafts only into
    the rows its bucket pads anyway (that request's step costs what it would without speculation); a step of
    decodes that all have drafts takes them all."""
    sched = Scheduler(config(num_pages=64, page_size=4, token_buckets=(1, 2, 4, 8, 16, 32, 64)))
    requests = [make(rid, [1, 2, 3], ignore_eos=True, max_tokens=30) for rid in "abc"]
    for r in requests:
        sched.add_request(r)
    a, b, c = requests
    sched.update_from_output(sched.schedule(), {rid: [4] for rid in "abc"})

    def drafts_of(out):
        return {e.request_id: e.spec_token_ids for e in out.scheduled_requests}

    a.spec_token_ids, c.spec_token_ids = [5, 6, 7], [5, 6]  # b has none: 3 tokens, bucket 4, 1 padded row
    out = sched.schedule()
    assert drafts_of(out) == {"a": (5,), "b": (), "c": ()} and out.num_scheduled_tokens == 4
    assert a.num_computed_tokens == 5 and c.num_computed_tokens == 4
    sched.update_from_output(out, {"a": [5, 6], "b": [9], "c": [9]})
    sched.check_invariants()
    a.spec_token_ids, b.spec_token_ids, c.spec_token_ids = [1, 2, 3], [1, 2], [1]  # all draft: no cap
    out = sched.schedule()
    assert drafts_of(out) == {"a": (1, 2, 3), "b": (1, 2), "c": (1,)} and out.num_scheduled_tokens == 9
    sched.update_from_output(out, {"a": [7], "b": [1, 7], "c": [7]})
    sched.check_invariants()
    d = make("d", [1] * 9, ignore_eos=True, max_tokens=4)  # a prefill chunk of 9 beside 3 decodes: bucket 16
    sched.add_request(d)
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4, 5], [1, 2, 3]
    out = sched.schedule()
    assert drafts_of(out) == {"a": (1, 2, 3, 4), "b": (), "c": (), "d": ()} and out.num_scheduled_tokens == 16


def test_when_some_drafts_cannot_fit_the_others_only_fill_the_bucket_padding():
    """Every decode has drafts, but not all can be verified (2 partial-prefill slots for 3; then a budget
    that cannot hold them all): the ones left without are requests without drafts, so the drafts that go
    only fill the bucket's padding."""
    sched = Scheduler(config(num_pages=64, page_size=4, max_num_partial_prefills=2, max_num_batched_tokens=12,
                             token_buckets=(1, 2, 4, 8, 12)))
    requests = [make(rid, [1, 2, 3], ignore_eos=True, max_tokens=30) for rid in "abc"]
    for r in requests:
        sched.add_request(r)
    sched.update_from_output(sched.schedule(), {"a": [4], "b": [4]})
    sched.update_from_output(sched.schedule(), {"a": [5], "b": [5], "c": [4]})
    a, b, c = requests
    a.spec_token_ids, b.spec_token_ids, c.spec_token_ids = [6, 7], [6, 7], [5, 6]  # 3 slots needed, 2 free
    out = sched.schedule()
    assert [e.spec_token_ids for e in out.scheduled_requests] == [(6,), (), ()]  # 3 tokens, bucket 4
    sched.update_from_output(out, {"a": [6, 7], "b": [6], "c": [5]})
    sched.check_invariants()
    sched = Scheduler(config(num_pages=64, page_size=4, max_num_batched_tokens=8, token_buckets=(1, 2, 4, 8)))
    requests = [make(rid, [1, 2, 3], ignore_eos=True, max_tokens=30) for rid in "ab"]
    for r in requests:
        sched.add_request(r)
    sched.update_from_output(sched.schedule(), {"a": [4], "b": [4]})
    a, b = requests
    a.spec_token_ids, b.spec_token_ids = [5, 6, 7, 8], [5, 6, 7]  # 2 + 7 tokens: over the budget of 8
    out = sched.schedule()
    assert [e.spec_token_ids for e in out.scheduled_requests] == [(), ()]  # 2 tokens fill bucket 2
    sched.update_from_output(out, {"a": [5], "b": [5]})
    a.spec_token_ids, b.spec_token_ids = [6, 7, 8], [6, 7, 8]  # 2 + 6 fit: both verify
    out = sched.schedule()
    assert [e.spec_token_ids for e in out.scheduled_requests] == [(6, 7, 8), (6, 7, 8)]
    assert out.num_scheduled_tokens == 8


def test_memory_bound_tokens_let_drafts_grow_a_step_up_to_them():
    """Where steps up to memory_bound_tokens cost about the same (a GPU), drafts beside a request without drafts
    may fill the step up to that size, not only its bucket's padding."""
    sched = Scheduler(config(num_pages=64, page_size=4, token_buckets=(1, 2, 4, 8, 16), memory_bound_tokens=8))
    requests = [make(rid, [1, 2, 3], ignore_eos=True, max_tokens=30) for rid in "ab"]
    for r in requests:
        sched.add_request(r)
    a, b = requests
    sched.update_from_output(sched.schedule(), {"a": [4], "b": [4]})
    a.spec_token_ids = list(range(10, 20))  # beside b's plain decode: 2 tokens, room up to 8
    out = sched.schedule()
    assert [e.spec_token_ids for e in out.scheduled_requests] == [tuple(range(10, 16)), ()]
    assert out.num_scheduled_tokens == 8


def test_token_buckets_must_increase():
    for bad in ((4, 2), (0, 1), (1, 1), [1, 2], (1, True)):
        with pytest.raises(ValueError, match="token_buckets"):
            config(token_buckets=bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="memory_bound_tokens"):
            config(memory_bound_tokens=bad)


@pytest.mark.parametrize("tokens, match", [([1, 2, 3], "3 tokens"), ([], "no sampled token")])
def test_more_tokens_than_drafts_allow_is_an_error(tokens, match):
    sched = Scheduler(config())
    r = prefilled(sched, [1, 2, 3], ignore_eos=True, max_tokens=20)
    r.spec_token_ids = [1]
    out = sched.schedule()
    with pytest.raises(ValueError, match=match):
        sched.update_from_output(out, {"a": tokens})


def test_stop_inside_accepted_drafts_finishes_there():
    sched = Scheduler(config(num_pages=16, page_size=4))
    r = prefilled(sched, [1, 2, 3], max_tokens=20, stop_token_ids=[9])
    r.spec_token_ids = [5, 9, 7]
    out = sched.schedule()
    finished = sched.update_from_output(out, {"a": [5, 9, 7, 8]})  # the token after the stop is dropped
    assert finished == [r] and r.output_token_ids == [100, 5, 9] and r.stop_reason == 9
    sched.check_invariants()
    assert sched.pool.num_free_pages == 15


# ---- randomized workloads with drafts -----------------------------------------------


@st.composite
def spec_workloads(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 5))
    specs = []
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        max_tokens = draw(st.integers(1, 20))
        params = SamplingParams(max_tokens=max_tokens, min_tokens=draw(st.integers(0, min(2, max_tokens))),
                                ignore_eos=draw(st.booleans()),
                                stop_token_ids=draw(st.lists(st.integers(1, VOCAB - 1), max_size=2)))
        specs.append((f"q{i}", prompt, params, draw(st.integers(0, 3)), draw(st.none() | st.integers(0, 30))))
    most_slots = max(len(p) + s.max_tokens - 1 for _, p, s, _, _ in specs)
    cfg = SchedulerConfig(num_pages=1 + -(-most_slots // page_size) + draw(st.integers(0, 6)), page_size=page_size,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=draw(st.integers(max_num_seqs, 32)),
                          max_model_len=64, enable_prefix_caching=draw(st.booleans()),
                          max_num_partial_prefills=draw(st.sampled_from([None, 1, 2])),
                          token_buckets=draw(st.sampled_from([(), (1, 2, 4, 8, 16, 32), (4, 16, 64)])),
                          memory_bound_tokens=draw(st.sampled_from([0, 0, 8])))
    return cfg, specs, draw(st.integers(0, 2**32 - 1))


def propose(request: Request, rng: random.Random, max_model_len: int) -> list[int]:
    """Drafts as a proposer might make them: some leading ones right, then wrong ones, within the bounds."""
    room = min(request.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens - 1)
    num_drafts = min(rng.randint(0, 5), room)
    if num_drafts <= 0:
        return []
    right = true_continuation(request, num_drafts)
    num_right = rng.randint(0, num_drafts)
    return right[:num_right] + [rng.randrange(VOCAB) for _ in range(num_drafts - num_right)]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_workloads())
def test_random_workloads_with_drafts_finish_with_reference_outputs(workload):
    cfg, specs, seed = workload
    rng = random.Random(seed)
    sched, runner = Scheduler(cfg), SpecFakeRunner(cfg)
    requests = {rid: Request(rid, prompt, params, eos_token_ids=(EOS,)) for rid, prompt, params, _, _ in specs}
    num_accepted = 0
    for t in range(2000):
        for rid, _, _, arrival, abort_at in specs:
            if arrival == t:
                sched.add_request(requests[rid])
            if abort_at == t:
                sched.abort_requests(rid)
        if not sched.has_unfinished_requests():
            if t > 3:
                break
            continue
        for r in sched.decoding_requests():
            r.spec_token_ids = propose(r, rng, cfg.max_model_len)
        out = sched.schedule()
        sampled = runner.execute(out)
        check_tables(sched, runner, out)
        num_accepted += sum(len(sampled[e.request_id]) - 1 for e in out.scheduled_requests if e.samples)
        sched.update_from_output(out, sampled)
        sched.check_invariants()
        assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
        partial = sum(e.num_tokens > 1 for e in out.scheduled_requests)
        assert partial <= (cfg.max_num_partial_prefills or partial)
    else:
        pytest.fail("workload did not finish")
    for r in requests.values():
        expected = reference_output(r.prompt_token_ids, r.sampling_params, cfg.max_model_len)
        assert r.output_token_ids == (expected[:r.num_output_tokens] if r.finish_reason == "abort" else expected)
    event(f"accepted drafts: {min(num_accepted, 5)}+")
    event(f"preemptions: {min(sched.num_preemptions, 2)}+")
    assert sched.pool.num_free_pages == cfg.num_pages - 1


def test_a_step_after_a_verification_in_flight_is_rolled_back_when_its_outcome_arrives():
    """Async scheduling: step 2 is scheduled while step 1's verification is in flight, as if its 4 drafts were
    all accepted (its token a placeholder, at position 11; its own drafts after it). Step 1 then accepts 1:
    num_computed_tokens drops by the 3 rejected (step 2's tokens are moved back on the device) and the pages past
    step 2's real end go back; step 2's outcome then rolls back its own rejected draft. Exact page ids."""
    sched = Scheduler(config(num_pages=16, page_size=4, max_num_partial_prefills=2, async_scheduling=True))
    r = prefilled_async(sched, [1, 2, 3, 4, 5, 6])
    r.spec_token_ids = [7, 8, 9, 10]
    first = sched.schedule()
    assert first.scheduled_requests[0].token_ids == (100, 7, 8, 9, 10) and r.num_computed_tokens == 11
    assert (r.num_output_placeholders, r.num_draft_placeholders) == (1, 4)
    r.spec_token_ids = [11, 12]  # proposed on the guess that step 1 emits 7, 8, 9, 10 and then 11
    second = sched.schedule()
    (entry,) = second.scheduled_requests
    assert entry.placeholder and entry.token_ids == (-1, 11, 12) and entry.start_position == 11
    assert entry.spec_token_ids == (11, 12) and entry.num_output_tokens == 6  # output #6 if all were accepted
    assert r.page_ids == [1, 2, 3, 4] and r.num_computed_tokens == 14
    assert (r.num_output_placeholders, r.num_draft_placeholders) == (2, 6)
    sched.update_from_output(first, {"a": [7, 42]})  # 7 accepted, 8 rejected: 42; step 2 fed 42 at 8, 11 at 9 ...
    sched.check_invariants()
    assert r.output_token_ids == [100, 7, 42] and r.num_computed_tokens == 11  # 8 + step 2's 3
    assert r.page_ids == [1, 2, 3] and sched.pool.free_page_ids()[-1] == 4
    assert (r.num_output_placeholders, r.num_draft_placeholders) == (1, 2)
    sched.update_from_output(second, {"a": [11, 5]})  # 11 accepted, 12 rejected
    sched.check_invariants()
    assert r.output_token_ids == [100, 7, 42, 11, 5] and r.num_computed_tokens == 10  # 100 .. 11 computed
    assert r.page_ids == [1, 2, 3] and (r.num_output_placeholders, r.num_draft_placeholders) == (0, 0)
    assert sched.pool.page_hash(2) is not None and sched.pool.page_hash(3) is None  # 5..8 full of real tokens


def test_a_request_preempted_with_a_verification_in_flight_waits_for_it_then_recomputes():
    """Async scheduling: the step after a verification in flight needs a page the pool has not got (drafts
    never preempt anyone, a token does): the request preempts itself, and is readmitted only once that
    verification's tokens have arrived (nothing is rolled back then: it holds no pages)."""
    sched = Scheduler(config(num_pages=4, page_size=4, max_num_partial_prefills=2, async_scheduling=True))
    r = prefilled_async(sched, [1, 2, 3, 4, 5, 6], max_tokens=6)  # admitted: 12 tokens fit the 3 pages
    r.spec_token_ids = [7, 8, 9, 10, 11]
    first = sched.schedule()
    assert r.page_ids == [1, 2, 3] and r.num_computed_tokens == 12
    r.spec_token_ids = [9, 10]
    second = sched.schedule()  # its placeholder at position 12 needs a 4th page
    assert second.preempted_request_ids == ("a",) and not second.scheduled_requests
    assert r.page_ids == [] and r.num_computed_tokens == 0 and sched.pool.num_free_pages == 3
    assert not sched.schedule().scheduled_requests  # waits for its tokens in flight
    sched.update_from_output(first, {"a": [7, 8, 13]})  # 2 accepted: appended, nothing rolled back
    sched.check_invariants()
    assert r.output_token_ids == [100, 7, 8, 13] and r.num_computed_tokens == 0
    assert (r.num_output_placeholders, r.num_draft_placeholders) == (0, 0)
    (entry,) = sched.schedule().scheduled_requests  # its recompute: every token it has (page 1 from the cache)
    assert (entry.start_position, entry.token_ids) == (4, (5, 6, 100, 7, 8, 13)) and entry.samples
    assert r.page_ids == [1, 3, 2]  # page 1 from the cache, then 3 and 2 in the order the preemption freed them


def prefilled_async(sched: Scheduler, prompt, max_tokens=20) -> Request:
    request = make("a", prompt, ignore_eos=True, max_tokens=max_tokens)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, {"a": [100]})
    assert request.num_output_placeholders == 0 and request.num_computed_tokens == 6
    return request


def test_stops_are_decided_once_a_given_verdict_is_the_last_tokens():
    """The engine decides each token's stop (OutputProcessor._emit cuts a step's tokens at the first that stops) and
    passes the last one's verdict: the scheduler appends the tokens before it as they are and checks nothing again.
    Without verdicts (a caller that has no engine) it checks each token itself and stops at the first EOS."""
    runs = {}
    for verdicts_given in (False, True):
        sched = Scheduler(config(num_pages=16, page_size=4))
        r = prefilled(sched, [1, 2, 3, 4, 5, 6], max_tokens=20)
        r.spec_token_ids = [EOS, 8]
        out = sched.schedule()
        stops = {"a": None} if verdicts_given else None
        sched.update_from_output(out, {"a": [EOS, 8, 9]}, stops)  # drafts EOS and 8 accepted, 9 the bonus
        sched.check_invariants()
        runs[verdicts_given] = (r.output_token_ids, r.finish_reason)
    assert runs[False] == ([100, EOS], "stop")  # checked here: the EOS ends it
    assert runs[True] == ([100, EOS, 8, 9], None)  # the caller's word: all three go on
    # a FINISHED_ERROR verdict on the last token: the ones before it are kept, the garbage one is not
    sched = Scheduler(config(num_pages=16, page_size=4))
    r = prefilled(sched, [1, 2, 3, 4, 5, 6], max_tokens=20)
    r.spec_token_ids = [7, 8]
    out = sched.schedule()
    sched.update_from_output(out, {"a": [7, 8, 31]}, {"a": (RequestStatus.FINISHED_ERROR, None)})
    assert r.output_token_ids == [100, 7, 8] and r.finish_reason == "error"
    sched.check_invariants()

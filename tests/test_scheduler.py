import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.core.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig

VOCAB = 32
EOS = 0


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of every previous token."""
    acc = len(context)
    for i, t in enumerate(context):
        acc = (acc * 1000003 + (i + 1) * (t + 7)) % 2147483647
    return acc % VOCAB


class FakeRunner:
    """Executes a SchedulerOutput on a simulated paged KV cache.

    Each scheduled token is written to the slot its page table gives; sampling
    reads the whole context back THROUGH THE PAGE TABLE, so a wrong page id,
    a bad prefix-cache hit or a lost token changes the sampled tokens.
    All writes of a step happen before any read (the runner contract).
    """

    def __init__(self, config: SchedulerConfig):
        self.page_size = config.page_size
        self.slots: list[int | None] = [None] * (config.num_pages * config.page_size)
        self.fed: dict[str, list[tuple[int, tuple[int, ...]]]] = {}  # id -> [(start, token_ids)]
        self.tables: dict[str, list[int]] = {}  # id -> its page table, kept from the entries' diffs as the runner does

    def apply(self, out: SchedulerOutput) -> None:
        """Keep each entry's page table from its diff (its first page_ids_from pages kept, then page_ids), forgetting
        the requests the output names finished or preempted."""
        for rid in out.finished_request_ids + out.preempted_request_ids:
            self.tables.pop(rid, None)
        for e in out.scheduled_requests:
            kept = self.tables.get(e.request_id, []) if e.page_ids_from else []
            assert e.page_ids_from <= len(kept), f"{e.request_id}: a diff past the pages kept"
            self.tables[e.request_id] = kept[:e.page_ids_from] + list(e.page_ids)

    def _slot(self, page_ids, pos: int) -> int:
        page_id = page_ids[pos // self.page_size]
        assert page_id != 0, "the null page was handed to a request"
        return page_id * self.page_size + pos % self.page_size

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        self.apply(out)
        for e in out.scheduled_requests:
            pages = self.tables[e.request_id]
            assert len(pages) * self.page_size >= e.start_position + e.num_tokens
            self.fed.setdefault(e.request_id, []).append((e.start_position, e.token_ids))
            for i, token_id in enumerate(e.token_ids):
                self.slots[self._slot(pages, e.start_position + i)] = token_id
        sampled = {}
        for e in out.scheduled_requests:
            if e.samples:
                end = e.start_position + e.num_tokens
                context = [self.slots[self._slot(self.tables[e.request_id], p)] for p in range(end)]
                sampled[e.request_id] = [next_token(context)]
        return sampled


def reference_output(prompt, params: SamplingParams, max_model_len: int) -> list[int]:
    r = Request("ref", list(prompt), params, eos_token_ids=(EOS,), max_model_len=max_model_len)
    while not r.append_output_token(next_token(r.all_token_ids)):
        pass
    return r.output_token_ids

def assert_reference_outputs(requests, max_model_len: int) -> None:
    """Every request finished with its reference output (an aborted one with a prefix of it)."""
    for r in requests:
        assert r.is_finished
        expected = reference_output(r.prompt_token_ids, r.sampling_params, max_model_len)
        if r.finish_reason == "abort":
            assert r.output_token_ids == expected[: r.num_output_tokens]
        else:
            assert r.output_token_ids == expected



def make(rid: str, prompt, **params) -> Request:
    return Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=(EOS,), arrival_time=0.0)


def config(**kwargs) -> SchedulerConfig:
    defaults = dict(num_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    defaults.update(kwargs)
    return SchedulerConfig(**defaults)


def check_tables(sched: Scheduler, runner: FakeRunner, out: SchedulerOutput) -> None:
    """The page tables the runner keeps from the output's diffs are the scheduled requests' own."""
    for e in out.scheduled_requests:
        assert runner.tables[e.request_id] == sched.get_request(e.request_id).page_ids, e.request_id


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    sampled = runner.execute(out)
    check_tables(sched, runner, out)
    finished = sched.update_from_output(out, sampled)
    sched.check_invariants()
    return out, finished


def shape(out: SchedulerOutput):
    return [(e.request_id, e.start_position, e.num_tokens, e.samples) for e in out.scheduled_requests]


def pages_sent(out: SchedulerOutput):
    """Each entry's page-table diff: (id, the pages the runner keeps from earlier entries, the pages after them)."""
    return [(e.request_id, e.page_ids_from, e.page_ids) for e in out.scheduled_requests]


# ---- config and admission ---------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_pages=1), "num_pages"),
        (dict(page_size=0), "page_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(enable_prefix_caching=1), "enable_prefix_caching"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
        (dict(max_num_partial_prefills=0), "max_num_partial_prefills"),
        (dict(max_num_partial_prefills=True), "max_num_partial_prefills"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(**kwargs)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        config().page_size = 8


def test_admission_rejections():
    sched = Scheduler(config(num_pages=5, page_size=4, max_model_len=32))  # 4 usable pages = 16 slots
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make("e", []))
    with pytest.raises(ValueError, match="exceeds max_model_len=32"):
        sched.add_request(make("long", range(30), max_tokens=3))
    with pytest.raises(ValueError, match="exceeds max_model_len=32"):
        sched.add_request(make("none", range(32), max_tokens=None))
    big = make("big", range(10), max_tokens=8)
    with pytest.raises(ValueError, match="needs up to 5 KV pages but the pool has 4"):
        sched.add_request(big)
    assert big.max_model_len is None and big.status is RequestStatus.WAITING
    sched.add_request(make("fits", range(10), max_tokens=7))  # 16 slots: the last token is never fed
    with pytest.raises(ValueError, match="already queued"):
        sched.add_request(make("fits", range(3)))
    running = make("x", range(3))
    running.status = RequestStatus.RUNNING
    with pytest.raises(ValueError, match="not fresh"):
        sched.add_request(running)
    assert sched.num_waiting == 1
    none = make("cap", range(10), max_tokens=None)
    Scheduler(config(max_model_len=16)).add_request(none)
    assert none.max_tokens == 6


# ---- chunked prefill, ordering, caps --------------------------------------------


def test_chunked_prefill_with_a_small_budget():
    cfg = config(max_num_seqs=1, max_num_batched_tokens=4, page_size=4, enable_prefix_caching=False)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    r = make("a", range(10, 20), max_tokens=3, ignore_eos=True)
    sched.add_request(r)
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 0, 4, False)]
    assert out.scheduled_requests[0].token_ids == (10, 11, 12, 13)
    assert out.scheduled_requests[0].page_ids == (1,)
    assert out.num_scheduled_tokens == 4 and r.num_computed_tokens == 4 and r.output_token_ids == []
    out, _ = step(sched, runner)
    # the page table as a diff: page 1 went with the first chunk, page 2 is new
    assert shape(out) == [("a", 4, 4, False)] and pages_sent(out) == [("a", 1, (2,))]
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 8, 2, True)] and pages_sent(out) == [("a", 2, (3,))]
    assert runner.tables == {"a": [1, 2, 3]}
    assert out.scheduled_requests[0].token_ids == (18, 19)
    assert r.num_output_tokens == 1
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 10, 1, True)]
    assert out.scheduled_requests[0].token_ids == (r.output_token_ids[0],)
    out, finished = step(sched, runner)
    assert shape(out) == [("a", 11, 1, True)] and finished == [r]
    assert r.output_token_ids == reference_output(range(10, 20), r.sampling_params, 128)
    assert not sched.has_unfinished_requests() and sched.pool.num_free_pages == cfg.num_pages - 1


def test_long_prefill_token_threshold_caps_a_chunk():
    cfg = config(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make("a", range(12), max_tokens=2))
    sched.add_request(make("b", range(50, 53), max_tokens=2))
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 0, 5, False), ("b", 0, 3, True)]
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 5, 5, False), ("b", 3, 1, True)]


def test_decodes_before_new_prefills():
    cfg = config(max_num_batched_tokens=8)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make("dec", range(3), max_tokens=10, ignore_eos=True))
    out, _ = step(sched, runner)
    assert shape(out) == [("dec", 0, 3, True)]
    sched.add_request(make("pre", range(100, 120), max_tokens=1))
    out, _ = step(sched, runner)
    assert shape(out) == [("dec", 3, 1, True), ("pre", 0, 7, False)]
    out, _ = step(sched, runner)
    # "pre" is now running and was admitted after "dec": running order is admission order.
    assert shape(out) == [("dec", 4, 1, True), ("pre", 7, 7, False)]


def test_max_num_partial_prefills_caps_multi_token_chunks_per_step():
    cfg = config(max_num_batched_tokens=64, max_num_partial_prefills=2, long_prefill_token_threshold=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make("a", range(10, 16), max_tokens=3, ignore_eos=True))  # 6-token prompt
    sched.add_request(make("b", range(20, 21), max_tokens=3, ignore_eos=True))  # 1 token: not a "partial"
    sched.add_request(make("c", range(30, 33), max_tokens=3, ignore_eos=True))
    sched.add_request(make("d", range(40, 43), max_tokens=3, ignore_eos=True))
    out, _ = step(sched, runner)
    # a and c take both slots; b's single token is free; d waits (FCFS: the queue stops at d).
    assert shape(out) == [("a", 0, 4, False), ("b", 0, 1, True), ("c", 0, 3, True)]
    assert [r.request_id for r in sched.waiting] == ["d"]
    out, _ = step(sched, runner)
    # a's second chunk and d fill the two slots; b and c decode.
    assert shape(out) == [("a", 4, 2, True), ("b", 1, 1, True), ("c", 3, 1, True), ("d", 0, 3, True)]
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 6, 1, True), ("b", 2, 1, True), ("c", 4, 1, True), ("d", 3, 1, True)]


def test_a_running_prefill_over_the_cap_waits_a_step():
    cfg = config(max_num_batched_tokens=64, max_num_partial_prefills=2, long_prefill_token_threshold=2)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make("a", range(10, 16), max_tokens=2, ignore_eos=True))
    sched.add_request(make("b", range(20, 26), max_tokens=2, ignore_eos=True))
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 0, 2, False), ("b", 0, 2, False)]
    sched.config = dataclasses.replace(cfg, max_num_partial_prefills=1)  # two running prefills, one slot
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 2, 2, False)]  # b keeps its pages and waits
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 4, 2, True)]
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 6, 1, True), ("b", 2, 2, False)]
    assert sched.get_request("a") is None and sched.get_request("b").page_ids == [2]  # a finished


def test_max_num_seqs_caps_running_requests():
    cfg = config(max_num_seqs=2, max_num_batched_tokens=64)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    for rid, n in (("a", 1), ("b", 3), ("c", 3)):
        sched.add_request(make(rid, range(10, 14), max_tokens=n, ignore_eos=True))
    out, _ = step(sched, runner)
    assert [e.request_id for e in out.scheduled_requests] == ["a", "b"]
    assert (sched.num_running, sched.num_waiting) == (1, 1)  # "a" finished after 1 token
    out, _ = step(sched, runner)
    assert shape(out) == [("b", 4, 1, True), ("c", 0, 4, True)]
    assert out.finished_request_ids == ("a",)


def test_waiting_head_without_pages_blocks_the_queue_fcfs():
    cfg = config(num_pages=6, page_size=2, enable_prefix_caching=False)  # 5 usable pages
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    R = make("R", range(1, 6), max_tokens=2, ignore_eos=True)
    sched.add_request(R)
    out = sched.schedule()
    assert R.num_computed_tokens == 5 and R.page_ids == [1, 2, 3]  # advanced at schedule time
    sched.update_from_output(out, runner.execute(out))
    W, S = make("W", range(10, 16), max_tokens=1), make("S", [20, 21], max_tokens=1)
    sched.add_request(W)
    sched.add_request(S)
    out, _ = step(sched, runner)  # W needs 3 pages, 2 are free; S would fit but must not overtake
    assert shape(out) == [("R", 5, 1, True)]
    out, _ = step(sched, runner)
    assert shape(out) == [("W", 0, 6, True), ("S", 0, 2, True)]
    assert out.finished_request_ids == ("R",)


# ---- preemption ------------------------------------------------------------------


def test_preemption_takes_the_most_recently_admitted_and_recomputes_it():
    # 6 usable pages of 2 slots; three 4-token prompts fill them exactly.
    cfg = config(num_pages=7, page_size=2, max_num_seqs=4, enable_prefix_caching=False)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    reqs = {rid: make(rid, prompt, max_tokens=3, ignore_eos=True) for rid, prompt in
            (("A", [1, 2, 3, 4]), ("B", [5, 6, 7, 8]), ("C", [9, 10, 11, 12]))}
    for r in reqs.values():
        sched.add_request(r)
    A, B, C = reqs.values()
    out, _ = step(sched, runner)
    assert [e.page_ids for e in out.scheduled_requests] == [(1, 2), (3, 4), (5, 6)]
    assert sched.pool.num_free_pages == 0

    out, _ = step(sched, runner)  # A and B each need a 3rd page: C goes
    assert out.preempted_request_ids == ("C",)
    assert pages_sent(out) == [("A", 2, (6,)), ("B", 2, (5,))] and runner.tables == {"A": [1, 2, 6], "B": [3, 4, 5]}
    assert C.status is RequestStatus.PREEMPTED and C.page_ids == [] and C.num_computed_tokens == 0
    assert list(sched.waiting) == [C] and sched.running == [A, B]
    assert C.num_output_tokens == 1 and C.num_preemptions == 1 and sched.num_preemptions == 1
    c_tokens = C.all_token_ids

    out, finished = step(sched, runner)  # no free page for C: it waits; A and B finish
    assert [e.request_id for e in out.scheduled_requests] == ["A", "B"] and finished == [A, B]
    assert sched.pool.free_page_ids() == [6, 2, 1, 5, 4, 3]

    out, _ = step(sched, runner)  # C recomputes its prompt AND its kept output from position 0
    assert shape(out) == [("C", 0, 5, True)]
    assert out.scheduled_requests[0].token_ids == tuple(c_tokens)
    assert out.scheduled_requests[0].page_ids == (6, 2, 1)
    while sched.has_unfinished_requests():
        step(sched, runner)
    for r in (A, B, C):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params, 128)
    assert sched.pool.num_free_pages == 6


def test_a_request_that_is_the_lowest_priority_preempts_itself():
    cfg = config(num_pages=6, page_size=2, enable_prefix_caching=False)  # 5 usable pages
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    A, B = make("A", [1, 2, 3, 4], max_tokens=4), make("B", [5, 6, 7, 8], max_tokens=4)
    sched.add_request(A)
    sched.add_request(B)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ("B",)
    assert pages_sent(out) == [("A", 2, (5,))] and runner.tables == {"A": [1, 2, 5]}
    assert list(sched.waiting) == [B] and B.page_ids == []


def test_preempted_request_resumes_from_its_own_cached_pages():
    cfg = config(num_pages=7, page_size=2, max_num_seqs=4, enable_prefix_caching=True)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    prompts = (("A", [1, 2, 3, 4]), ("B", [5, 6, 7, 8]), ("C", [9, 10, 11, 12]))
    A, B, C = (make(rid, p, max_tokens=3, ignore_eos=True) for rid, p in prompts)
    for r in (A, B, C):
        sched.add_request(r)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ("C",)  # C's pages 6, 5 were evicted by A and B
    step(sched, runner)
    out, _ = step(sched, runner)
    assert shape(out) == [("C", 0, 5, True)]  # its cached pages were evicted: nothing to reuse
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert C.output_token_ids == reference_output(C.prompt_token_ids, C.sampling_params, 128)
    assert C.num_cached_tokens == 0  # the hit count of the FIRST admission


# ---- abort / finish -------------------------------------------------------------


def test_abort_mid_prefill_frees_all_pages():
    cfg = config(max_num_batched_tokens=8)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    r = make("a", range(20), max_tokens=4)
    sched.add_request(r)
    step(sched, runner)
    assert r.page_ids == [1, 2] and r.num_computed_tokens == 8
    assert sched.abort_requests(["a", "unknown"]) == [r]
    assert (r.status, r.finish_reason, r.page_ids) == (RequestStatus.FINISHED_ABORTED, "abort", [])
    assert sched.pool.num_free_pages == cfg.num_pages - 1 and not sched.has_unfinished_requests()
    assert sched.abort_requests("a") == []
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == ("a",)
    assert sched.schedule().finished_request_ids == ()
    sched.check_invariants()


def test_abort_mid_decode_frees_all_pages_and_ignores_the_in_flight_token():
    cfg = config()
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    a, b = make("a", range(6), max_tokens=8, ignore_eos=True), make("b", range(6), max_tokens=8, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    step(sched, runner)
    assert a.page_ids == [1, 2] and b.page_ids == [1, 3]
    out = sched.schedule()
    sampled = runner.execute(out)
    assert sched.abort_requests(["a"]) == [a]
    assert sched.update_from_output(out, sampled) == []
    assert a.num_output_tokens == 2 and b.num_output_tokens == 3
    assert sched.pool.ref_count(1) == 1 and sched.pool.ref_count(2) == 0
    sched.check_invariants()
    assert sched.abort_requests(["b"]) == [b]
    assert sched.pool.num_free_pages == cfg.num_pages - 1
    sched.check_invariants()


def test_abort_waiting_request():
    cfg = config(max_num_seqs=1, max_num_batched_tokens=1)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make("a", range(3)))
    sched.add_request(make("b", range(3)))
    step(sched, runner)
    assert [r.request_id for r in sched.abort_requests(["b"])] == ["b"]
    assert sched.num_waiting == 0 and sched.num_running == 1
    sched.check_invariants()


def test_finish_requests_for_a_stop_string():
    cfg = config()
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    r = make("a", range(6), max_tokens=8, ignore_eos=True)
    sched.add_request(r)
    step(sched, runner)
    assert sched.finish_requests("a", "stop", stop_reason="###") == [r]
    assert (r.status, r.finish_reason, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, "stop", "###")
    assert sched.pool.num_free_pages == cfg.num_pages - 1
    with pytest.raises(ValueError, match="unknown finish_reason"):
        sched.finish_requests("a", "done")


def test_missing_sampled_token_is_an_error():
    cfg = config()
    sched = Scheduler(cfg)
    sched.add_request(make("a", range(3)))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token for request 'a'"):
        sched.update_from_output(out, {})


# ---- prefix sharing ---------------------------------------------------------------


def test_eight_requests_share_a_200_token_prefix():
    cfg = config(num_pages=129, page_size=16, max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=512)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    prefix = [(7 * i) % 31 + 1 for i in range(200)]  # 12 full pages + 8 tokens
    reqs = [make(f"r{i}", prefix + [100 + i] * 10, max_tokens=1) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [e.start_position for e in out.scheduled_requests] == [0] + [192] * 7
    assert out.num_scheduled_tokens == 210 + 7 * 18
    shared = list(range(1, 13))
    assert reqs[0].page_ids == shared + [13, 14]
    for i, r in enumerate(reqs[1:], start=1):
        assert r.page_ids == shared + [13 + 2 * i, 14 + 2 * i]
        assert r.num_cached_tokens == 192
    assert cfg.num_pages - 1 - sched.pool.num_free_pages == 28  # vs 8 * 14 = 112 without sharing
    assert all(sched.pool.ref_count(p) == 8 for p in shared)
    assert (sched.pool.prefix_cache_queries, sched.pool.prefix_cache_hits) == (8 * 210, 7 * 192)
    finished = sched.update_from_output(out, runner.execute(out))
    assert finished == reqs
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params, 512)
    sched.check_invariants()
    assert sched.pool.num_free_pages == 128


def test_n_children_scheduled_together_share_the_prompt_pages():
    cfg = config(num_pages=32, page_size=4, max_num_batched_tokens=64)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    params = SamplingParams(n=3, max_tokens=4, ignore_eos=True)
    prompt = list(range(1, 15))  # 3 full pages + 2 tokens
    children = [Request(f"p-{i}", prompt, params, eos_token_ids=(EOS,)) for i in range(params.n)]
    for child in children:
        sched.add_request(child)
    out, _ = step(sched, runner)
    assert shape(out) == [("p-0", 0, 14, True), ("p-1", 12, 2, True), ("p-2", 12, 2, True)]
    assert [c.page_ids for c in children] == [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6]]
    assert sched.pool.prefix_cache_hits == 24
    while sched.has_unfinished_requests():
        step(sched, runner)
    expected = reference_output(prompt, params, 128)
    assert all(c.output_token_ids == expected for c in children)


# ---- randomized workloads -----------------------------------------------------------


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 48))
    prefix_caching = draw(st.sampled_from([True, True, False]))
    shared = draw(st.lists(st.integers(0, VOCAB - 1), max_size=24))
    specs = []
    for i in range(draw(st.integers(1, 8))):
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if shared else 1, max_size=20))
        prompt = (shared if draw(st.booleans()) else []) + tail or [1]
        max_tokens = draw(st.integers(1, 16))
        params = SamplingParams(
            n=draw(st.integers(1, 3)),
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, min(2, max_tokens))),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(1, VOCAB - 1), max_size=2)),
        )
        arrival = draw(st.integers(0, 4))
        abort_at = draw(st.none() | st.integers(0, 30))
        specs.append((f"q{i}", prompt, params, arrival, abort_at))
    most_slots = max(len(p) + s.max_tokens - 1 for _, p, s, _, _ in specs)
    num_pages = 1 + -(-most_slots // page_size) + draw(st.integers(0, 4))  # tiny: preemption
    cfg = SchedulerConfig(num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, max_model_len=64,
                          enable_prefix_caching=prefix_caching,
                          long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3])),
                          max_num_partial_prefills=draw(st.sampled_from([None, None, 1, 2])))
    return cfg, specs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_reference_outputs(workload):
    cfg, specs = workload
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    requests: dict[str, Request] = {}
    aborts: dict[int, list[str]] = {}
    arrivals: dict[int, list[Request]] = {}
    for rid, prompt, params, arrival, abort_at in specs:
        for j in range(params.n):  # the engine's split of an n > 1 request
            child = Request(f"{rid}-{j}", prompt, params, eos_token_ids=(EOS,))
            requests[child.request_id] = child
            arrivals.setdefault(arrival, []).append(child)
            if abort_at is not None:
                aborts.setdefault(abort_at, []).append(child.request_id)
    last_arrival = max(arrivals)
    for t in range(2000):
        for r in arrivals.get(t, []):
            sched.add_request(r)
        sched.abort_requests(aborts.get(t, []))
        if not sched.has_unfinished_requests():
            if t >= last_arrival:
                break
            continue
        out, _ = step(sched, runner)
        assert out.num_scheduled_tokens > 0, "no progress with unfinished requests"
        assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled_requests) <= cfg.max_num_seqs
        partial = sum(e.num_tokens > 1 for e in out.scheduled_requests)
        assert partial <= (cfg.max_num_partial_prefills or partial)
    else:
        pytest.fail("workload did not finish")
    assert_reference_outputs(requests.values(), cfg.max_model_len)
    event(f"preemptions: {min(sched.num_preemptions, 3)}+")
    event(f"prefix-cache hits: {sched.pool.prefix_cache_hits > 0}")
    event(f"aborted: {any(r.finish_reason == 'abort' for r in requests.values())}")
    sched.check_invariants()
    assert sched.pool.num_free_pages == cfg.num_pages - 1
    assert all(sched.pool.ref_count(p) == 0 for p in range(cfg.num_pages))
    assert sched.num_running == sched.num_waiting == 0


# ---- async scheduling (one step in flight) ----------------------------------------------


class LaggedRunner(FakeRunner):
    """The runner under async scheduling: a placeholder token is the one its previous `execute` sampled for
    the request (the real runner gathers it on the device)."""

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        self.previous: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        entries = tuple(dataclasses.replace(e, token_ids=(self.previous[e.request_id][-1],)) if e.placeholder
                        else e for e in out.scheduled_requests)
        assert all(PLACEHOLDER_TOKEN_ID not in e.token_ids for e in entries)
        self.previous = super().execute(dataclasses.replace(out, scheduled_requests=entries))
        return self.previous


def overlapped_step(sched: Scheduler, runner: LaggedRunner, in_flight):
    """The engine's overlapped step: schedule and run N+1, then apply N's tokens. Returns (N+1's output,
    the new in-flight step, the requests N finished)."""
    out = sched.schedule()
    sampled = runner.execute(out)
    check_tables(sched, runner, out)
    finished = sched.update_from_output(*in_flight) if in_flight else []
    sched.check_invariants()
    return out, (None if out.is_empty else (out, sampled)), finished


def test_async_decode_feeds_a_placeholder_with_exact_pages():
    cfg = config(page_size=4, num_pages=16, enable_prefix_caching=False, async_scheduling=True)
    sched, runner = Scheduler(cfg), LaggedRunner(cfg)
    a, b = make("a", range(1, 7), max_tokens=4, ignore_eos=True), make("b", [10, 11, 12], max_tokens=4, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    out, flight, _ = overlapped_step(sched, runner, None)
    assert shape(out) == [("a", 0, 6, True), ("b", 0, 3, True)]
    assert [e.page_ids for e in out.scheduled_requests] == [(1, 2), (3,)]
    assert (a.num_output_placeholders, a.num_computed_tokens, a.num_output_tokens) == (1, 6, 0)

    out, flight, _ = overlapped_step(sched, runner, flight)  # decodes of the tokens step 1 sampled
    assert shape(out) == [("a", 6, 1, True), ("b", 3, 1, True)]
    assert all(e.placeholder and e.token_ids == (PLACEHOLDER_TOKEN_ID,) for e in out.scheduled_requests)
    assert [e.num_output_tokens for e in out.scheduled_requests] == [1, 1]  # the PRNG step counts placeholders
    assert pages_sent(out) == [("a", 2, ()), ("b", 1, ())]  # no page opened: nothing sent
    assert (a.num_output_placeholders, a.num_computed_tokens, a.num_output_tokens) == (1, 7, 1)

    out, flight, _ = overlapped_step(sched, runner, flight)
    assert shape(out) == [("a", 7, 1, True), ("b", 4, 1, True)]
    assert pages_sent(out) == [("a", 2, ()), ("b", 1, (4,))]  # b's 5th token opens page 4
    assert runner.tables == {"a": [1, 2], "b": [3, 4]}
    samples = {"a": 3, "b": 3}
    while flight is not None:
        out, flight, _ = overlapped_step(sched, runner, flight)
        for e in out.scheduled_requests:
            samples[e.request_id] += e.samples
    assert samples == {"a": 4, "b": 4}  # max_tokens: no slot after the last token
    for r in (a, b):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params, 128)
        assert r.num_output_placeholders == 0
    assert sched.pool.num_free_pages == cfg.num_pages - 1


def test_async_request_at_max_tokens_is_not_scheduled_again():
    cfg = config(async_scheduling=True)
    sched, runner = Scheduler(cfg), LaggedRunner(cfg)
    r = make("a", [1, 2, 3], max_tokens=1)
    sched.add_request(r)
    _, flight, _ = overlapped_step(sched, runner, None)
    out, flight, finished = overlapped_step(sched, runner, flight)
    assert out.is_empty and finished == [r] and r.finish_reason == "length"
    assert sched.pool.num_free_pages == cfg.num_pages - 1


def test_async_preempted_request_waits_for_its_tokens_in_flight():
    # 4 usable pages of 2 slots; two 3-token prompts fill them. The caller keeps two steps in flight here.
    cfg = config(num_pages=5, page_size=2, max_num_seqs=4, enable_prefix_caching=False, async_scheduling=True)
    sched, runner = Scheduler(cfg), LaggedRunner(cfg)
    A, B = make("A", [1, 2, 3], max_tokens=6, ignore_eos=True), make("B", [5, 6, 7], max_tokens=6, ignore_eos=True)
    sched.add_request(A)
    sched.add_request(B)
    out1 = sched.schedule()
    s1 = runner.execute(out1)
    assert [e.page_ids for e in out1.scheduled_requests] == [(1, 2), (3, 4)]
    out2 = sched.schedule()
    s2 = runner.execute(out2)
    assert shape(out2) == [("A", 3, 1, True), ("B", 3, 1, True)]
    sched.update_from_output(out1, s1)
    out3 = sched.schedule()  # A needs a 3rd page: B goes, with its step-2 token still in flight
    s3 = runner.execute(out3)
    assert out3.preempted_request_ids == ("B",) and shape(out3) == [("A", 4, 1, True)]
    assert A.page_ids == [1, 2, 4] and B.page_ids == [] and B.num_output_placeholders == 1
    assert sched.abort_requests("A") == [A]
    assert sched.pool.free_page_ids() == [3, 4, 2, 1]
    assert sched.schedule().is_empty  # pages are free, but B's recompute needs its token in flight
    sched.update_from_output(out2, s2)  # B's token arrives (A's is ignored: aborted)
    assert B.num_output_tokens == 2 and B.num_output_placeholders == 0 and B.status is RequestStatus.PREEMPTED
    sched.update_from_output(out3, s3)
    out5 = sched.schedule()
    assert shape(out5) == [("B", 0, 5, True)] and out5.scheduled_requests[0].page_ids == (3, 4, 2)
    assert out5.scheduled_requests[0].token_ids == tuple(B.all_token_ids)
    flight = (out5, runner.execute(out5))
    while flight is not None:
        _, flight, _ = overlapped_step(sched, runner, flight)
    assert B.output_token_ids == reference_output(B.prompt_token_ids, B.sampling_params, 128)
    assert sched.pool.num_free_pages == cfg.num_pages - 1


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_async_random_workloads_finish_with_reference_outputs(workload):
    """test_random_workloads_finish_with_reference_outputs with one step in flight: same outputs, exact
    page accounting, at most one wasted sampling slot per request and none for a length stop."""
    cfg, specs = workload
    cfg = dataclasses.replace(cfg, async_scheduling=True)
    sched, runner = Scheduler(cfg), LaggedRunner(cfg)
    requests: dict[str, Request] = {}
    aborts: dict[int, list[str]] = {}
    arrivals: dict[int, list[Request]] = {}
    for rid, prompt, params, arrival, abort_at in specs:
        for j in range(params.n):
            child = Request(f"{rid}-{j}", prompt, params, eos_token_ids=(EOS,))
            requests[child.request_id] = child
            arrivals.setdefault(arrival, []).append(child)
            if abort_at is not None:
                aborts.setdefault(abort_at, []).append(child.request_id)
    samples = dict.fromkeys(requests, 0)
    flight = None
    for t in range(2000):
        for r in arrivals.get(t, []):
            sched.add_request(r)
        sched.abort_requests(aborts.get(t, []))
        if not sched.has_unfinished_requests() and flight is None:
            if t >= max(arrivals):
                break
            continue
        had_flight = flight is not None
        out, flight, _ = overlapped_step(sched, runner, flight)
        assert out.num_scheduled_tokens > 0 or had_flight, "no progress with unfinished requests"
        assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
        for e in out.scheduled_requests:
            samples[e.request_id] += e.samples
    else:
        pytest.fail("workload did not finish")
    assert_reference_outputs(requests.values(), cfg.max_model_len)
    for r in requests.values():
        wasted = samples[r.request_id] - r.num_output_tokens
        assert wasted == 0 if r.finish_reason == "length" else 0 <= wasted <= 1, (r, wasted)
    event(f"preemptions: {min(sched.num_preemptions, 3)}+")
    sched.check_invariants()
    assert sched.pool.num_free_pages == cfg.num_pages - 1
    assert all(sched.pool.ref_count(p) == 0 for p in range(cfg.num_pages))


def test_decode_pages_are_hashed_as_each_fills_and_the_count_follows_preemption():
    """The scheduler asks the pool to hash a request's pages only once another has filled (its
    `num_full_pages_cached`): each page is still hashed on the step that fills it with known tokens, and a
    preempted request counts none again."""
    sched, runner = Scheduler(config(page_size=2)), None
    runner = FakeRunner(sched.config)
    r = make("a", [1, 2, 3], max_tokens=6, ignore_eos=True)
    sched.add_request(r)
    hashed = []
    while not r.is_finished:
        step(sched, runner)
        full = min(r.num_computed_tokens, r.num_tokens) // 2 if not r.is_finished else None
        if full is not None:
            assert r.num_full_pages_cached == full
            assert [sched.pool.page_hash(p) is not None for p in r.page_ids] == [i < full for i in
                                                                                 range(len(r.page_ids))]
            hashed.append(full)
    assert hashed == [1, 2, 2, 3, 3]  # prompt 3 + outputs: one more page each 2 tokens fed
    other = make("b", [4, 5, 6, 7, 8], max_tokens=2, ignore_eos=True)
    sched.add_request(other)
    step(sched, runner)
    assert other.num_full_pages_cached == 2
    sched._preempt(sched.running.pop())
    assert other.num_full_pages_cached == 0 and other.page_ids == []

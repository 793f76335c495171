"""InputBatch: the runner's persistent rows, made from a whole page table and updated by the scheduler's diffs."""

from __future__ import annotations


import pytest

from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.request import Request
from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.sample.sampling_batch import seed_key_data
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.input_batch import InputBatch

GREEDY, HOT = SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_p=0.25)


def entry(rid, pages, page_ids_from=0, params=GREEDY, seed=0):
    return ScheduledRequest(rid, (7,), 0, tuple(pages), True, params, 1, page_ids_from=page_ids_from, seed=seed)


def table(batch, rows):
    return [batch.page_table[r, :5].tolist() for r in rows]


def test_rows_are_made_whole_then_updated_by_diffs():
    batch = InputBatch(capacity=3, max_pages=5, vocab_size=64)
    rows = batch.apply([entry("a", (5, 2), params=HOT, seed=3), entry("b", (9,))])
    assert table(batch, rows) == [[5, 2, 0, 0, 0], [9, 0, 0, 0, 0]] and batch.num_pages[rows].tolist() == [2, 1]
    assert batch.scalars[rows, 0].tolist() == [0.5, 0.0]
    assert batch.key_data[rows].tolist() == [seed_key_data(3).tolist(), seed_key_data(0).tolist()]
    # a decode that filled no page sends nothing; one that opened page 7 sends it alone; the order is the step's
    again = batch.apply([entry("b", (), 1), entry("a", (7,), 2)])
    assert again.tolist() == rows[::-1].tolist()
    assert table(batch, again) == [[9, 0, 0, 0, 0], [5, 2, 7, 0, 0]] and batch.num_pages[again].tolist() == [1, 3]
    # rejected drafts cut a's table back to 1 page, then it grows by 4: the rest of the row is cleared
    batch.apply([entry("a", (), 1)])
    assert table(batch, [rows[0]]) == [[5, 0, 0, 0, 0]] and batch.num_pages[rows[0]] == 1
    batch.apply([entry("a", (8,), 1)])
    assert table(batch, [rows[0]]) == [[5, 8, 0, 0, 0]]
    # sent whole again (after preemption, a page freed out of a sliding window): made anew, constants included
    batch.apply([entry("a", (0, 4), params=GREEDY, seed=9)])
    assert table(batch, [rows[0]]) == [[0, 4, 0, 0, 0]] and batch.scalars[rows[0], 0] == 0.0
    assert batch.key_data[rows[0]].tolist() == seed_key_data(9).tolist() and len(batch) == 2
    assert batch.apply([entry("b", (), 1), entry("a", (), 2)]).tolist() == rows[::-1].tolist()  # nothing changed


def test_removed_rows_are_free_and_cleared():
    batch = InputBatch(capacity=2, max_pages=4, vocab_size=64)
    a, b = batch.apply([entry("a", (1, 2, 3)), entry("b", (4,))])
    batch.remove(["a", "never-seen"])
    assert len(batch) == 1 and "a" not in batch and "b" in batch
    (c,) = batch.apply([entry("c", (6,))])  # a's row, cleared past c's page
    assert c == a and batch.page_table[c].tolist() == [6, 0, 0, 0]
    with pytest.raises(RuntimeError, match="all taken"):
        batch.apply([entry("d", (8,))])
    with pytest.raises(ValueError, match="holds no row"):
        batch.apply([entry("a", (), 3)])  # a diff for a request whose row went: a scheduler/runner mismatch
    with pytest.raises(ValueError, match="holds 1 pages"):
        batch.apply([entry("b", (5,), 2)])  # a diff past the pages the row holds
    with pytest.raises(ValueError, match="longer than 4"):
        batch.apply([entry("b", (5, 6, 7, 8), 1)])
    assert batch.page_table[b].tolist() == [4, 0, 0, 0]  # refused diffs change nothing
    with pytest.raises(ValueError, match="repeat"):
        batch.apply([entry("b", (4,)), entry("b", (4,))])
    with pytest.raises(ValueError, match="seed"):
        batch.apply([entry("e", (1,), seed=1.5)])
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="capacity"):
            InputBatch(capacity=bad, max_pages=4, vocab_size=64)


def test_the_scheduler_sends_each_page_once_and_the_rows_follow_its_tables():
    """A decode step sends no pages until one opens; a preempted request's row goes and it comes back whole; the rows
    the runner keeps from the diffs equal the scheduler's page tables, step after step."""
    sched = Scheduler(SchedulerConfig(num_pages=6, page_size=2, max_num_seqs=2, max_num_batched_tokens=8,
                                      max_model_len=12, enable_prefix_caching=False))
    batch = InputBatch(capacity=4, max_pages=6, vocab_size=64)
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5])):
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    sent = []
    for step in range(8):
        out = sched.schedule()
        batch.remove(out.finished_request_ids + out.preempted_request_ids)
        rows = batch.apply(out.scheduled_requests)
        sent.append([(e.request_id, e.page_ids_from, e.page_ids) for e in out.scheduled_requests])
        for e, row in zip(out.scheduled_requests, rows):
            request = sched.get_request(e.request_id)
            assert batch.page_table[row, :batch.num_pages[row]].tolist() == request.page_ids
        sched.update_from_output(out, {e.request_id: [9] for e in out.scheduled_requests if e.samples})
    assert sent[:4] == [
        [("a", 0, (1, 2)), ("b", 0, (3,))],  # prompts: whole tables
        [("a", 2, ()), ("b", 1, (4,))],  # a's 4th token fills page 2; b's 3rd opens page 4
        [("a", 2, (5,)), ("b", 2, ())],
        # the pool is out of pages: b (last admitted) is preempted, a decodes into it
        [("a", 3, ())],
    ]
    assert sent[4] == [("a", 3, (4,))] and sched.get_request("b").num_preemptions == 1
    assert "b" not in batch  # its row went with the output that preempted it


def test_pages_freed_out_of_a_sliding_window_reach_the_rows():
    """A page freed out of the window becomes the null page in the scheduler's table: the diff starts there, so the
    runner's row holds 0 too (and never the id the pool may hand to another request)."""
    sched = Scheduler(SchedulerConfig(num_pages=12, page_size=2, max_num_seqs=1, max_num_batched_tokens=8,
                                      max_model_len=24, enable_prefix_caching=False, sliding_window=3))
    batch = InputBatch(capacity=2, max_pages=12, vocab_size=64)
    request = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add_request(request)
    sent = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        batch.remove(out.finished_request_ids + out.preempted_request_ids)
        (row,) = batch.apply(out.scheduled_requests)
        (e,) = out.scheduled_requests
        sent.append((e.page_ids_from, e.page_ids))
        assert batch.page_table[row, :batch.num_pages[row]].tolist() == request.page_ids
        sched.update_from_output(out, {"a": [9]})
    # the prompt's 3 pages whole; position 5 leaves positions 0-1 out of the window (page 1 freed: the table from
    # index 0 again); position 6 frees page 2 (from index 1) and opens page 4; 7 changes nothing; 8 frees page 3,
    # opens page 5
    assert sent == [(0, (1, 2, 3)), (0, (0, 2, 3)), (1, (0, 3, 4)), (4, ()), (2, (0, 4, 5)), (5, ())]


def test_rows_keep_which_params_need_more_than_constants_and_a_reused_row_forgets_them():
    biased = SamplingParams(temperature=0.0, logit_bias={3: 1.0})
    penalised = SamplingParams(temperature=0.5, presence_penalty=0.5)
    logprobs = SamplingParams(temperature=0.0, logprobs=2)
    batch = InputBatch(capacity=4, max_pages=4, vocab_size=64)
    step = (entry("a", (1,), params=biased), entry("b", (2,), params=penalised), entry("c", (3,), params=logprobs),
            entry("d", (4,)))
    rows = batch.apply(step)
    assert batch.biased[rows].tolist() == [True, True, False, False]
    assert batch.logprobs[rows].tolist() == [False, False, True, False]
    batch.remove(["a"])  # a row freed may be reused: made anew, its flags with it
    (e,) = batch.apply([entry("e", (5,))])
    assert e == rows[0] and not batch.biased[e]
    assert batch.apply([entry(rid, (), 1) for rid in "bcd"]).tolist() == rows[1:].tolist()


def test_rows_keep_flags_a_step_checks_in_one_indexing_and_banned_ids_are_looked_at_only_under_min_tokens():
    import dataclasses
    banning = SamplingParams(temperature=0.0, min_tokens=3)
    prompt_lp = SamplingParams(temperature=0.0, prompt_logprobs=1)
    batch = InputBatch(capacity=4, max_pages=4, vocab_size=64)
    step = [dataclasses.replace(entry("a", (1,), params=banning), banned_token_ids=(2,)),
            entry("b", (2,), params=prompt_lp), entry("c", (3,)),
            dataclasses.replace(entry("d", (4,)), spec_token_ids=(5,), spec_banned_token_ids=((),))]
    rows = batch.apply(step)
    assert batch.banning[rows].tolist() == [True, False, False, False]
    assert batch.prompt_lp[rows].tolist() == [False, True, False, False] and not batch.constrained[rows].any()
    assert batch.any_flag(batch.prompt_lp, rows) and not batch.any_flag(batch.prompt_lp, rows[[0, 2]])
    assert batch.may_need_row_info(step, rows) == [0, 3]  # a's banned ids, d's drafts
    assert batch.may_need_row_info(step, rows, drafts=False) == [0]
    unbanned = dataclasses.replace(step[0], banned_token_ids=())  # past min_tokens: nothing banned, not looked at
    assert batch.may_need_row_info([unbanned] + step[1:3], rows[:3]) == []

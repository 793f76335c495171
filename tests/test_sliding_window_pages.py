"""All-windowed models: pages wholly before the window go back to the pool (exact page ids), and a long
generation holds a page count bounded by the window while matching transformers token for token."""

from __future__ import annotations

import pytest

from jaxpaged.core.page_pool import NULL_PAGE_ID, PagePool
from jaxpaged.core.request import Request
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig

PAGE = 4


def computed(pool: PagePool, request: Request, num_tokens: int) -> Request:
    assert pool.allocate(request, num_tokens - request.num_computed_tokens) is not None
    request.num_computed_tokens = num_tokens
    pool.cache_full_pages(request)
    return request


def test_free_outside_window_exact_ids():
    pool = PagePool(num_pages=10, page_size=PAGE, enable_prefix_caching=False)
    r = computed(pool, Request("r", list(range(20))), 20)
    assert r.page_ids == [1, 2, 3, 4, 5]
    # next token at p = 20 sees keys 15..20 (window 6): pages 0-2 (tokens 0..11) are dead, page 3 (12..15) lives
    assert pool.free_outside_window(r, 6) == [3, 2, 1]
    assert r.page_ids == [NULL_PAGE_ID, NULL_PAGE_ID, NULL_PAGE_ID, 4, 5]
    assert pool.free_page_ids() == [6, 7, 8, 9, 3, 2, 1]
    assert pool.free_outside_window(r, 6) == []  # idempotent
    r.num_computed_tokens = 21  # p = 21 sees 16..21: page 3 now dead too
    assert pool.free_outside_window(r, 6) == [4]
    pool.check_invariants()
    pool.free(r)  # the null entries are skipped
    assert pool.free_page_ids() == [6, 7, 8, 9, 3, 2, 1, 4, 5] and r.page_ids == []
    pool.check_invariants()


def test_window_larger_than_context_frees_nothing():
    pool = PagePool(num_pages=10, page_size=PAGE, enable_prefix_caching=False)
    r = computed(pool, Request("r", list(range(12))), 12)
    assert pool.free_outside_window(r, 13) == [] and r.page_ids == [1, 2, 3]
    assert pool.free_outside_window(r, 12) == []  # p = 12 sees 1..12: page 0 still holds keys 1..3
    assert pool.free_outside_window(r, 9) == [1]  # sees 4..12
    with pytest.raises(ValueError, match="window=0"):
        pool.free_outside_window(r, 0)


def test_released_pages_stay_cached_and_null_entries_are_never_hashed():
    pool = PagePool(num_pages=10, page_size=PAGE, enable_prefix_caching=True)
    r = computed(pool, Request("r", list(range(12))), 8)
    assert pool.free_outside_window(r, 1) == [2, 1]  # window 1: only the next token itself
    assert computed(pool, r, 12).page_ids == [NULL_PAGE_ID, NULL_PAGE_ID, 3]
    pool.check_invariants()  # page 3 hashed, the null page not
    assert pool.page_hash(NULL_PAGE_ID) is None and pool.page_hash(3) is not None
    again = Request("again", list(range(8)) + [99])
    assert pool.find_cached_prefix(again).page_ids == (1, 2)  # released pages still shareable


def _scheduler(window):
    return Scheduler(SchedulerConfig(num_pages=12, page_size=PAGE, max_num_seqs=2, max_num_batched_tokens=8,
                                     max_model_len=44, sliding_window=window))


@pytest.mark.parametrize("window, held", [(None, 11), (5, 2)])
def test_scheduler_releases_pages_during_decode(window, held):
    sched = _scheduler(window)
    r = Request("r", list(range(6)), SamplingParams(max_tokens=38, ignore_eos=True))
    sched.add_request(r)
    peak = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.check_invariants()
        peak = max(peak, sched.pool.num_usable_pages - sched.pool.num_free_pages)
        sched.update_from_output(out, {e.request_id: [7] for e in out.scheduled_requests if e.samples})
    assert peak == held and sched.pool.num_free_pages == sched.pool.num_usable_pages


def test_scheduler_config_rejects_bad_window():
    with pytest.raises(ValueError, match="sliding_window"):
        _scheduler(0)


def test_long_generation_on_all_windowed_model_keeps_pages_bounded(tmp_path):
    """Mistral with window 5, pages of 8: 200 generated tokens hold at most 2 pages (out of 26 needed
    without release), and the tokens equal transformers' generate."""
    from jaxpaged import LLM
    from tests.models.test_families import _hf_greedy
    from tests.models.tiny_families import load_hf_model, make_family_checkpoint
    folder = make_family_checkpoint(tmp_path / "m", "mistral_window")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=16,
              num_pages=40, block_size=8, warmup=False)
    engine = llm.llm_engine
    prompt = list(range(30, 40))
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    pool, peak, tokens = engine.scheduler.pool, 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids if out.finished else tokens
        peak = max(peak, pool.num_usable_pages - pool.num_free_pages)
    assert peak <= 2  # keys p-4..p span at most 2 pages of 8
    assert tokens == _hf_greedy(load_hf_model(folder), prompt, 200)

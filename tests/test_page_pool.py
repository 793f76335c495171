import subprocess
import sys

import pytest

from jaxpaged.core.page_pool import NULL_PAGE_ID, CachedPrefix, PagePool, hash_page
from jaxpaged.core.request import Request

PAGE = 4


def req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens))


def compute(pool: PagePool, request: Request, prefix: CachedPrefix | None = None) -> list[int] | None:
    """Admit the request with its cached prefix and compute the rest of its tokens."""
    prefix = prefix if prefix is not None else pool.find_cached_prefix(request)
    new = pool.allocate(request, request.num_tokens - prefix.num_tokens, prefix)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
        pool.cache_full_pages(request)
    return new


def state(pool: PagePool):
    return (
        pool.free_page_ids(),
        [pool.ref_count(p) for p in range(pool.num_pages)],
        [pool.page_hash(p) for p in range(pool.num_pages)],
    )


def test_fresh_pool_allocates_ascending_and_frees_in_reverse():
    pool = PagePool(num_pages=9, page_size=PAGE, enable_prefix_caching=False)
    assert pool.free_page_ids() == [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = req("a", range(10)), req("b", range(6))
    assert pool.allocate(a, 10) == [1, 2, 3]
    assert pool.allocate(b, 6) == [4, 5]
    assert a.page_ids == [1, 2, 3] and b.page_ids == [4, 5]
    assert (pool.num_free_pages, pool.usage) == (3, 5 / 8)
    pool.free(a)
    assert a.page_ids == []
    assert pool.free_page_ids() == [6, 7, 8, 3, 2, 1]
    c = req("c", range(16))
    assert pool.allocate(c, 16) == [6, 7, 8, 3]
    pool.free(b)
    assert pool.free_page_ids() == [2, 1, 5, 4]
    pool.check_invariants()


def test_growth_allocates_only_missing_pages():
    pool = PagePool(9, PAGE, False)
    r = req("r", range(4))
    assert pool.allocate(r, 3) == [1]
    r.num_computed_tokens = 3
    assert pool.allocate(r, 1) == []  # slot 3 is still in page 1
    r.num_computed_tokens = 4
    assert pool.allocate(r, 1) == [2]
    assert pool.allocate(r, 0) == []
    assert r.page_ids == [1, 2]


def test_null_page_never_handed_out_and_failure_is_atomic():
    pool = PagePool(9, PAGE, True)
    a = req("a", range(20))
    compute(pool, a)  # 5 pages, all full -> cached
    assert a.page_ids == [1, 2, 3, 4, 5]
    b = req("b", range(100, 112))
    assert pool.allocate(b, 12) == [6, 7, 8]
    before = state(pool)
    c = req("c", range(200, 204))
    assert pool.allocate(c, 4) is None
    assert state(pool) == before and c.page_ids == []
    # A cached prefix whose pages must leave the free queue counts against it too.
    pool.free(a)
    d = req("d", list(range(20)) + list(range(300, 304)))
    prefix = pool.find_cached_prefix(d)
    assert prefix == CachedPrefix((1, 2, 3, 4, 5), 20)
    before = state(pool)
    queries = pool.prefix_cache_queries
    assert pool.allocate(d, 4, prefix) is None  # needs 5 cached + 1 new > 5 free
    assert state(pool) == before and d.page_ids == [] and pool.prefix_cache_queries == queries
    assert NULL_PAGE_ID not in pool.free_page_ids()
    pool.check_invariants()


def test_prefix_hit_shares_pages_with_ref_counts():
    pool = PagePool(17, PAGE, True)
    prompt = list(range(10))
    a = req("a", prompt + [50, 51])
    assert compute(pool, a) == [1, 2, 3]
    b = req("b", prompt + [60, 61, 62, 63])
    prefix = pool.find_cached_prefix(b)
    assert prefix == CachedPrefix((1, 2), 8)  # page 3 holds tokens 8..11 = [8, 9, 50, 51]: differs
    assert pool.allocate(b, b.num_tokens - 8, prefix) == [4, 5]
    assert b.page_ids == [1, 2, 4, 5]
    assert [pool.ref_count(p) for p in range(6)] == [0, 2, 2, 1, 1, 1]
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (12 + 14, 8)
    pool.free(a)
    assert [pool.ref_count(p) for p in range(6)] == [0, 1, 1, 0, 1, 1]
    assert pool.free_page_ids()[-1] == 3
    pool.check_invariants()


def test_hit_is_capped_below_the_whole_sequence():
    pool = PagePool(9, PAGE, True)
    a = req("a", range(8))
    compute(pool, a)
    assert pool.find_cached_prefix(req("same", range(8))) == CachedPrefix((1,), 4)
    assert pool.find_cached_prefix(req("longer", range(9))) == CachedPrefix((1, 2), 8)
    assert pool.find_cached_prefix(req("short", range(4))) == CachedPrefix()


def test_same_page_content_after_a_different_prefix_does_not_hit():
    pool = PagePool(9, PAGE, True)
    compute(pool, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))  # pages 1, 2 (+3)
    compute(pool, req("b", [10, 11, 12, 13, 14, 15, 16, 17, 9]))  # pages 4, 5 (+6)
    assert pool.find_cached_prefix(req("c", [1, 2, 3, 4, 14, 15, 16, 17, 9])) == CachedPrefix((1,), 4)
    assert pool.find_cached_prefix(req("d", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == CachedPrefix()


def test_only_full_pages_of_computed_tokens_are_cached():
    pool = PagePool(9, PAGE, True)
    a = req("a", range(10))
    pool.allocate(a, 6)
    a.num_computed_tokens = 6
    pool.cache_full_pages(a)
    assert [pool.page_hash(p) is not None for p in a.page_ids] == [True, False]
    pool.allocate(a, 4)
    a.num_computed_tokens = 10
    pool.cache_full_pages(a)
    assert [pool.page_hash(p) is not None for p in a.page_ids] == [True, True, False]
    assert pool.num_cached_pages == 2
    pool.check_invariants()


def test_cached_free_pages_are_found_and_taken_off_the_free_queue():
    pool = PagePool(9, PAGE, True)
    a = req("a", range(13))
    compute(pool, a)
    assert a.page_ids == [1, 2, 3, 4]
    pool.free(a)
    assert pool.free_page_ids() == [5, 6, 7, 8, 4, 3, 2, 1]
    b = req("b", list(range(12)) + [99])
    assert compute(pool, b) == [5]
    assert b.page_ids == [1, 2, 3, 5]
    assert pool.free_page_ids() == [6, 7, 8, 4]
    assert [pool.ref_count(p) for p in (1, 2, 3)] == [1, 1, 1]
    assert pool.prefix_cache_hits == 12
    pool.check_invariants()


def test_lru_eviction_takes_tail_pages_first():
    pool = PagePool(9, PAGE, True)
    a = req("a", range(12))
    compute(pool, a)  # pages 1, 2, 3 all full and cached
    pool.free(a)
    assert pool.free_page_ids() == [4, 5, 6, 7, 8, 3, 2, 1]
    b = req("b", range(100, 124))
    assert compute(pool, b) == [4, 5, 6, 7, 8, 3]  # evicts a's tail page 3
    assert pool.page_hash(3) == b.page_hashes[5]
    assert pool.find_cached_prefix(req("a2", range(13))) == CachedPrefix((1, 2), 8)
    c = req("c", range(200, 204))
    assert compute(pool, c) == [2]  # next evicted: a's page 2, then page 1
    assert pool.find_cached_prefix(req("a3", range(13))) == CachedPrefix((1,), 4)
    pool.check_invariants()


def test_n_children_share_the_prompt_pages():
    """An n=3 prompt split into 3 child requests: one copy of its full pages."""
    pool = PagePool(17, PAGE, True)
    prompt = list(range(30))  # 7 full pages + 2 tokens
    children = [req(f"p-{i}", prompt) for i in range(3)]
    assert compute(pool, children[0]) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert compute(pool, children[1]) == [9]
    assert compute(pool, children[2]) == [10]
    assert children[1].page_ids == [1, 2, 3, 4, 5, 6, 7, 9]
    assert children[2].page_ids == [1, 2, 3, 4, 5, 6, 7, 10]
    assert [pool.ref_count(p) for p in range(1, 11)] == [3] * 7 + [1, 1, 1]
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (90, 56)
    for child in children:
        pool.free(child)
    assert pool.num_free_pages == 16 and pool.usage == 0.0
    pool.check_invariants()


def test_duplicate_content_stays_findable_after_first_copy_is_evicted():
    pool = PagePool(9, PAGE, True)
    a, b = req("a", range(5)), req("b", range(5))
    pool.allocate(a, 5)
    pool.allocate(b, 5)  # both computed in the same step: no hit
    for r in (a, b):
        r.num_computed_tokens = 5
        pool.cache_full_pages(r)
    assert (a.page_ids, b.page_ids) == ([1, 2], [3, 4])
    assert pool.find_cached_prefix(req("x", range(5))).page_ids == (1,)
    pool.free(a)
    pool.free(b)
    assert pool.free_page_ids() == [5, 6, 7, 8, 2, 1, 4, 3]
    hog = req("hog", range(100, 120))
    assert compute(pool, hog) == [5, 6, 7, 8, 2]
    assert pool.find_cached_prefix(req("x", range(5))).page_ids == (1,)
    pool.allocate(req("more", range(4)), 1)  # evicts page 1
    assert pool.find_cached_prefix(req("x", range(5))).page_ids == (3,)
    pool.check_invariants()


def test_prefix_caching_disabled():
    pool = PagePool(9, PAGE, False)
    a = req("a", range(12))
    compute(pool, a)
    assert pool.num_cached_pages == 0
    pool.free(a)
    assert pool.find_cached_prefix(req("b", range(12))) == CachedPrefix()
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (0, 0)
    pool.check_invariants()


def test_reset_prefix_cache():
    pool = PagePool(9, PAGE, True)
    a = req("a", range(8))
    compute(pool, a)
    assert pool.reset_prefix_cache() is False
    pool.free(a)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_pages == 0
    assert pool.find_cached_prefix(req("b", range(9))) == CachedPrefix()
    pool.check_invariants()


def test_misuse_raises():
    pool = PagePool(9, PAGE, True)
    a = req("a", range(8))
    compute(pool, a)
    b = req("b", range(9))
    pool.allocate(b, 1)
    with pytest.raises(ValueError, match="holding no pages"):
        pool.allocate(b, 1, CachedPrefix((1,), 4))
    with pytest.raises(ValueError, match="num_new_tokens"):
        pool.allocate(b, -1)
    pool.free(a)
    a.page_ids = [1]
    with pytest.raises(RuntimeError, match="already free"):
        pool.free(a)
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(1, 4)
    with pytest.raises(ValueError, match="page_size"):
        PagePool(4, 0)


def test_page_hash_is_chained_and_stable_across_processes():
    h1 = hash_page(b"", [1, 2, 3, 4])
    assert h1 != hash_page(b"", [1, 2, 3, 5])
    assert hash_page(h1, [5, 6, 7, 8]) != hash_page(b"", [5, 6, 7, 8])
    code = "from jaxpaged.core.page_pool import hash_page; print(hash_page(b'', [1, 2, 3, 4]).hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == h1.hex()

"""PagePool: the KV page allocator with automatic prefix caching (host side).

vLLM's BlockPool + KVCacheManager under our names: a "page" is a KV cache
block of `page_size` token slots, a request's `page_ids` is its page table.

* Page 0 is the null page: never handed out, padding rows point at it.
  Pages 1..num_pages-1 are usable.
* Free queue: deterministic order, initially 1, 2, 3, ...; freed pages go to
  the tail, allocation takes from the head (so cached free pages are evicted
  in LRU order). A request's pages are freed tail page first, so its tail
  pages are evicted before its (more shareable) head pages.
* Prefix caching: a FULL page of computed tokens is registered under the
  chained hash sha256(parent_hash || token ids of the page). A request whose
  prompt starts with the same full pages gets the same page ids (ref counted).
  A freed page keeps its hash and stays findable until it is evicted, i.e.
  until it reaches the head of the free queue and is handed out again.
* Sliding window (models whose every layer is windowed): pages wholly before
  the window of a request's next token can never be read again; they are
  released (`free_outside_window`) and their page-table entries become the
  null page, so a long generation holds about window / page_size pages.
  Released pages keep their hash (a later prompt may still share them).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct

from jaxpaged.core.request import Request

NULL_PAGE_ID = 0
_ROOT_HASH = b""  # the parent of a request's first page


def hash_page(parent_hash: bytes, token_ids) -> bytes:
    """Chained hash of one full page; stable across processes and runs."""
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(parent_hash + payload).digest()


@dataclasses.dataclass(frozen=True)
class CachedPrefix:
    """The longest cached run of a request's leading full pages (vLLM's KVCacheBlocks seam)."""

    page_ids: tuple[int, ...] = ()
    num_tokens: int = 0  # len(page_ids) * page_size


_NO_PREFIX = CachedPrefix()


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"PagePool.num_pages={num_pages!r}: must be an integer >= 2 (page 0 is the null page)")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"PagePool.page_size={page_size!r}: must be an integer >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref_counts = [0] * num_pages
        self._page_hashes: list[bytes | None] = [None] * num_pages
        # hash -> {page_id: None}, insertion ordered: the same content may be
        # computed twice (two requests in one step); the first page wins lookups.
        self._cached: dict[bytes, dict[int, None]] = {}
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_pages))
        # requests whose pages hold KV computed before `drop_prefix_cache` (older weights): never cached again
        self._uncacheable: set[str] = set()
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of which found in the cache

    # ---- counters ----------------------------------------------------------

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages with ref count 0, cached or not (cached free pages are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by requests."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    @property
    def num_cached_pages(self) -> int:
        return sum(len(pages) for pages in self._cached.values())

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def page_hash(self, page_id: int) -> bytes | None:
        return self._page_hashes[page_id]

    def free_page_ids(self) -> list[int]:
        """The free queue, head (next to be handed out) first."""
        return list(self._free)

    # ---- prefix cache ------------------------------------------------------

    def _hashes(self, request: Request, num_full_pages: int) -> list[bytes]:
        """request.page_hashes extended to cover its first num_full_pages full pages."""
        hashes, size = request.page_hashes, self.page_size
        while len(hashes) < num_full_pages:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_page(parent, request.token_ids_slice(i * size, (i + 1) * size)))
        return hashes

    def _lookup(self, page_hash: bytes) -> int | None:
        pages = self._cached.get(page_hash)
        return next(iter(pages)) if pages else None

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Longest cached prefix of the request's tokens, in full pages. Changes no state.

        Never the whole sequence: at least the last token is left to compute so the
        step that reaches it produces logits (hit <= num_tokens - 1, page-aligned).
        """
        if not self.enable_prefix_caching:
            return CachedPrefix()
        max_pages = (request.num_tokens - 1) // self.page_size
        page_ids = []
        for page_hash in self._hashes(request, max_pages)[:max_pages]:
            page_id = self._lookup(page_hash)
            if page_id is None:
                break
            page_ids.append(page_id)
        return CachedPrefix(tuple(page_ids), len(page_ids) * self.page_size)

    def cache_full_pages(self, request: Request) -> None:
        """Register the request's pages that are full of computed tokens (idempotent).

        A request's hashed pages form a prefix of its page table, so only the
        pages after the last hashed one need work.
        """
        if not self.enable_prefix_caching or request.request_id in self._uncacheable:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.page_size
        request.num_full_pages_cached = num_full
        first = num_full
        while first > 0 and request.page_ids[first - 1] != NULL_PAGE_ID and \
                self._page_hashes[request.page_ids[first - 1]] is None:
            first -= 1
        if first == num_full:
            return  # every full page already hashed (most steps)
        hashes = self._hashes(request, num_full)
        for i in range(first, num_full):
            page_id, page_hash = request.page_ids[i], hashes[i]
            self._page_hashes[page_id] = page_hash
            self._cached.setdefault(page_hash, {})[page_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no page is held. True on success."""
        if self.num_free_pages != self.num_usable_pages:
            return False
        self.drop_prefix_cache(())
        return True

    def drop_prefix_cache(self, holders) -> None:
        """Forget every cached hash, pages held or not (the model's weights changed: no page's KV is what a new
        request would compute). `holders`: the requests holding pages now; their pages are never cached, until
        each is freed (finished, or preempted: it then recomputes from scratch)."""
        self._cached.clear()
        self._page_hashes = [None] * self.num_pages
        self._uncacheable.update(r.request_id for r in holders if r.page_ids)

    # ---- allocation --------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None) -> list[int] | None:
        """Grow the request's page table for `num_new_tokens` more tokens.

        The new tokens start at request.num_computed_tokens (+ prefix.num_tokens when
        a cached prefix is taken at admission; then the page table must be empty).
        Returns the newly allocated page ids (maybe []), or None, touching nothing,
        when the free queue can't cover them. Does not advance num_computed_tokens.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} must be >= 0")
        prefix = prefix or _NO_PREFIX
        if prefix.page_ids and (request.page_ids or request.num_computed_tokens):
            raise ValueError(
                f"Request {request.request_id!r}: a cached prefix is only taken by a request holding no pages"
            )
        end = request.num_computed_tokens + prefix.num_tokens + num_new_tokens
        num_needed = -(-end // self.page_size) - len(request.page_ids) - len(prefix.page_ids)
        num_needed = max(num_needed, 0)
        if not num_needed and not prefix.page_ids and request.page_ids:
            return []  # its last page has room (most decode steps): nothing to take, touch or count
        num_prefix_free = sum(1 for p in prefix.page_ids if self._ref_counts[p] == 0)
        if num_needed + num_prefix_free > self.num_free_pages:
            return None
        if not request.page_ids and request.num_computed_tokens == 0:
            self._record_query(request, prefix)  # admission: count the lookup once
        for page_id in prefix.page_ids:
            self._touch(page_id)
        new_page_ids = [self._pop_free_page() for _ in range(num_needed)]
        request.page_ids.extend(prefix.page_ids)
        request.page_ids.extend(new_page_ids)
        return new_page_ids

    def _record_query(self, request: Request, prefix: CachedPrefix) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += prefix.num_tokens

    def _touch(self, page_id: int) -> None:
        if self._ref_counts[page_id] == 0:
            del self._free[page_id]
        self._ref_counts[page_id] += 1

    def _pop_free_page(self) -> int:
        page_id, _ = self._free.popitem(last=False)
        if self._page_hashes[page_id] is not None:
            self._evict(page_id)
        self._ref_counts[page_id] = 1
        return page_id

    def _evict(self, page_id: int) -> None:
        page_hash = self._page_hashes[page_id]
        pages = self._cached[page_hash]
        del pages[page_id]
        if not pages:
            del self._cached[page_hash]
        self._page_hashes[page_id] = None

    def free(self, request: Request) -> None:
        """Drop the request's references, tail page first; empties its page table."""
        self._uncacheable.discard(request.request_id)
        for page_id in reversed(request.page_ids):
            if page_id != NULL_PAGE_ID:  # released by free_outside_window
                self._release(request, page_id)
        request.page_ids.clear()
        request.num_pages_sent = request.num_full_pages_cached = 0

    def truncate(self, request: Request, num_tokens: int) -> list[int]:
        """Release the request's pages past the first `num_tokens` token slots, tail page first (rejected
        speculative drafts: their slots are rewritten later); returns the freed ids."""
        keep = -(-num_tokens // self.page_size)
        freed = []
        while len(request.page_ids) > keep:
            page_id = request.page_ids.pop()
            if page_id != NULL_PAGE_ID:
                self._release(request, page_id)
                freed.append(page_id)
        request.num_pages_sent = min(request.num_pages_sent, len(request.page_ids))
        request.num_full_pages_cached = min(request.num_full_pages_cached, len(request.page_ids))
        return freed

    def _release(self, request: Request, page_id: int) -> None:
        if self._ref_counts[page_id] <= 0:
            raise RuntimeError(f"page {page_id} of request {request.request_id!r} is already free")
        self._ref_counts[page_id] -= 1
        if self._ref_counts[page_id] == 0:
            self._free[page_id] = None

    def free_outside_window(self, request: Request, window: int) -> list[int]:
        """Release the pages wholly before the window of the request's next token; returns their ids.

        The next token fed sits at p = num_computed_tokens and attends keys k > p - window, so
        page i (tokens [i * page_size, (i + 1) * page_size)) is dead once (i + 1) * page_size <=
        p - window + 1. Its page-table entry becomes the null page (positions keep their index);
        released entries form a prefix of the table, so the scan stops at the first null one.
        """
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        num_dead = min(max(0, request.num_computed_tokens - window + 1) // self.page_size, len(request.page_ids))
        freed = []
        for i in reversed(range(num_dead)):
            page_id = request.page_ids[i]
            if page_id == NULL_PAGE_ID:
                break
            request.page_ids[i] = NULL_PAGE_ID
            request.num_pages_sent = min(request.num_pages_sent, i)
            self._release(request, page_id)
            freed.append(page_id)
        return freed

    # ---- checks ------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        assert NULL_PAGE_ID not in self._free, "the null page is in the free queue"
        assert self._ref_counts[NULL_PAGE_ID] == 0, "the null page is referenced"
        assert self._page_hashes[NULL_PAGE_ID] is None, "the null page is cached"
        free = list(self._free)
        assert len(free) == len(set(free)), f"duplicate pages in the free queue: {free}"
        for page_id in range(1, self.num_pages):
            ref = self._ref_counts[page_id]
            assert ref >= 0, f"page {page_id} has ref count {ref}"
            assert (ref == 0) == (page_id in self._free), f"page {page_id}: ref {ref} but free={page_id in self._free}"
            page_hash = self._page_hashes[page_id]
            if page_hash is not None:
                assert page_id in self._cached.get(page_hash, {}), f"page {page_id} hashed but not findable"
        for page_hash, pages in self._cached.items():
            assert pages, "empty entry in the hash map"
            for page_id in pages:
                assert self._page_hashes[page_id] == page_hash, f"page {page_id} is mapped under a hash it lacks"
        if not self.enable_prefix_caching:
            assert not self._cached, "prefix caching is off but pages are cached"

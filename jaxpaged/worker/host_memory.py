"""Huge pages for the big, long-lived buffers of a CPU engine: the weights and the KV pool.

A CPU decode step streams every weight once, and on 4 KiB pages that stream is slower: each page
costs a TLB walk and the hardware prefetchers stop at page edges. numpy asks Linux for transparent
huge pages on its large arrays (madvise), XLA's allocator does not, so where THP is `madvise` (the
usual default) the weights sat on 4 KiB pages. On the 2-core Intel dev machine (2026-12-01) a
one-thread sum read an XLA buffer at 7.0 GB/s and the same data in numpy at 17.6; the native
matmul's bare SmolLM2 stack at one row took 20.9 ms on XLA's pages and 16.8 ms (32 GB/s, the
probe's roofline) once its buffers were advised.

`advise_huge_pages` asks for huge pages over each buffer's span, rounded out to whole 2 MiB pages
(neighbouring memory included: the advice changes no content), then collapses the span into huge
pages at once (MADV_COLLAPSE, Linux 6.1+; older kernels leave it to khugepaged). Contents and
addresses are unchanged, so XLA keeps using the buffers as they are. Elsewhere (not Linux, THP
`never`, non-CPU arrays) it does nothing.

A collapse copies: 1.1 s for a 1 GiB KV pool and 0.75 s for SmolLM2's 540 MiB of weight blocks at
start-up on the 2-core Zen 3 (2026-12-03). So memory is born on huge pages where it can be:
- The pool holds only zeros then: `advise_zeroed_huge_pages` drops its whole huge pages (MADV_DONTNEED:
  a private anonymous page reads as zeros again and is faulted in as a zeroed huge page on its first
  write, no copy; 0.1 s). The pool's pages come in as it fills; an idle engine's RSS stays small.
- Weights written on the host go to `huge_page_empty` memory (a fresh mapping, 2 MiB-aligned, advised
  before its first touch; many arrays share one through `HugePageArena`) and reach XLA as
  `cpu_array_over` it: a CPU jax.Array over that same memory, no copy.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

import jax
import numpy as np

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def advise_huge_pages(tree: Any) -> int:
    """Back the CPU buffers of a pytree's arrays with huge pages; returns the bytes advised (0 where it cannot)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    merged = _merged_spans(tree)
    for start, end in merged:
        # Errors are harmless: a span may hold unmapped gaps (ENOMEM, the mapped parts are advised all the
        # same), MADV_COLLAPSE is unknown before Linux 6.1 (EINVAL).
        madvise(start, end - start, MADV_HUGEPAGE)
        _collapse(madvise, start, end)
    return sum(end - start for start, end in merged)


def advise_zeroed_huge_pages(tree: Any) -> int:
    """`advise_huge_pages` for arrays that hold only zeros (a fresh KV pool; the caller's promise): each whole
    huge page inside a buffer is dropped, to come back as a zeroed huge page on its first write, and only the
    (at most two) huge pages a buffer shares with its neighbours are collapsed. Contents read the same after.
    Returns the bytes advised. Waits for the arrays first (their zero fill may still be running)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if _huge_page_span(x) is not None]
    jax.block_until_ready(leaves)
    for x in leaves:
        address = x.unsafe_buffer_pointer()
        start, end = _huge_page_span(x)
        inner_start = -(-address // HUGE_PAGE) * HUGE_PAGE  # the whole huge pages inside [address, + nbytes)
        inner_end = max(inner_start, (address + x.nbytes) // HUGE_PAGE * HUGE_PAGE)
        madvise(start, end - start, MADV_HUGEPAGE)
        madvise(inner_start, inner_end - inner_start, MADV_DONTNEED)
        _collapse(madvise, start, inner_start)
        _collapse(madvise, inner_end, end)
    return sum(end - start for start, end in _merged_spans(leaves))


class HugePageArena:
    """Host memory for many arrays on shared huge pages: one `huge_page_empty` region of `capacity` bytes
    (virtual: a page costs memory once touched), handed out in order as 64-byte-aligned arrays, so only the
    last array's huge page is partly unused (one mapping per array would round each up to 2 MiB: +26% for
    SmolLM2's weight blocks). Plain host bookkeeping; arrays stay valid as long as they are referenced."""

    def __init__(self, capacity: int):
        self._memory = huge_page_empty((max(int(capacity), 1),), np.uint8)
        self._used = 0  # bytes handed out

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised C-contiguous array; one of its own (`huge_page_empty`) once the region is full."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        start = -(-self._used // 64) * 64
        if start + nbytes > self._memory.size:
            return huge_page_empty(shape, dtype)
        self._used = start + nbytes
        return self._memory[start:start + nbytes].view(dtype).reshape(shape)


def huge_page_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous host array on whole huge pages of its own: 2 MiB-aligned, its span
    advised (MADV_HUGEPAGE) before anything touches it, so each page faults in huge (where THP allows).
    Outside Linux a plain numpy array."""
    if not sys.platform.startswith("linux"):
        return np.empty(shape, dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    span = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    # A fresh anonymous mapping (malloc may hand back memory already on 4 KiB pages), with room to align;
    # the array keeps it alive.
    raw = np.frombuffer(mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
    offset = -raw.ctypes.data % HUGE_PAGE
    madvise = _madvise()
    if madvise is not None:
        madvise(raw.ctypes.data + offset, span, MADV_HUGEPAGE)
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def cpu_array_over(host: np.ndarray) -> jax.Array:
    """A jax.Array on the default CPU device over `host`'s own memory (it keeps `host` alive; the caller
    must not write `host` after); a copy where JAX cannot alias it (not 64-byte aligned, not a CPU)."""
    return jax.device_put(host, may_alias=True)


def _merged_spans(tree: Any) -> list[tuple[int, int]]:
    """The huge-page spans of a pytree's buffers, sorted, overlapping ones merged (neighbouring buffers often
    share a 2 MiB page: one span for the run)."""
    merged: list[list[int]] = []
    for start, end in sorted(s for x in jax.tree_util.tree_leaves(tree) if (s := _huge_page_span(x)) is not None):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _collapse(madvise, start: int, end: int) -> None:
    """MADV_COLLAPSE [start, end), one huge page at a time: a call over a span stops at its first page that
    cannot be collapsed."""
    for page in range(start, end, HUGE_PAGE):
        madvise(page, HUGE_PAGE, MADV_COLLAPSE)


def _huge_page_span(x: Any) -> tuple[int, int] | None:
    """[start, end) of x's buffer rounded out to whole huge pages, for a single-buffer CPU array of >= 1 MiB."""
    if not isinstance(x, jax.Array) or x.is_deleted() or x.nbytes < HUGE_PAGE // 2 or len(x.devices()) != 1:
        return None
    if next(iter(x.devices())).platform != "cpu":
        return None
    try:
        address = x.unsafe_buffer_pointer()
    except (RuntimeError, ValueError, NotImplementedError):  # not a plain buffer
        return None
    return address // HUGE_PAGE * HUGE_PAGE, -(-(address + x.nbytes) // HUGE_PAGE) * HUGE_PAGE


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise

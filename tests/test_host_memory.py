"""Huge pages for the CPU engine's weights and KV pool (jaxpaged/worker/host_memory.py)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.worker.host_memory import HUGE_PAGE, HugePageArena, advise_huge_pages, advise_zeroed_huge_pages, cpu_array_over

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's host buffers")


def huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding `address` in this process."""
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        low, high = (int(v, 16) for v in block.split()[0].split("-"))
        if low <= address < high:
            found = re.search(r"AnonHugePages:\s+(\d+) kB", block)
            return int(found.group(1)) if found else 0
    raise AssertionError(f"no mapping holds {address:#x}")


def test_big_cpu_buffers_are_advised_whole_and_keep_their_contents():
    """Each buffer's span, rounded out to whole huge pages, once (a leaf twice, small and non-array leaves
    skipped); contents and addresses unchanged."""
    values = np.arange(3 * HUGE_PAGE // 4, dtype=np.float32) % 977  # 6 MiB
    big = jax.device_put(values)
    address = big.unsafe_buffer_pointer()
    tree = {"big": big, "again": big, "small": jnp.ones((16,)), "other": 3, "none": None}
    advised = advise_huge_pages(tree)
    start, end = address // HUGE_PAGE * HUGE_PAGE, -(-(address + big.nbytes) // HUGE_PAGE) * HUGE_PAGE
    assert advised == end - start
    assert big.unsafe_buffer_pointer() == address
    np.testing.assert_array_equal(np.asarray(big), values)
    if Path("/proc/self/smaps").exists() and THP.exists() and "[never]" not in THP.read_text():
        assert huge_kib_at(start + HUGE_PAGE) > 0  # collapsed now (Linux 6.1+) or on fault


def test_nothing_to_advise():
    assert advise_huge_pages({"small": jnp.ones((8, 8)), "scalar": 1.0}) == 0
    deleted = jax.device_put(np.ones(HUGE_PAGE, np.float32))
    deleted.delete()
    assert advise_huge_pages([deleted]) == 0


def aliased(host: np.ndarray) -> jax.Array | None:
    """A CPU array over host's own memory (64-byte aligned), or None where JAX copies it."""
    x = jax.device_put(host, may_alias=True)
    return x if x.unsafe_buffer_pointer() == host.ctypes.data else None


def resident_pages(start: int, end: int) -> int:
    """How many 4 KiB pages of [start, end) (page-aligned) are in memory (mincore)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * ((end - start) // 4096))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(b & 1 for b in vec)


def test_a_zeroed_buffer_drops_its_whole_huge_pages_and_nothing_around_it():
    """advise_zeroed_huge_pages: the whole huge pages inside the buffer leave memory (they read as zeros, and
    come back on a write); the buffer's edges and the memory around it keep their contents."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("Linux only")
    raw = np.ones(8 * HUGE_PAGE // 4 + 16, np.float32)  # 16 MiB of ones around the buffer
    first = (-raw.ctypes.data % 64) // 4 + 1024 + 16  # 64-byte aligned, not on a huge page's edge
    buffer = raw[first:first + 5 * HUGE_PAGE // 4 + 1000]
    buffer[:] = 0.0
    x = aliased(buffer)
    if x is None:
        pytest.skip("JAX copies host arrays here")
    start, end = x.unsafe_buffer_pointer(), x.unsafe_buffer_pointer() + x.nbytes
    inner_start, inner_end = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    assert inner_end - inner_start >= 3 * HUGE_PAGE
    advised = advise_zeroed_huge_pages(x)
    assert advised == (-(-end // HUGE_PAGE) - start // HUGE_PAGE) * HUGE_PAGE
    assert resident_pages(inner_start, inner_end) == 0
    assert np.all(raw[:first] == 1.0) and np.all(raw[first + buffer.size:] == 1.0)
    assert not np.any(np.asarray(x)) and not np.any(buffer)
    buffer[123456] = 5.0  # a write brings its page back
    assert resident_pages(inner_start, inner_end) > 0 and np.count_nonzero(raw == 5.0) == 1


def test_an_arena_hands_out_aligned_arrays_in_order_on_huge_pages_jax_reads_in_place():
    """HugePageArena: 64-byte-aligned arrays one after another in one 2 MiB-aligned mapping (a full arena
    gives an array a mapping of its own); cpu_array_over is a jax.Array over that memory, no copy."""
    arena = HugePageArena(3 * HUGE_PAGE)
    a = arena.empty((1000, 3), np.float32)  # 12,000 bytes
    b = arena.empty((5, 64, 64), np.float32)
    base = a.ctypes.data
    assert base % HUGE_PAGE == 0 and b.ctypes.data == base + 12032  # the next 64-byte boundary
    assert a.flags.c_contiguous and b.flags.c_contiguous and b.shape == (5, 64, 64)
    full = arena.empty((3 * HUGE_PAGE // 4,), np.float32)  # 6 MiB more: past the 6 MiB region
    assert full.ctypes.data % HUGE_PAGE == 0 and not base <= full.ctypes.data < base + 3 * HUGE_PAGE
    b[:] = np.arange(b.size, dtype=np.float32).reshape(b.shape)
    x = cpu_array_over(b)
    assert x.unsafe_buffer_pointer() == b.ctypes.data
    np.testing.assert_array_equal(np.asarray(x), b)
    if THP.exists() and "[never]" not in THP.read_text():
        assert huge_kib_at(base) > 0  # born huge: touched after its advice, no collapse needed

"""Huge pages for the CPU engine's weights and KV pool (jaxpaged/host_memory.py)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.host_memory import HUGE_PAGE, advise_huge_pages

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

"""KeptRows: per-request rows kept across steps, made again exactly where their source changed."""

from __future__ import annotations

import operator

import numpy as np
import pytest

from jaxpaged.worker.kept_rows import KeptRows


def test_rows_are_made_once_per_source_and_gathered_in_step_order():
    kept, made = KeptRows(capacity=3, width=4, dtype=np.int32), []

    def make(pages):
        made.append(pages)
        return pages

    def rows(ids, sources, columns=None):
        return kept.rows(ids, sources, make, operator.eq, columns).tolist()

    assert rows(["a", "b"], [(5, 2), (9,)]) == [[5, 2, 0, 0], [9, 0, 0, 0]]
    assert rows(["b", "a"], [(9,), (5, 2)], columns=2) == [[9, 0], [5, 2]] and made == [(5, 2), (9,)]  # kept
    # a's table grew (a new page): its row alone is made again, in its slot, the rest of it cleared
    assert rows(["a", "b"], [(5, 2, 7), (9,)]) == [[5, 2, 7, 0], [9, 0, 0, 0]] and made[2:] == [(5, 2, 7)]
    assert rows(["a"], [(3,)]) == [[3, 0, 0, 0]] and len(kept) == 2  # back with other pages: no stale row
    kept.release(["a", "never-kept"])
    assert len(kept) == 1
    assert rows(["c", "d"], [(1,), (2,)]) == [[1, 0, 0, 0], [2, 0, 0, 0]] and len(kept) == 3  # b, c, d
    # b kept, e new and no slot free: every row is dropped, then the step's made again
    assert rows(["e", "b"], [(4,), (9,)]) == [[4, 0, 0, 0], [9, 0, 0, 0]] and len(kept) == 2
    assert made[-2:] == [(4,), (9,)]
    count = len(made)
    assert rows(["b", "e"], [(9,), (4,)]) == [[9, 0, 0, 0], [4, 0, 0, 0]] and len(made) == count  # both kept


def test_bad_rows_and_sizes_raise_and_keep_nothing():
    kept = KeptRows(capacity=2, width=2, dtype=np.int32)
    with pytest.raises(ValueError, match="capacity of 2"):
        kept.rows(["a", "b", "c"], [(1,)] * 3, tuple, operator.eq)
    with pytest.raises(ValueError, match="request ids repeat"):
        kept.rows(["a", "a"], [(1,), (2,)], tuple, operator.eq)
    with pytest.raises(ValueError, match="wider than 2"):
        kept.rows(["a"], [(1, 2, 3)], tuple, operator.eq)
    assert len(kept) == 0

    def refuse(source):
        raise ValueError(f"bad source {source!r}")

    with pytest.raises(ValueError, match="bad source"):
        kept.rows(["a"], ["x"], refuse, operator.eq)
    assert len(kept) == 0 and kept.rows(["a"], [(1,)], tuple, operator.eq).tolist() == [[1, 0]]
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="capacity"):
            KeptRows(capacity=bad, width=2, dtype=np.int32)
        with pytest.raises(ValueError, match="width"):
            KeptRows(capacity=2, width=bad, dtype=np.int32)

"""Rows a runner keeps per request across steps: the host side of vLLM's persistent batch.

A decode step feeds each running request one token, yet much of what the step's arrays hold per request is what
the previous step held: its page table (one more page every page_size tokens), its sampler's constants (fixed by
its params and seed). `KeptRows` holds such rows in one numpy table [C, W], one slot per request id, each row
remembering the source it was made from. A step asks for its requests' rows with their current sources: a row is
made again only where the source changed (a request's first step, a new page), and the step's rows come out of
the table in one indexing, instead of a Python pass over every request's whole data each step.

A row is never stale: an id whose source is not the one its row was made from (the same id reused, a request
preempted and back with other pages) gets its row made again. Slots go back with `release` (finished requests);
one that is never released costs room only: when a step's new requests need more free slots than there are,
every row is dropped first and made again as its request comes. `RowConstants` keeps each request's sampler
constants this way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

from jaxpaged.sample.sampling_batch import RowInfo, row_scalars, seed_key_data
from jaxpaged.sampling_params import SamplingParams


class KeptRows:
    """Rows of width W kept by request id in a table of C slots (the module docstring)."""

    def __init__(self, capacity: int, width: int, dtype, fill=0):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r}: must be an integer >= 1")
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"width={width!r}: must be an integer >= 1")
        self.capacity, self.width, self.fill = capacity, width, fill
        self._table = np.full((capacity, width), fill, dtype)  # [C, W]: slot s holds one request's row
        self._kept: dict[Hashable, tuple[object, int]] = {}  # request id -> (its row's source, slot)
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._kept)

    def rows(self, request_ids: Sequence[Hashable], sources: Sequence, make: Callable[[object], Sequence],
             same: Callable[[object, object], bool], columns: int | None = None) -> np.ndarray:
        """[n, columns] (default W): the rows of n distinct requests, request_ids[i]'s made from sources[i]. make(source):
        a row's values, up to W (the rest of the row is `fill`); same(kept source, source): whether a kept row
        still holds (made again where not)."""
        n = len(request_ids)
        if n > self.capacity:
            raise ValueError(f"{n} rows exceed the capacity of {self.capacity}")
        if len(set(request_ids)) != n:  # one slot per id: a repeated id would read its last source's row
            repeated = sorted({rid for rid in request_ids if request_ids.count(rid) > 1})
            raise ValueError(f"request ids repeat in one step: {repeated}")
        if n > len(self._free) and sum(rid not in self._kept for rid in request_ids) > len(self._free):
            self.release(list(self._kept))
        slots = np.fromiter((self._slot(rid, source, make, same) for rid, source in zip(request_ids, sources)),
                            np.intp, n)
        return self._table[slots, :columns]

    def _slot(self, request_id: Hashable, source, make: Callable, same: Callable) -> int:
        kept = self._kept.get(request_id)
        if kept is not None and same(kept[0], source):
            return kept[1]
        values = make(source)
        if len(values) > self.width:
            raise ValueError(f"request {request_id!r}: a row of {len(values)} values is wider than {self.width}")
        slot = kept[1] if kept is not None else self._free.pop()
        self._table[slot, :len(values)] = values
        self._table[slot, len(values):] = self.fill
        self._kept[request_id] = (source, slot)
        return slot

    def release(self, request_ids) -> None:
        """Forget these requests' rows (an id not kept is ignored): their slots are free again."""
        for request_id in request_ids:
            kept = self._kept.pop(request_id, None)
            if kept is not None:
                self._free.append(kept[1])


class RowConstants:
    """Each scheduled request's sampler constants (its params' `row_scalars`, its seed's key data), kept across its
    steps by request id (`KeptRows`): a step gathers them instead of reading every row's params again.
    A request's row is made again whenever its params object or seed is not the one it was made from."""

    def __init__(self, vocab_size: int, capacity: int):
        self.vocab_size = vocab_size
        self._kept = KeptRows(capacity, 9, np.float64)  # f64[C, 9]: row_scalars, then the key data's two words

    def __len__(self) -> int:
        return len(self._kept)

    def gather(self, rows: Sequence[tuple[str, SamplingParams, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(f64[n, 7] scalars, u32[n, 2] key data) of n rows given as (request id, params, seed), distinct ids."""
        table = self._kept.rows([rid for rid, _, _ in rows], [(params, seed) for _, params, seed in rows],
                                self._make, _same_params_and_seed)
        return table[:, :7], table[:, 7:].astype(np.uint32)

    def _make(self, source: tuple[SamplingParams, int]) -> tuple:
        params, seed = source
        RowInfo(params, seed)  # validates
        return (*row_scalars(params, self.vocab_size), *seed_key_data(seed).tolist())

    def release(self, request_ids) -> None:
        """Forget these requests (finished); an id not kept is ignored."""
        self._kept.release(request_ids)


def _same_params_and_seed(kept: tuple[SamplingParams, int], source: tuple[SamplingParams, int]) -> bool:
    return kept[0] is source[0] and kept[1] == source[1]

"""The runner's persistent batch: each scheduled request's row, kept across its steps, updated by the scheduler's diffs.

A decode step feeds each running request one token, yet most of what the step's arrays hold per request is what
the previous step held: its page table (one more page every page_size tokens) and its sampler's constants (fixed by
its params and seed). `InputBatch` keeps them in preallocated numpy rows, one row per request id (vLLM v1's
persistent input batch, host side):

    page_table  i32[C, P]  the request's pages, then the null page 0
    num_pages   i32[C]     pages in its table
    scalars     f64[C, 7]  `row_scalars` of its params
    key_data    u32[C, 2]  its seed's key data
    biased      bool[C]    its params have a logit bias or penalties (its sampler row needs more than constants)
    logprobs    bool[C]    its params ask for log-probs
    banning     bool[C]    its params have min_tokens (its rows may ban ids: `Request.banned_token_ids_at`)
    prompt_lp   bool[C]    its params ask for prompt log-probs
    constrained bool[C]    its params have a grammar (structured outputs)

(The flags let a step ask "does any row need this?" with one indexing, not a pass over its entries.)

(C = capacity rows, P = max pages a sequence.) The scheduler sends a page table as a diff
(`ScheduledRequest.page_ids_from`, `page_ids`): the table is the row's first page_ids_from pages followed by
page_ids. page_ids_from 0 makes the row anew, constants included (a request's first step, its return after
preemption, a page freed out of a sliding window); a decode that fills no new page sends nothing, so `apply` costs
one dict lookup and one comparison for it. A step's arrays then come out of the rows in one indexing.

Rows go with `remove`: the runner removes the requests each SchedulerOutput names finished or preempted, so a row is
never stale (an id that comes back after either is sent whole). Rows live for running requests and for those that
finished since the last step: 2 x max_num_seqs rows always suffice; running out is a bug and raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.sample.sampling_batch import RowInfo, row_scalars, seed_key_data


class InputBatch:
    """Rows kept by request id (the module docstring): apply a step's diffs, gather its rows."""

    def __init__(self, capacity: int, max_pages: int, vocab_size: int):
        for name, value in (("capacity", capacity), ("max_pages", max_pages), ("vocab_size", vocab_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"InputBatch {name}={value!r}: must be an integer >= 1")
        self.capacity, self.max_pages, self.vocab_size = capacity, max_pages, vocab_size
        self.page_table = np.zeros((capacity, max_pages), np.int32)  # i32[C, P]
        self.num_pages = np.zeros(capacity, np.int32)  # i32[C]
        self.scalars = np.zeros((capacity, 7), np.float64)  # f64[C, 7]: row_scalars
        self.key_data = np.zeros((capacity, 2), np.uint32)  # u32[C, 2]
        self.biased = np.zeros(capacity, bool)  # bool[C]
        self.logprobs = np.zeros(capacity, bool)  # bool[C]
        self.banning = np.zeros(capacity, bool)  # bool[C]
        self.prompt_lp = np.zeros(capacity, bool)  # bool[C]
        self.constrained = np.zeros(capacity, bool)  # bool[C]
        self._rows: dict[str, int] = {}  # request id -> its row
        self._pages: list[int] = [0] * capacity  # num_pages as Python ints: `apply`'s check per entry
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def apply(self, entries: Sequence[ScheduledRequest]) -> np.ndarray:
        """intp[n]: the rows of a step's n entries (distinct request ids), in order, each made or updated from its
        entry's diff first. ValueError for an entry the rows cannot hold (its diff starts past the pages its row
        holds, or it has none; too many pages; ids repeated), RuntimeError when no row is free."""
        found = []  # the rows as Python ints (a list append is a fifth of a numpy element write)
        index, pages = self._rows, self._pages
        for entry in entries:
            row, start = index.get(entry.request_id), entry.page_ids_from
            if start == 0:
                row = self._make(entry, row)
            elif row is None or start > pages[row]:
                raise ValueError(f"request {entry.request_id!r}: its page table continues at page {start}, but the "
                                 f"batch holds {'no row' if row is None else f'{pages[row]} pages'} for it")
            elif entry.page_ids or start != pages[row]:
                self._write_pages(row, start, entry.page_ids, entry.request_id)
            found.append(row)
        rows = np.array(found, np.intp)
        if len(set(found)) != len(found):  # one row per id: a repeat would share it
            ids = [e.request_id for e in entries]
            raise ValueError(f"request ids repeat in one step: {sorted({r for r in ids if ids.count(r) > 1})}")
        return rows

    def may_need_row_info(self, entries: Sequence[ScheduledRequest], rows: np.ndarray, drafts: bool = True) -> list[int]:
        """The indices of a step's entries (at `rows`, `apply`'s) whose sampler rows may need more than their kept
        constants (`sampling_batch.needs_row_info`): params with a logit bias or penalties (a kept flag), banned
        ids (only where the params have min_tokens: a kept flag) or drafts this step (drafts False: the caller
        knows no entry has any); increasing. The rest (most decodes) are never looked at again."""
        biased, banning = self.biased[rows], self.banning[rows]
        maybe = set(np.flatnonzero(biased).tolist()) if biased.any() else set()
        if banning.any():
            maybe.update(i for i in np.flatnonzero(banning).tolist() if entries[i].banned_token_ids)
        if drafts:
            maybe.update(i for i, e in enumerate(entries) if e.spec_token_ids)
        return sorted(maybe)

    def any_flag(self, flag: np.ndarray, rows: np.ndarray) -> bool:
        """Whether any of `rows` has the kept flag (`banning`, `prompt_lp`, `constrained`, ...)."""
        return bool(flag[rows].any())

    def _make(self, entry: ScheduledRequest, row: int | None) -> int:
        """The entry's row made anew (its whole page table, its constants), in its old row if it has one."""
        RowInfo(entry.sampling_params, entry.seed)  # validates
        scalars = row_scalars(entry.sampling_params, self.vocab_size)
        key_data = seed_key_data(entry.seed)
        if row is None:
            if not self._free:
                raise RuntimeError(f"the input batch's {self.capacity} rows are all taken: requests finished or "
                                   "preempted were never removed")
            row = self._free.pop()
            self._rows[entry.request_id] = row
        try:
            self._write_pages(row, 0, entry.page_ids, entry.request_id)
        except ValueError:
            self.remove([entry.request_id])
            raise
        self.scalars[row], self.key_data[row] = scalars, key_data
        params = entry.sampling_params
        self.biased[row] = bool(params.logit_bias or params.uses_penalties)
        self.logprobs[row] = params.logprobs is not None
        self.banning[row] = bool(params.min_tokens)
        self.prompt_lp[row] = params.prompt_logprobs is not None
        self.constrained[row] = params.structured_outputs is not None
        return row

    def _write_pages(self, row: int, start: int, page_ids: Sequence[int], request_id: str) -> None:
        """The row's table: its first `start` pages, then page_ids; the rest of the row cleared (a table cut back
        after rejected drafts)."""
        end = start + len(page_ids)
        if end > self.max_pages:
            raise ValueError(f"request {request_id!r}: a page table of {end} pages is longer than {self.max_pages}")
        table = self.page_table[row]
        table[start:end] = page_ids
        table[end:max(end, self._pages[row])] = 0
        self.num_pages[row] = self._pages[row] = end

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forget these requests' rows (finished or preempted; an id without a row is ignored)."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self.page_table[row, :self._pages[row]] = 0
                self.num_pages[row] = self._pages[row] = 0
                self._free.append(row)

"""Draft verification on the device: where a step's drafts sit, their acceptance, and drafts proposed again.

A verification step feeds each drafting request its last token and d drafts; `DraftRows` says which logits rows
verify them, `accept_drafts` / `verify_packed` count the accepted prefix (the sampler's own draws, so the tokens
are those of a step without drafts), and `redraft_in_flight` proposes on the device the drafts of a request whose
previous step (a verification, maybe) is still in flight, from that step's real outcome: the host reserved their
slots only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.sample.sampler import SamplerOutput, fetch
from jaxpaged.sample.sampling_batch import RowInfo
from jaxpaged.spec_decode.ngram import ngram_drafts


@dataclasses.dataclass(frozen=True)
class DraftRows:
    """Where one step verifies its drafts: the draft positions of the M' entries that fed drafts, on a grid
    of M slots (a `draft_seq_buckets` size) x k positions (num_speculative_tokens).

    packed: the drafts fit in the step's padding logits rows (L - len(entries) of them: L = S, or T for a
    `verify_buckets` shape, which `prepare` picks when they do not fit in S; with the fused sampler `prepare`
    picks an S bucket with room for them, up to max_num_seqs rows): the forward's own LM head
    computes their logits (step.logits_indices points those rows at the draft positions) and they are sampled
    with the entries' rows, in one call. Otherwise the runner's `draft_logits` (worker/step_program.py) computes
    them from the forward's hidden states, M * k rows: a second pass over the LM head's weights (batch 1 on CPU,
    k = 7: the 8-token step's forward 25.9 ms, then 4.7 ms for that pass, its sampler call and their sync).
    """

    packed: bool
    request_ids: tuple[str, ...]  # the entries that fed drafts, in step order (slots 0..M'-1)
    num_drafts: tuple[int, ...]  # d of each
    sample_rows: np.ndarray  # i32[M, k]: the sampler row of each draft position (padding: row 0)
    draft_ids: np.ndarray  # i32[M, k]; -1 for no draft (never accepted)
    token_index: np.ndarray  # i32[N]: the fed token whose logits each draft row takes (N rows, in row order)
    rows: tuple[RowInfo, ...]  # the N draft rows' sampler state
    # i32[M, k] on the device (numpy once fetched, `VerifiedDrafts.to_host`): draft_ids with the slots the device
    # proposed (`redraft_in_flight`), the drafts fed and verified; None: draft_ids are
    redrafted: np.ndarray | jax.Array | None = None

    @property
    def verified_ids(self) -> np.ndarray | jax.Array:
        """i32[M, k]: the drafts the step feeds and verifies."""
        return self.draft_ids if self.redrafted is None else self.redrafted

    def slot_arrays(self, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(draft_rows, draft_ids) i32[S, k] of a fused step (S = num_rows >= M): slot m's sample rows and drafts at
        row m, the rest as `no_draft_slots`."""
        draft_rows, draft_ids = no_draft_slots(num_rows, self.draft_ids.shape[1])
        n = len(self.request_ids)
        draft_rows[:n], draft_ids[:n] = self.sample_rows[:n], self.draft_ids[:n]
        return draft_rows, draft_ids


def no_draft_slots(num_rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(draft_rows i32[S, k] of zeros, draft_ids i32[S, k] of -1): a fused step's draft inputs with no drafts."""
    return np.zeros((num_rows, k), np.int32), np.full((num_rows, k), -1, np.int32)


@dataclasses.dataclass(frozen=True)
class VerifiedDrafts:
    """One step's draft verification: the draft rows' samples and the accepted drafts of each slot."""

    layout: DraftRows
    sampled: SamplerOutput  # holds the draft rows (at layout.sample_rows); numpy after `to_host`
    num_accepted: np.ndarray  # i32[M]: leading draft positions whose sample equals the draft

    def to_host(self) -> VerifiedDrafts:
        """On the host, with the drafts the device proposed (`DraftRows.redrafted`): what the engine counts."""
        sampled, num_accepted, redrafted = fetch((self.sampled, self.num_accepted, self.layout.redrafted))
        layout = self.layout if redrafted is None else dataclasses.replace(self.layout, redrafted=redrafted)
        return dataclasses.replace(self, layout=layout, sampled=sampled, num_accepted=num_accepted)

    def num_drafts_fed(self, m: int) -> int:
        """Slot m's drafts fed and verified: those the host or the device proposed (-1: a slot it found none for)."""
        return int(np.sum(np.asarray(self.layout.verified_ids[m, :self.layout.num_drafts[m]]) >= 0))

    def token_rows(self, m: int, first_row: int, main_row: int) -> tuple[int, ...]:
        """Slot m's emitted rows, `sampled`'s numbered from `first_row` on: its a accepted drafts' rows, then
        the row of the first rejected position, or `main_row` (the bonus token) when all d were accepted."""
        a, rows = int(self.num_accepted[m]), self.layout.sample_rows[m]
        last = (first_row + int(rows[a]),) if a < self.layout.num_drafts[m] else (main_row,)
        return tuple(first_row + int(r) for r in rows[:a]) + last


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Redraft:
    """A step's drafts proposed on the device (`redraft_in_flight`), on X slots (the largest
    `RunnerConfig.draft_seq_buckets` size, whatever the step's M: one shape for every program that takes them)."""

    drafts: jax.Array  # i32[X, k]: slot m's drafts where `proposed` (-1: none, never accepted)
    proposed: jax.Array  # bool[X]: whether the device proposed slot m's drafts (its request's step was in flight)
    first: jax.Array  # i32[X]: the step's token index of slot m's fed token (its drafts follow it)

    @classmethod
    def none(cls, num_slots: int, k: int) -> Redraft:
        return cls(np.full((num_slots, k), -1, np.int32), np.zeros(num_slots, bool), np.zeros(num_slots, np.int32))


@functools.partial(jax.jit, static_argnums=(10, 11))
def redraft_in_flight(draft_ids: jax.Array, history: jax.Array, known: jax.Array, num_previous: jax.Array,
                      rows: jax.Array, tokens: jax.Array, rejected: jax.Array, first: jax.Array, previous: Redraft,
                      previous_slots: jax.Array, num_slots: int, lookup: tuple[int, int]) -> tuple[jax.Array, Redraft]:
    """The drafts of the slots whose request's previous step is in flight (async scheduling: the host reserved
    their count only), proposed on the device from that step's real outcome: the n-gram lookup (`ngram_drafts`).
    Per slot m of M: draft_ids i32[M, k] (the host's; their count d is kept), history i32[M, H] (the known tokens,
    known i32[M] of them, then the num_previous i32[M] drafts the step in flight verifies, as the host proposed
    them), rows i32[M] (the slot's row in that step, -1: the host's drafts, kept as they are), tokens and rejected
    i32[R] (`PendingStep.carry`), first i32[M] (the slot's fed token's index in the step), previous: the step in
    flight's own Redraft (its drafts where the device proposed them) and previous_slots i32[M] (the slot's there;
    out of range: none). Returns (draft_ids i32[M, k], the Redraft on num_slots slots)."""
    M, k = draft_ids.shape
    row = jnp.maximum(rows, 0)
    accepted, token = num_previous - rejected[row], tokens[row]  # i32[M] each: the real outcome
    proposed = rows >= 0  # bool[M]
    X, slot = previous.drafts.shape[0], jnp.minimum(previous_slots, previous.drafts.shape[0] - 1)
    fed_again = (previous_slots < X) & previous.proposed[slot]  # bool[M]: the drafts in flight are the device's
    j = jnp.arange(previous.drafts.shape[1])  # the drafts in flight: at known + j
    at = jnp.where(fed_again[:, None] & (j[None] < num_previous[:, None]), known[:, None] + j[None], history.shape[1])
    history = history.at[jnp.arange(M)[:, None], at].set(previous.drafts[slot], mode="drop")
    sequence = history.at[jnp.arange(M), known + accepted].set(token)  # i32[M, H]: known + accepted + token
    drafts = ngram_drafts(sequence, known + accepted + 1, k, *lookup)  # i32[M, k]
    drafts = jnp.where(jnp.arange(k)[None] < jnp.sum(draft_ids >= 0, axis=1)[:, None], drafts, -1)
    draft_ids = jnp.where(proposed[:, None], drafts, draft_ids)
    redraft = Redraft(jnp.full((num_slots, k), -1, jnp.int32).at[:M].set(draft_ids),
                      jnp.zeros((num_slots,), bool).at[:M].set(proposed),
                      jnp.zeros((num_slots,), jnp.int32).at[:M].set(first))
    return draft_ids, redraft


def merge_redrafts(draft_ids: jax.Array, redraft: Redraft) -> jax.Array:
    """draft_ids i32[N, k] (slot m's drafts at row m) with the slots the device proposed replaced."""
    n, draft_ids = min(draft_ids.shape[0], redraft.drafts.shape[0]), jnp.asarray(draft_ids)
    return draft_ids.at[:n].set(jnp.where(redraft.proposed[:n, None], redraft.drafts[:n], draft_ids[:n]))


@jax.jit
def accept_drafts(sampled: jax.Array, sample_rows: jax.Array, draft_ids: jax.Array) -> jax.Array:
    """sampled i32[N] (a sampler call's tokens), sample_rows i32[M, k] (the row of each draft position),
    draft_ids i32[M, k] (-1: no draft) -> i32[M], the accepted drafts of each slot: the leading positions
    whose sample is the draft. Rejection sampling of a point-mass draft (see jaxpaged/spec_decode/ngram.py)."""
    match = (sampled[sample_rows] == draft_ids).astype(jnp.int32)  # i32[M, k]
    return jnp.sum(jnp.cumprod(match, axis=1), axis=1)


def verify_packed(layout: DraftRows, sampled: SamplerOutput, fused_sample: SamplerOutput | None = None,
                  num_accepted: jax.Array | None = None) -> VerifiedDrafts:
    """The drafts verified on the final samples of their rows (`sampled` holds them at layout.sample_rows): a
    fused step's own count (`num_accepted`, of `fused_sample`), unless a sampler fallback changed a token, else
    `accept_drafts` on the device."""
    if fused_sample is not None and sampled.token_ids is fused_sample.token_ids:
        return VerifiedDrafts(layout, sampled, num_accepted)
    return VerifiedDrafts(layout, sampled, accept_drafts(sampled.token_ids, layout.sample_rows, layout.verified_ids))


def _pad_bitmask(bitmask: np.ndarray | None, S: int, num_rows: int) -> np.ndarray | None:
    """The first num_rows rows of a grammar bitmask as the sampler's i32[S, W] (padding rows allow all)."""
    if bitmask is None:
        return None
    padded = np.full((S, bitmask.shape[1]), -1, np.int32)
    padded[:num_rows] = bitmask[:num_rows]
    return padded


def _check_bitmask(bitmask: np.ndarray | None, entries: Sequence[ScheduledRequest]) -> np.ndarray | None:
    """The engine's grammar bitmask, checked: i32[len(entries) + D, W], D the step's drafts (execute_model)."""
    rows = len(entries) + sum(len(e.spec_token_ids) for e in entries)
    if bitmask is not None and (bitmask.ndim != 2 or bitmask.shape[0] != rows):
        raise ValueError(f"grammar_bitmask has shape {bitmask.shape}; expected ({rows}, W): a row per entry, "
                         "then one per draft")
    return bitmask


def _draft_bitmask(layout: DraftRows, bitmask: np.ndarray | None) -> np.ndarray | None:
    """i32[M * k, W]: the grammar bitmask of unpacked draft rows (the engine's last D rows hold the drafts'
    masks, in step order), padding rows allowing all; None without a bitmask."""
    if bitmask is None:
        return None
    rows = np.concatenate([layout.sample_rows[m, :d] for m, d in enumerate(layout.num_drafts)])
    out = np.full((len(layout.rows), bitmask.shape[1]), -1, np.int32)
    out[rows] = bitmask[len(bitmask) - len(rows):]
    return out

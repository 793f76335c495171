"""N-gram (prompt-lookup) speculative decoding: the config, the host-side proposer and the stats.

How a step speculates (vLLM v1's design, with an n-gram proposer):

1. Before `Scheduler.schedule()`, the engine asks `NgramProposer.propose` for each decoding
   request: the tokens that followed the earliest occurrence of the request's last n tokens
   (n from prompt_lookup_max down to prompt_lookup_min) in its prompt + output, at most
   `num_speculative_tokens` of them, bounded by what max_tokens / max_model_len leave. They
   become `Request.spec_token_ids`.
2. The scheduler feeds the last token and the d drafts in one chunk (1 + d tokens of the step's
   budget, pages for all of them, one of the `max_num_partial_prefills` slots: attention tiles
   a multi-token sequence like a prefill chunk; no free slot or no pages: no drafts).
3. The runner samples every fed position of such a request with the request's own sampler,
   position j keyed as output token num_output_tokens + j would be without speculation
   (fold_in(PRNGKey(seed), step)), its penalties counting the drafts before it, and counts on
   the device the drafts accepted: the leading j with sample_j == draft_j. The request emits
   samples 0..a (a accepted, then the first mismatch, or the bonus token after all d).
   An n-gram draft is a point mass q = delta(x), so this is exactly rejection sampling: x is
   accepted with probability min(1, p(x) / q(x)) = p(x), and a rejection samples from
   norm(max(0, p - q)), which is p without x, what sample_j is given that it differs from x. The
   emitted tokens are therefore token for token those decoding without speculation would emit
   from the same logits (greedy and seeded sampling alike), whatever the batch.
4. `Scheduler.update_from_output` appends the emitted tokens (the engine cuts them at the first
   stop: EOS, stop ids, stop strings, max_tokens), then rolls back the rejected drafts:
   num_computed_tokens counts the accepted ones only, pages past it go back to the pool, and
   only full pages of real (accepted) tokens are hashed into the prefix cache.

Under async scheduling, for a request whose step is still in flight, the host reserves only the number of draft
slots and the device proposes their content (`ngram_drafts`) from that step's real outcome:
jaxpaged/engine/drafting.py says how, and why 3. still holds. A request under a grammar drafts the tokens it
forces, then n-gram ones, cut to those it allows, each position sampled under the mask decoding without
speculation would use there (`Drafting._grammar_drafts`, `StructuredOutputManager.fill_bitmask_with_drafts`). Which
drafts a step verifies (`DraftLengthPolicy`) never changes the tokens emitted (3.), only how many steps they take.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SPECULATIVE_METHODS = ("ngram",)
_DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default n when neither prompt_lookup bound is given


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for the n-gram method (the only one here)."""

    method: str = "ngram"
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # longest n-gram matched; default: prompt_lookup_min, else 5
    prompt_lookup_min: int | None = None  # shortest n-gram matched; default: prompt_lookup_max, else 5
    # vLLM's key: no drafts while more than this many requests are enqueued (running + waiting), checked
    # every step, so speculation resumes as the batch drains. None: always draft (beside requests without
    # drafts, only into rows that cost them nothing: Scheduler._draft_room).
    disable_by_batch_size: int | None = None
    # jaxpaged's own key: verify only the drafts expected to pay for their rows (DraftLengthPolicy); False:
    # every draft the proposer finds, up to num_speculative_tokens (vLLM's behaviour)
    adaptive_draft_length: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r}: choose one of {SPECULATIVE_METHODS}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 2)  # vLLM's bound
        if not isinstance(self.adaptive_draft_length, bool):
            raise ValueError(f"speculative_config.adaptive_draft_length={self.adaptive_draft_length!r}: "
                             "must be true or false")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = _DEFAULT_PROMPT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        _check_int("prompt_lookup_min", lo, 1)
        _check_int("prompt_lookup_max", hi, 1)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)  # defaults resolved once, at construction
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | str) -> SpeculativeConfig:
        """From vLLM's dict (or its JSON text); unknown keys and bad values are a ValueError."""
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from None
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(config).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens (drafts verified per step)")
        return cls(**config)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"speculative_config.{name}={value!r}: must be an integer >= {minimum}")


class NgramProposer:
    """Prompt lookup: drafts are the tokens after the earliest match of the sequence's suffix."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_drafts: int | None = None, skip: int = 0) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) draft tokens to follow `token_ids`, or [].
        skip: the drafts to follow `skip` more tokens, not known yet (async scheduling's token in flight), taken
        to be the match's next ones: the drafts then start `skip` tokens further on.

        The longest suffix of n tokens (prompt_lookup_min <= n <= prompt_lookup_max) that also occurs
        earlier wins; among its earlier occurrences, the earliest (as vLLM's proposer); the drafts are
        the tokens after it. The earliest is most often in the prompt's own text, the source an answer
        copies; a later one is often a phrase that recurs with another continuation ("in 2015 ... in
        2019"). At batch 1 on CPU, SmolLM2 on copy-heavy prompts, the latest gave 1.79x / 1.74x over
        no speculation and the earliest 1.84x / 1.85x.
        """
        c = self.config
        k = c.num_speculative_tokens if max_drafts is None else min(c.num_speculative_tokens, max_drafts)
        return self.continuation(token_ids, skip + k)[skip:] if k >= 1 else []

    def continuation(self, token_ids: Sequence[int] | np.ndarray, n: int) -> list[int]:
        """Up to n tokens after the match `propose` picks (not capped at num_speculative_tokens), or []."""
        c = self.config
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        if n < 1 or last < c.prompt_lookup_min:
            return []
        ends = np.flatnonzero(tokens[:last] == tokens[last])  # i64[C]: candidate match ends e < last
        length = np.ones(len(ends), np.int64)  # i64[C]: suffix tokens matched so far at each end
        alive = np.ones(len(ends), bool)
        for j in range(1, c.prompt_lookup_max):
            starts = ends - j
            alive &= starts >= 0
            alive[alive] &= tokens[starts[alive]] == tokens[last - j]
            if not alive.any():
                break
            length += alive
        good = np.flatnonzero(length >= c.prompt_lookup_min)
        if good.size == 0:
            return []
        best = good[length[good] == length[good].max()][0]  # the longest match, earliest among equals
        end = int(ends[best])
        return tokens[end + 1:end + 1 + n].tolist()


def ngram_drafts(tokens: jax.Array, lengths: jax.Array, k: int, lookup_min: int, lookup_max: int) -> jax.Array:
    """`NgramProposer.continuation` on the device, one sequence a row: tokens i32[M, H] (row m's first lengths[m]
    are its sequence; the rest is ignored), lengths i32[M] -> i32[M, k], the k tokens after the match the
    proposer picks (the longest suffix of lookup_min..lookup_max tokens also found earlier, its earliest
    occurrence), -1 past the sequence's end or where nothing matches. The reference: NgramProposer."""
    M, H = tokens.shape
    last = lengths - 1  # i32[M]
    ends = jnp.arange(H)  # i32[H]: candidate match ends e (the match's last token at e)
    run = jnp.ones((M, H), bool)  # bool[M, H]: the j tokens up to e all equal those up to `last`
    matched = jnp.zeros((M, H), jnp.int32)  # i32[M, H]: suffix tokens matched at each e
    for j in range(lookup_max):
        tail = jnp.take_along_axis(tokens, jnp.maximum(last - j, 0)[:, None], axis=1)  # i32[M, 1]
        run &= (ends >= j)[None] & (tokens[:, jnp.maximum(ends - j, 0)] == tail)
        matched += run
    good = (ends[None] < last[:, None]) & (matched >= lookup_min) & (last[:, None] >= lookup_min)  # bool[M, H]
    score = jnp.where(good, matched * H + (H - 1 - ends[None]), -1)  # the longest, then the earliest
    end = jnp.argmax(score, axis=1)  # i32[M]
    at = end[:, None] + 1 + jnp.arange(k)[None]  # i32[M, k]
    ok = (jnp.max(score, axis=1) >= 0)[:, None] & (at <= last[:, None])
    return jnp.where(ok, jnp.take_along_axis(tokens, jnp.minimum(at, H - 1), axis=1), -1)


def max_drafts_for(num_tokens: int, num_output_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """Drafts a request may verify now: its 1 + d emitted tokens stay within max_tokens and max_model_len."""
    room = max_model_len - num_tokens - 1
    if max_tokens is not None:
        room = min(room, max_tokens - num_output_tokens - 1)
    return max(0, room)


class DraftLengthPolicy:
    """Adaptive draft length: which of the proposed drafts a step verifies, for the most tokens a second.

    Model: a step feeding n rows takes t(n) seconds: the median of this engine's last STEP_SAMPLES steps
    of only decodes that fed n rows (the first such step not counted: it may have compiled or touched
    memory for the first time), once MIN_SAMPLES are in (one slow step, a pause, then does not move it: a
    size judged on a pause could be cut and never timed again), made non-decreasing in n
    (weighted pool-adjacent-violators: a row never makes a step cheaper, so one noisy size does not steer
    the plan); n not timed yet: interpolated between the nearest timed, or, past the largest, as cheap as
    it, so a larger step is tried. A request's first draft is accepted with probability p, its own rate;
    draft j > 1, given the ones before it were, with probability c_j, the engine's rate at that position
    (a copied span goes on: on text that copies, c_j is well above p). So its j-th draft adds
    p c_2 ... c_j expected tokens. For B decoding requests the step keeps the m drafts of largest gain
    (each request's first ones) that maximise (B + their gains) / t(B + m); m = 0 where no draft pays.
    Unless that beats verifying every draft by MARGIN, every draft is verified: where rows cost little (a
    GPU, float32 on a CPU) the estimates' noise would otherwise cut drafts that pay.

    p per request: its verifications whose first draft was accepted over all its verifications, both
    decayed by DECAY each verification so p follows the text (a copied span, then new words), with
    PRIOR_WEIGHT pseudo-verifications at the engine's c_1. A request that proposes but verifies nothing
    decays too, back toward c_1, so it tries again. c_j: accepted over verified at position j, over the
    engine's recent verifications (POSITION_DECAY each), with 2 pseudo-drafts at c_{j-1} (c_1: at 1 / 2):
    a position rarely verified (where rows cost arithmetic, past the first few) is taken to be as likely
    as the one before it (acceptance given a run of accepted drafts rises with the run), not as 1 / 2.
    """

    DECAY = 0.7  # weight of a request's older verifications, per verification
    PRIOR_WEIGHT = 1.0  # pseudo-verifications at the engine-wide first-draft rate
    POSITION_DECAY = 0.995  # weight of the engine's older verifications in c_j, per verification
    STEP_SAMPLES = 5  # step times kept per row count; t(n) is their median
    MIN_SAMPLES = 3  # step times a row count needs before its median counts
    MARGIN = 0.03  # the least gain in expected tokens a second for which drafts are left out
    SLOWDOWN = 0.05  # what drafts may add to a step that carries a decode without drafts

    def __init__(self, num_speculative_tokens: int):
        self.step_times: dict[int, collections.deque] = {}  # n rows -> the last decode-only steps' seconds
        self._medians: dict[int, float] = {}  # n rows -> the median of step_times[n] (sizes timed)
        self.verified = np.zeros(num_speculative_tokens)  # f64[k]: draft j fed after accepted ones (decayed)
        self.accepted = np.zeros(num_speculative_tokens)  # f64[k]: ... and accepted

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A step that fed only decodes (and their drafts), num_rows in all, took `seconds` end to end."""
        times = self.step_times.get(num_rows)
        if times is None:  # the first of its size: not timed
            self.step_times[num_rows] = collections.deque(maxlen=self.STEP_SAMPLES)
            return
        times.append(seconds)
        if len(times) >= self.MIN_SAMPLES:
            self._medians[num_rows] = statistics.median(times)

    def step_seconds(self) -> dict[int, float]:
        """t(n) as measured: the median step time by row count (sizes timed so far)."""
        return dict(sorted(self._medians.items()))

    def step_cost(self) -> tuple[list[int], np.ndarray]:
        """The row counts timed and t(n) there made non-decreasing: pool adjacent violators, each size
        weighted by its samples."""
        measured = self.step_seconds()
        blocks: list[list[float]] = []  # [mean, weight, sizes pooled]
        for n, seconds in measured.items():
            blocks.append([seconds, len(self.step_times[n]), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (a, wa, na), (b, wb, nb) = blocks.pop(-2), blocks.pop()
                blocks.append([(a * wa + b * wb) / (wa + wb), wa + wb, na + nb])
        return list(measured), np.repeat([b[0] for b in blocks], [b[2] for b in blocks])

    def observe_verification(self, request, num_drafts: int, num_accepted: int, num_forced: int = 0) -> None:
        """`request` verified num_drafts drafts; the leading num_accepted were accepted. The leading num_forced
        were forced by its grammar: what follows them counts as a verification of its own, if all were accepted
        (a forced draft is nearly always accepted: counted, it would inflate every estimate)."""
        if num_forced:
            if num_accepted < num_forced or num_drafts == num_forced:
                return
            num_drafts, num_accepted = num_drafts - num_forced, num_accepted - num_forced
        first = int(num_accepted > 0)
        request.spec_first_accepted = self.DECAY * request.spec_first_accepted + first
        request.spec_first_rejected = self.DECAY * request.spec_first_rejected + 1 - first
        self.verified *= self.POSITION_DECAY
        self.accepted *= self.POSITION_DECAY
        self.verified[:min(num_accepted + 1, num_drafts)] += 1
        self.accepted[:num_accepted] += 1

    def position_rates(self) -> np.ndarray:
        """c: f64[k], c[j] = P(draft j + 1 accepted | the drafts before it were), engine-wide."""
        rates, before = np.empty_like(self.verified), 0.5
        for j, (accepted, verified) in enumerate(zip(self.accepted, self.verified)):
            rates[j] = before = (accepted + 2 * before) / (verified + 2)
        return rates

    def first_draft_rate(self, request, rates: np.ndarray | None = None) -> float:
        """p: the estimated probability that the request's next first draft is accepted (rates: position_rates())."""
        seen = request.spec_first_accepted + request.spec_first_rejected
        prior = (self.position_rates() if rates is None else rates)[0]
        return (request.spec_first_accepted + self.PRIOR_WEIGHT * prior) / (seen + self.PRIOR_WEIGHT)

    def gains(self, request, num_drafts: int, rates: np.ndarray | None = None) -> np.ndarray:
        """f64[num_drafts]: the expected tokens each of the request's drafts adds (p, p c_2, p c_2 c_3, ...).
        Draft slots whose content the device proposes (a request in flight, async scheduling) weigh the same."""
        rates = self.position_rates() if rates is None else rates
        return np.cumprod([self.first_draft_rate(request, rates), *rates[1:num_drafts]])

    def trim(self, requests: Sequence) -> None:
        """Cut each decoding request's `spec_token_ids` (the proposer's drafts) to the plan's length; drafts a
        grammar forces (`spec_num_forced`, a token a row) are kept, the plan's rows counting them."""
        drafting = [r for r in requests if len(r.spec_token_ids) > r.spec_num_forced]
        if not drafting:
            return
        rates = self.position_rates()
        keep = self.plan(len(requests) + sum(r.spec_num_forced for r in requests),
                         [self.gains(r, len(r.spec_token_ids) - r.spec_num_forced, rates) for r in drafting],
                         without_drafts=sum(not r.spec_token_ids for r in requests))
        for request, count in zip(drafting, keep):
            if count == 0:  # proposed, nothing verified: forget a little, so it tries again
                request.spec_first_accepted *= self.DECAY
                request.spec_first_rejected *= self.DECAY
            del request.spec_token_ids[request.spec_num_forced + count:]

    def plan(self, num_requests: int, gains: Sequence[np.ndarray], without_drafts: int = 0) -> list[int]:
        """Drafts to keep of each request's proposal (its drafts' expected tokens, falling) in a step of
        num_requests decodes, `without_drafts` of which have none: those must not be slowed (issue 17), so then
        the step keeps only drafts that cost it at most SLOWDOWN more than none (under async scheduling a
        verification's synchronous step costs a GPU's whole host time: there none)."""
        rows, cost = self.step_cost()
        if not gains or not rows:  # nothing timed yet: verify them all
            return [len(g) for g in gains]
        owner = np.repeat(np.arange(len(gains)), [len(g) for g in gains])  # i64[D]
        gain = np.concatenate(gains)  # f64[D]
        order = np.argsort(-gain, kind="stable")  # each request's drafts stay in order (their gains fall)
        tokens = num_requests + np.concatenate([[0.0], np.cumsum(gain[order])])  # f64[D+1]: with m drafts
        seconds = np.interp(num_requests + np.arange(len(order) + 1), rows, cost)
        rate = tokens / seconds  # f64[D+1]: expected tokens a second with m drafts
        m = int(np.argmax(rate))  # the first best: ties keep fewer rows
        if rate[m] < (1 + self.MARGIN) * rate[-1]:
            m = len(order)
        if without_drafts:  # seconds never falls with rows: the allowed sizes are a prefix
            m = min(m, int(np.sum(seconds <= (1 + self.SLOWDOWN) * seconds[0])) - 1)
        return np.bincount(owner[order[:m]], minlength=len(gains)).tolist()


@dataclasses.dataclass
class SpecDecodingStats:
    """vLLM's spec-decode counters (served as vllm:spec_decode_*), engine-lifetime totals."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verifications: one per request per step that fed drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)  # [k]

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: d drafts fed, the leading a of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def as_stats(self) -> dict[str, Any]:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": tuple(self.num_accepted_tokens_per_pos)}

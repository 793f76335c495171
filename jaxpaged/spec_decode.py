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

Not drafted: requests with structured outputs (their grammar would have to vet each draft).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

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

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r}: choose one of {SPECULATIVE_METHODS}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 2)  # vLLM's bound
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

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) draft tokens to follow `token_ids`, or [].

        The longest suffix of n tokens (prompt_lookup_min <= n <= prompt_lookup_max) that also occurs
        earlier wins; among its earlier occurrences, the earliest (as vLLM's proposer); the drafts are
        the tokens after it. The earliest is most often in the prompt's own text, the source an answer
        copies; a later one is often a phrase that recurs with another continuation ("in 2015 ... in
        2019"). At batch 1 on CPU, SmolLM2 on copy-heavy prompts, the latest gave 1.79x / 1.74x over
        no speculation and the earliest 1.84x / 1.85x (docs/benchmarks.md, session 18).
        """
        c = self.config
        k = c.num_speculative_tokens if max_drafts is None else min(c.num_speculative_tokens, max_drafts)
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        if k < 1 or last < c.prompt_lookup_min:
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
        return tokens[end + 1:end + 1 + k].tolist()


def max_drafts_for(num_tokens: int, num_output_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """Drafts a request may verify now: its 1 + d emitted tokens stay within max_tokens and max_model_len."""
    room = max_model_len - num_tokens - 1
    if max_tokens is not None:
        room = min(room, max_tokens - num_output_tokens - 1)
    return max(0, room)


@dataclasses.dataclass
class SpecDecodingStats:
    """vLLM's spec-decode counters (vllm:spec_decode_* -> jaxpaged:spec_decode_*), engine-lifetime totals."""

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

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_stats(self) -> dict[str, Any]:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": tuple(self.num_accepted_tokens_per_pos)}

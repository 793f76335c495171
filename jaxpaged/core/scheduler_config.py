"""The scheduler's limits: `SchedulerConfig`, a frozen record validated when made (jaxpaged/config.py resolves it).

What each limit means for a step is told in jaxpaged/core/scheduler.py's docstring.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    num_pages: int  # including the null page 0
    page_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # 0: no cap on one request's prefill chunk
    # Most requests fed more than one token in a step (prefill chunks); None: no cap. Attention
    # sizes its prefill tiles for this many sequences (RunnerConfig.max_num_partial_prefills); this is
    # the one place it is enforced.
    max_num_partial_prefills: int | None = None
    # Set when EVERY layer of the model attends through this sliding window: pages wholly before a
    # running request's window are returned to the pool before it is scheduled (see PagePool).
    sliding_window: int | None = None
    # vLLM v1's async scheduling: a sampled token becomes a placeholder the next step feeds (module docstring)
    async_scheduling: bool = False
    # The runner's T buckets (step sizes it pads to), for speculative decoding: a step that carries a request
    # without drafts takes drafts only into the rows its bucket pads anyway (see `_draft_room`); (): no cap
    token_buckets: tuple[int, ...] = ()
    # ... or up to this many tokens, where a step costs about the same whatever its size (the weights' read
    # dominates: a GPU); 0 where every row adds compute (a CPU)
    memory_bound_tokens: int = 0

    def __post_init__(self):
        def bad(field: str, why: str) -> None:
            raise ValueError(f"SchedulerConfig.{field}={getattr(self, field)!r}: {why}")

        for field in ("num_pages", "page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(field, "must be an integer >= 1")
        if self.num_pages < 2:
            bad("num_pages", "must be >= 2 (page 0 is the null page)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            bad("max_num_batched_tokens",
                f"must be >= max_num_seqs={self.max_num_seqs} so every running request can decode each step")
        for field in ("enable_prefix_caching", "async_scheduling"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "must be a bool")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            bad("long_prefill_token_threshold", "must be an integer >= 0 (0 disables it)")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            bad("sliding_window", "must be an integer >= 1, or None")
        cap = self.max_num_partial_prefills
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            bad("max_num_partial_prefills", "must be an integer >= 1, or None for no cap")
        buckets = self.token_buckets
        if not isinstance(buckets, tuple) or any(not isinstance(b, int) or isinstance(b, bool) or b < 1
                                                 for b in buckets) or list(buckets) != sorted(set(buckets)):
            bad("token_buckets", "must be a tuple of increasing integers >= 1 (or () for no cap on drafts)")
        if not isinstance(self.memory_bound_tokens, int) or isinstance(self.memory_bound_tokens, bool) or \
                self.memory_bound_tokens < 0:
            bad("memory_bound_tokens", "must be an integer >= 0")

"""Structured outputs: JSON schemas, regexes, choices and grammars, enforced by llguidance.

    StructuredOutputsParams --compile (a small thread pool, cached)--> CompiledGrammar
    CompiledGrammar --matcher()--> GrammarMatcher (one per sequence, engine thread)
    each step: GrammarMatcher rows -> fill_bitmask -> i32[S, W] token bitmask -> the sampler
               sampled token -> GrammarMatcher.accept -> terminated? (finish_reason "stop")
    speculative decoding: drafts (forced_tokens, then n-gram ones) cut to valid_prefix ->
               fill_bitmask_with_drafts: the mask of every position a verification samples

The token bitmask is llguidance's layout: W = ceil(V / 32) int32 words per row, bit
j of word w allows token 32 * w + j. A row with every bit set (-1) is unconstrained.

The tokenizer view (`llguidance.LLTokenizer`) is built once, from the engine's
PreTrainedTokenizerFast (a GGUF file's tokenizer is one too), with the MODEL's
vocabulary size V: ids the tokenizer does not know (a padded embedding) are never
allowed. Compiling a grammar can take up to a second for a large schema, so it
runs off the engine thread; `compile` returns a Future and a bad constraint fails
it with a GrammarError naming the problem.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import threading
from collections.abc import Sequence

import numpy as np

try:
    import llguidance
    import llguidance.hf
    import llguidance.numpy
except ImportError:  # e.g. the GPU image, where nothing can be installed: unconstrained serving still works
    llguidance = None

from jaxpaged.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# JSON is generated compactly (", " and ": " separators, no free whitespace): a small model left
# free whitespace can emit newlines until max_tokens and never close the object.
JSON_COMPILE_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that cannot be enforced (invalid, unsatisfiable, too large, too slow to compile)."""


@dataclasses.dataclass(frozen=True)
class StructuredOutputsConfig:
    max_spec_bytes: int = 256 * 1024  # a schema / regex / grammar larger than this is refused at once
    compile_timeout_s: float = 5.0  # the server refuses a constraint (400) that takes longer to compile
    num_workers: int = 2  # compile threads
    cache_size: int = 256  # compiled grammars kept (LRU), keyed by the constraint's text
    max_grammar_size: int = 500_000  # llguidance's limit on grammar symbols

    def __post_init__(self):
        for name in ("max_spec_bytes", "num_workers", "cache_size", "max_grammar_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"StructuredOutputsConfig.{name}={value!r}: must be an integer >= 1")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"StructuredOutputsConfig.compile_timeout_s={self.compile_timeout_s!r}: must be > 0")


def available() -> bool:
    """Whether llguidance is installed (the engine then builds a StructuredOutputManager)."""
    return llguidance is not None


def bitmask_width(vocab_size: int) -> int:
    """W: int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for a constraint (not yet checked: compiling it does that)."""
    kind, value = spec.kind, getattr(spec, spec.kind)
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_COMPILE_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_COMPILE_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(value))
        return llguidance.grammar_from("grammar", value)  # Lark, or GBNF (converted to Lark)
    except (ValueError, TypeError) as err:
        raise GrammarError(f"invalid {kind} constraint: {err}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A checked grammar and a matcher at its start state, copied for each sequence."""

    kind: str
    grammar: str
    template: llguidance.LLMatcher


class GrammarMatcher:
    """One sequence's position in its grammar. Engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the matcher is then failed)."""
        return bool(self._matcher.consume_token(int(token_id)))

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: the canonical tokens of the
        bytes it forces, e.g. a schema's next key), [] if none; the matcher does not move."""
        return list(self._matcher.compute_ff_tokens())

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of token_ids (drafts) the grammar allows in a row from here; the matcher does not move."""
        return int(self._matcher.validate_tokens([int(t) for t in token_ids])) if len(token_ids) else 0

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: no token but EOS may follow (the sequence stops here)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None if self._matcher.is_error() else None


class StructuredOutputManager:
    """Owns the tokenizer view, the compile pool and the grammar cache; thread-safe `compile`."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 config: StructuredOutputsConfig | None = None):
        if llguidance is None:
            raise ImportError("structured outputs need the llguidance package (pip install llguidance)")
        self.config = config or StructuredOutputsConfig()
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r}: must be an integer >= 1")
        self.vocab_size = vocab_size
        # The model's V, unless the tokenizer knows more ids: an embedding padded past the tokenizer gets
        # never-allowed ids; ids past the embedding (never sampled) are cut off by `sampler_width`.
        n_vocab = max(vocab_size, len(tokenizer))
        self.mask_width = bitmask_width(n_vocab)  # W of the host bitmask llguidance fills
        self.sampler_width = bitmask_width(vocab_size)  # W of the sampler's: the first words of each row
        eos = [int(t) for t in eos_token_ids] or None
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
        self._limits = llguidance.LLParserLimits(max_grammar_size=self.config.max_grammar_size,
                                                 verbose_errors=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.config.num_workers,
                                                           thread_name_prefix="jaxpaged-grammar")
        self._executor = llguidance.LLExecutor(num_threads=max(1, self.config.num_workers))
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = \
            collections.OrderedDict()

    # ---- compiling (any thread) --------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """A Future of the CompiledGrammar (cached); a GrammarError for a bad constraint.

        An oversized constraint fails at once, without reaching the pool."""
        key = (spec.kind, spec.key_text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            future = concurrent.futures.Future()
            size = len(key[1].encode())
            if size > self.config.max_spec_bytes:
                future.set_exception(GrammarError(
                    f"the {spec.kind} constraint is too large: {size} bytes, at most {self.config.max_spec_bytes}"))
                return future  # not cached: it costs nothing to refuse again
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        grammar = grammar_text(spec)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind} constraint: {_first_line(matcher.get_error())}")
        mask = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        if not mask.any() and not matcher.is_accepting():
            raise GrammarError(f"unsatisfiable {spec.kind} constraint: no token can start it")
        return CompiledGrammar(spec.kind, grammar, matcher)

    # ---- per sequence (engine thread) --------------------------------------

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        return GrammarMatcher(compiled.template.deep_copy())

    def fill_bitmask(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed tokens into its row of bitmask i32[S, W] (other rows untouched)."""
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != self.mask_width:
            raise ValueError(f"bitmask must be int32 [S, {self.mask_width}], got {bitmask.dtype} {bitmask.shape}")
        if rows:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(m.ll_matcher, int(i)) for m, i in rows], bitmask)

    def fill_bitmask_with_drafts(self, rows: Sequence[tuple[GrammarMatcher, Sequence[int], Sequence[int]]],
                                 bitmask: np.ndarray) -> None:
        """Speculative decoding: for each (matcher, drafts, targets), the mask after its first j drafts into
        row targets[j] of bitmask i32[S, W], j = 0..d (targets: d + 1 rows; d = 0: fill_bitmask's row). The
        drafts must be the grammar's (`GrammarMatcher.valid_prefix`); each matcher is advanced through them and
        rolled back (llguidance)."""
        if any(len(targets) != len(drafts) + 1 for _, drafts, targets in rows):
            raise ValueError("fill_bitmask_with_drafts needs d + 1 target rows for d drafts")
        # the rows without drafts; fill_bitmask checks the bitmask's shape, even when there are none
        self.fill_bitmask([(m, targets[0]) for m, drafts, targets in rows if not len(drafts)], bitmask)
        rows = [row for row in rows if len(row[1])]
        if not rows:
            return
        firsts = np.cumsum([0] + [len(targets) for _, _, targets in rows])  # each matcher's first scratch row
        scratch = np.full((int(firsts[-1]), self.mask_width), -1, np.int32)  # llguidance writes d + 1 in a row
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
            self._executor, [(m.ll_matcher, int(first), [int(t) for t in drafts])
                             for (m, drafts, _), first in zip(rows, firsts)], scratch)
        bitmask[np.concatenate([np.asarray(targets, np.int64) for _, _, targets in rows])] = scratch

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _first_line(message: str, limit: int = 400) -> str:
    """llguidance's (multi-line) error as one line, bounded."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip()) or "unknown error"
    return text if len(text) <= limit else text[:limit] + "..."


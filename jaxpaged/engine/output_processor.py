"""Output processing: a step's sampled tokens -> detokenized text, stop verdicts, log-probs -> RequestOutputs.

Outputs follow vLLM's RequestOutputKind: CUMULATIVE (everything so far), DELTA (only what is new: token ids,
log-probs and text; a step costs O(new tokens)) or FINAL_ONLY (one output at the end). The finish record is the
scheduler Request's (status, stop_reason); outputs read it from there. `_Child` and `_Parent` are the engine-side
state of one sample and of one request (n samples).

A step's rows are handled in one pass (`_emit_step`). A sample that records nothing per token but its cumulative
log-prob (no logprobs, no text, no grammar: `_Child.lean`, decided once when it is queued) skips the per-token
record when its token cannot end it: `might_stop` screens the token against what is known at queue time (its stop
ids and length limit, from `Request.stop_screen`, beside `check_stop`) and a non-finite row. A token the screen
does not rule out is decided by `_stop_verdict` as any other (which uses the same screen to skip
`Request.check_stop` for a token it rules out); the screen decides no stop itself, so stopping stays decided in
one place. A request of one sample (n = 1) makes its output without adding up children.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from jaxpaged.core.request import Request, RequestStatus, StopVerdict
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.sample.structured_outputs import GrammarMatcher
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.worker.runner_output import ModelRunnerOutput, PromptLogprobs


class FloatArray:
    """A growing float32 array (capacity doubled when full): one request's sampled log-probs, no Python object per
    token (SamplingParams.array_logprobs)."""

    def __init__(self, capacity: int = 16):
        self._data = np.empty(max(1, capacity), np.float32)
        self.size = 0

    def append(self, value: float) -> None:
        if self.size == len(self._data):
            self._data = np.concatenate([self._data, np.empty_like(self._data)])
        self._data[self.size] = value
        self.size += 1

    def copy(self, start: int = 0) -> np.ndarray:
        """float32 [size - start]: the values from `start` on (a copy)."""
        return self._data[start:self.size].copy()


@dataclasses.dataclass
class _Child:
    """Engine-side state of one sample (one scheduler Request, which holds the finish record)."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None when params.detokenize is False
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0  # DELTA: output tokens already handed out
    matcher: GrammarMatcher | None = None  # structured outputs: where the output is in its grammar
    token_logprobs: FloatArray | None = None  # params.array_logprobs: each sampled token's log-prob
    # Set by `plan_child` once queued: whether a token needs no per-token record but its log-prob's sum (lean), the
    # ids that may end it (EOS unless ignore_eos, stop_token_ids) and the output count that ends it by length
    # (until planned: not lean, and a length limit of 0 lets every token through `might_stop`)
    lean: bool = False
    stop_ids: frozenset[int] = frozenset()
    length_limit: int = 0


@dataclasses.dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child]
    metrics: RequestMetrics
    # params.prompt_logprobs: entry per prompt token (index 0: None), filled from the first child's steps
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA: they went out with the first output
    # params.array_logprobs with prompt_logprobs: f32[len(prompt)] (index 0 NaN), in place of prompt_logprobs
    prompt_token_logprobs: np.ndarray | None = None
    # n > 1: the indices of the children that got a token since the last output (n = 1: None, the one child)
    fresh: set[int] | None = None


def plan_child(child: _Child) -> None:
    """Decide once, when the child is queued (its Request's max_model_len set by the scheduler), what a token of it
    needs: see `_Child.lean` and `might_stop`."""
    child.lean = (child.detokenizer is None and child.logprobs is None and child.token_logprobs is None
                  and child.matcher is None)
    child.stop_ids, child.length_limit = child.request.stop_screen()  # the rules stay beside check_stop


def might_stop(child: _Child, token_id: int, finite: bool, ahead: int = 0) -> bool:
    """Whether `token_id` (after `ahead` tokens of the same step) could end the lean child: a screen, never the
    decision (`_stop_verdict` decides every token it lets through). It must let through every token that
    `Request.check_stop` stops: the test_output_processor tests hold it to that."""
    return (not finite or token_id in child.stop_ids
            or len(child.request.output_token_ids) + ahead + 1 >= child.length_limit)


def _add_up(children: list[_Child], metrics: RequestMetrics) -> bool:
    """n > 1: the children's totals into the parent's metrics; whether all of them finished."""
    finished, num_generated, num_cached = True, 0, 0
    for child in children:
        request = child.request
        finished = finished and request.is_finished
        num_generated += request.num_output_tokens
        num_cached = max(num_cached, request.num_cached_tokens)
    metrics.num_generation_tokens, metrics.num_cached_tokens = num_generated, num_cached
    return finished


def _completion(child: _Child, delta: bool, status: RequestStatus) -> CompletionOutput:
    """One child's CompletionOutput: everything so far, or (delta) only what is new since the last one."""
    request = child.request
    token_ids = request.output_token_ids
    start = child.num_sent_tokens if delta else 0
    child.num_sent_tokens = len(token_ids)
    logprobs = None if child.logprobs is None else child.logprobs[start:]
    token_logprobs = None if child.token_logprobs is None else child.token_logprobs.copy(start)
    finished = status.is_finished
    text = "" if child.detokenizer is None else child.detokenizer.get_next_output_text(finished, delta)
    # token_ids[start:end]: copied when the caller reads them (the list only grows), so later steps never show
    return CompletionOutput(child.index, text, token_ids, child.cumulative_logprob, logprobs,
                            status.finish_reason if finished else None, request.stop_reason, token_logprobs,
                            (start, child.num_sent_tokens))


class OutputProcessor:
    """LLMEngine's methods for its outputs: they share its state (see LLMEngine.__init__)."""

    def _emit_step(self, result: ModelRunnerOutput, live: set[str] | None = None) -> tuple[
            dict[str, list[int]], dict[str, StopVerdict | None], dict[str, _Parent]]:
        """Every row's tokens and verdict (`_emit`) for Scheduler.update_from_output, and the parents they touched
        (in row order). live: the ids still scheduled (async: a request finished or aborted since is skipped)."""
        tokens, logprobs, finite = result.row_values
        sampled, stops, touched = {}, {}, {}
        lookup, spec_rows = self._child_to_parent, result.spec_token_rows
        for row, rid in enumerate(result.req_ids):
            if live is not None and rid not in live:
                continue
            parent, child = lookup[rid]
            touched[parent.request_id] = parent
            if parent.fresh is not None:
                parent.fresh.add(child.index)
            if rid in spec_rows:  # verified drafts: several tokens
                sampled[rid], stops[rid] = self._emit(child, result, spec_rows[rid])
                continue
            token = tokens[row]
            sampled[rid] = [token]
            if child.lean and not might_stop(child, token, finite[row]):  # nothing to record, nothing to decide
                child.cumulative_logprob += logprobs[row]
                stops[rid] = None
            else:
                stops[rid] = self._stop_verdict(child, result, row)
        return sampled, stops, touched

    def _emit(self, child: _Child, result: ModelRunnerOutput,
              rows: Sequence[int]) -> tuple[list[int], StopVerdict | None]:
        """The tokens a request emits this step (its rows' samples, cut after the first that ends it) and
        the last one's verdict (see `_stop_verdict`)."""
        tokens, verdict, sampled = [], None, result.row_values[0]
        for ahead, row in enumerate(rows):
            tokens.append(sampled[row])
            verdict = self._stop_verdict(child, result, row, ahead)
            if verdict is not None:
                break
        return tokens, verdict

    def _outputs(self, touched: dict[str, _Parent]) -> list[RequestOutput]:
        """The outputs of the parents whose children got tokens this step, their token times recorded (one clock
        read a step)."""
        now = time.time()
        outputs = []
        for parent in touched.values():
            metrics = parent.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            else:
                metrics.inter_token_latencies.append(now - metrics.last_token_time)
            metrics.last_token_time = now
            fresh = parent.fresh
            if fresh is not None:  # n > 1: the next step's start afresh
                parent.fresh = set()
            output = self._make_output(parent, fresh, now)
            if output is not None:
                outputs.append(output)
        return outputs

    def _stop_verdict(self, child: _Child, result: ModelRunnerOutput, row: int, ahead: int = 0) -> StopVerdict | None:
        """Record one sampled token (logprobs, text) and decide whether it ends the request.

        None: it goes on; else (status, stop_reason) for Scheduler.update_from_output. Token-level
        stops come from Request.check_stop, stop strings from the detokenizer (they win over length).
        ahead: the step's tokens before this one (speculative decoding), not appended yet.
        """
        request, (sampled, logprobs, finite) = child.request, result.row_values
        if not finite[row]:  # NaN/inf logits fail only their own request; the token is garbage
            return RequestStatus.FINISHED_ERROR, None
        token_id = sampled[row]
        # check_stop is pure: for a token `might_stop` rules out it would say None
        verdict = request.check_stop(token_id, ahead) if might_stop(child, token_id, True, ahead) else None
        # A completed grammar stops after its last token, whose text is kept (unlike an EOS / stop id's).
        grammar_verdict = None if verdict is not None or child.matcher is None else \
            self._grammar_verdict(child, token_id)
        if child.logprobs is not None:
            child.logprobs.append(self._logprob_entry(result, row, token_id, request.sampling_params.logprobs))
        if child.token_logprobs is not None:
            child.token_logprobs.append(logprobs[row])
        child.cumulative_logprob += logprobs[row]
        if child.detokenizer is not None:
            stop_terminated = verdict is not None and verdict[0] is RequestStatus.FINISHED_STOPPED
            stop_str = child.detokenizer.update([token_id], stop_terminated=stop_terminated)
            if stop_str is None and (verdict or grammar_verdict) is not None:
                stop_str = child.detokenizer.flush()
            if stop_str is not None:
                return RequestStatus.FINISHED_STOPPED, stop_str
        return verdict or grammar_verdict

    def _record_prompt_logprobs(self, parent: _Parent, child: _Child, chunk: PromptLogprobs) -> None:
        """Store one step's prompt log-probs by position (a recomputed chunk, after preemption or of another
        child, overwrites): every child computes its whole prompt, so the first to sample has them all."""
        if parent.prompt_token_logprobs is not None:  # array_logprobs: the chunk's values, no entries
            first = chunk.first_index
            parent.prompt_token_logprobs[first:first + len(chunk.token_logprobs)] = chunk.token_logprobs
            return
        k = parent.params.prompt_logprobs
        for j, lp in enumerate(chunk.token_logprobs):
            position = chunk.first_index + j
            token_id = parent.prompt_token_ids[position]
            entry = {int(t): Logprob(float(chunk.top_logprobs[j, r]), r + 1, self._decode_token(int(t)))
                     for r, t in enumerate(chunk.top_token_ids[j, :k])}
            if token_id not in entry:
                entry[token_id] = Logprob(float(lp), int(chunk.ranks[j]), self._decode_token(token_id))
            parent.prompt_logprobs[position] = entry

    def _logprob_entry(self, result: ModelRunnerOutput, row: int, token_id: int, k: int) -> dict[int, Logprob]:
        top_ids = result.top_token_ids[row]
        entry = {int(t): Logprob(float(result.top_logprobs[row, r]), r + 1, self._decode_token(int(t)))
                 for r, t in enumerate(top_ids[:k])}
        if token_id not in entry:
            ranks = np.nonzero(top_ids == token_id)[0]
            rank = int(ranks[0]) + 1 if len(ranks) else None
            entry[token_id] = Logprob(float(result.logprobs[row]), rank, self._decode_token(token_id))
        return entry

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, parent: _Parent, fresh: set[int] | None, now: float | None = None) -> RequestOutput | None:
        """The parent's output after a step in which its children `fresh` got a token (None: nothing due; n = 1:
        fresh is not read, the one child got it). now: the step's time.time(), read once a step."""
        kind, children, metrics = parent.params.output_kind, parent.children, parent.metrics
        if len(children) == 1:  # nothing to add up
            request = children[0].request
            status = request.status
            finished = status.is_finished
            metrics.num_generation_tokens, metrics.num_cached_tokens = len(request.output_token_ids), \
                request.num_cached_tokens
        else:
            finished = _add_up(children, metrics)
        if not finished and kind is RequestOutputKind.FINAL_ONLY:
            return None
        delta = kind is RequestOutputKind.DELTA
        if len(children) == 1:
            outputs = [_completion(children[0], delta, status)]
        else:
            outputs = [_completion(c, delta, c.request.status) for c in children if not delta or c.index in fresh]
        if finished:
            self._forget(parent, time.time() if now is None else now)
        if parent.prompt_logprobs is None and parent.prompt_token_logprobs is None:  # none asked for: nothing to send
            return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                                 metrics, metrics.num_cached_tokens)
        prompt_logprobs, prompt_array = parent.prompt_logprobs, parent.prompt_token_logprobs
        if delta and parent.prompt_logprobs_sent:
            prompt_logprobs = prompt_array = None
        parent.prompt_logprobs_sent = True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             metrics, metrics.num_cached_tokens, prompt_logprobs,
                             None if prompt_array is None else prompt_array.copy())

    def _forget(self, parent: _Parent, now: float) -> None:
        """A finished parent: its finish time noted, its ids forgotten (its output is the last)."""
        parent.metrics.finished_time = now
        self._parents.pop(parent.request_id, None)
        for child in parent.children:
            self._child_to_parent.pop(child.request.request_id, None)

    def stats(self) -> dict[str, float]:
        pool = self.scheduler.pool
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": pool.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": pool.prefix_cache_queries,
            "prefix_cache_hits": pool.prefix_cache_hits,
            **({} if self.spec_decoding_stats is None else self.spec_decoding_stats.as_stats()),
        }

"""Structured outputs in the engine: grammars compiled off the engine thread, requests admitted once theirs is ready,
and each step's token bitmask and grammar verdicts.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence

import numpy as np

from jaxpaged.core.request import RequestStatus
from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.engine.output_processor import _Child, _Parent
from jaxpaged.errors import InvalidRequestError
from jaxpaged.outputs import RequestOutput
from jaxpaged.sample.structured_outputs import StructuredOutputManager
from jaxpaged.sample.structured_outputs import available as structured_outputs_available
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class GrammarSupport:
    """LLMEngine's methods for structured outputs: they share its state (see LLMEngine.__init__)."""

    def _init_structured_outputs(self) -> None:
        # Grammars compile off the engine thread; a request waits for its grammar (vLLM's WAITING_FOR_FSM) in
        # _awaiting_grammar, outside the scheduler, while the others run.
        self.structured_outputs = None if self.tokenizer is None or not structured_outputs_available() else \
            StructuredOutputManager(self.tokenizer, self.model.config.vocab_size,
                                    self.model.generation_config.eos_token_ids)
        self._awaiting_grammar: dict[str, tuple[_Parent, concurrent.futures.Future]] = {}

    def _compile_grammar(self, params: SamplingParams) -> concurrent.futures.Future | None:
        if params.structured_outputs is None:
            return None
        if self.structured_outputs is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer and the llguidance package",
                                      "structured_outputs")
        return self.structured_outputs.compile(params.structured_outputs)

    def _attach_matchers(self, parent: _Parent, compiled) -> None:
        for child in parent.children:
            child.matcher = self.structured_outputs.matcher(compiled)

    def _admit_grammar_ready(self) -> list[RequestOutput]:
        """Queue the requests whose grammar compiled; fail (finish_reason "error") those whose did not."""
        failed = []
        for rid, (parent, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[rid]
            try:
                self._attach_matchers(parent, future.result())
                self._queue(parent)
            except (ValueError, concurrent.futures.CancelledError) as err:
                logger.warning("request %s failed before it ran: %s", rid, err)
                for child in parent.children:
                    child.request.finish(RequestStatus.FINISHED_ERROR)
                failed.append(self._make_output(parent, {c.index for c in parent.children}))
        return [o for o in failed if o is not None]

    def _wait_for_grammars(self, timeout: float = 0.01) -> None:
        """Nothing to run but requests awaiting their grammar: sleep until one is ready (or a moment)."""
        futures = [future for _, future in self._awaiting_grammar.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _grammar_bitmask(self, entries: Sequence[ScheduledRequest]) -> np.ndarray | None:
        """i32[len(entries) + D, W]: the allowed tokens of each constrained row (others all ones); None if none.
        Rows (ModelRunner.execute_model's layout): each entry's last fed token, then the D draft positions of
        the entries that fed drafts, in step order (position j samples the token after the first j drafts)."""
        rows, draft_row = [], len(entries)
        for i, entry in enumerate(entries):
            # .get: with async scheduling the step may hold a request that finished since it was scheduled
            pair = self._child_to_parent.get(entry.request_id) if entry.samples else None
            matcher = pair[1].matcher if pair is not None else None
            d = len(entry.spec_token_ids)
            if matcher is not None:  # the mask after its first j drafts: row draft_row + j, the last one's: row i
                rows.append((matcher, entry.spec_token_ids, [*range(draft_row, draft_row + d), i]))
            draft_row += d
        if not rows:
            return None
        bitmask = np.full((draft_row, self.structured_outputs.mask_width), -1, np.int32)
        self.structured_outputs.fill_bitmask_with_drafts(rows, bitmask)
        return bitmask[:, :self.structured_outputs.sampler_width]

    @staticmethod
    def _grammar_verdict(child: _Child, token_id: int):
        """Advance the child's grammar by its sampled token: (status, None) when that ends it, else None."""
        if child.matcher is None:
            return None
        if not child.matcher.accept(token_id):
            logger.warning("request %s: token %d broke its grammar (%s)", child.request.request_id, token_id,
                           child.matcher.error)
            return RequestStatus.FINISHED_ERROR, None
        return (RequestStatus.FINISHED_STOPPED, None) if child.matcher.is_terminated else None

"""One chat choice's output as the reply reads it: reasoning, content and tool calls, whole or streamed.

The reasoning parser (if any) takes the <think> span off first; what follows is the answer, which the
tool plan reads: plain content, the "auto" parser's content and calls, or a forced call's JSON. Forced
calls have no reasoning: their constraint makes the whole output the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxpaged.sampling_params import StructuredOutputsParams
from server.reasoning import ReasoningParser, ReasoningStream, after_reasoning, reasoning_token_count
from server.tool_parsers import CallStream
from server.tools import (ToolPlan, arguments_delta, call_deltas, call_head_delta, message_calls, parse_calls,
                          required_calls)


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    tools: ToolPlan
    reasoning: ReasoningParser | None = None

    @classmethod
    def create(cls, tools: ToolPlan, reasoning_parser: str | None, prompt: str) -> OutputPlan:
        use = reasoning_parser is not None and not tools.forced
        return cls(tools, ReasoningParser.for_prompt(reasoning_parser, prompt) if use else None)

    def constraint(self, spec: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """The request's own output constraint as applied: to the answer after the reasoning."""
        if spec is None or self.reasoning is None:
            return spec
        return after_reasoning(spec, self.reasoning)

    def message(self, text: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
        """The non-streamed message of a finished output, and its calls."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            split = self.reasoning.split(text, True)
            message["reasoning_content"] = message["reasoning"] = split.reasoning or None
            text = message["content"] = split.content if split.content or not split.has_reasoning else None
        calls: list[dict[str, str]] = []
        if self.tools.calls_tools:
            message["content"], calls = parse_calls(self.tools, text or "")
            message["tool_calls"] = message_calls(calls)
        return message, calls

    def reasoning_tokens(self, decode: Callable[[list[int]], str], token_ids: list[int], text: str) -> int:
        if self.reasoning is None:
            return 0
        return reasoning_token_count(decode, token_ids, self.reasoning, text)


class StreamReader:
    """One streamed choice: `feed` each text delta, get the chat deltas to send (in order)."""

    def __init__(self, plan: OutputPlan):
        self.plan, self.tools = plan, plan.tools
        self.reasoning = ReasoningStream(plan.reasoning) if plan.reasoning is not None else None
        self.calls = CallStream(self.tools.parser, self.tools.parallel) if self.tools.mode == "auto" else None
        self.text, self.token_ids, self.num_calls = "", [], 0

    def feed(self, text: str, token_ids: list[int], final: bool) -> list[dict[str, Any]]:
        self.text += text
        self.token_ids += token_ids
        if self.tools.mode == "named":
            return self._named(text)
        if self.tools.mode == "required":
            if not final:
                return []
            content, calls = required_calls(self.text)
            self.num_calls = len(calls)
            return ([{"content": content}] if content else []) + call_deltas(0, calls)
        deltas, content = [], text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final)
            if reasoning:
                deltas.append({"reasoning_content": reasoning, "reasoning": reasoning})
        if self.calls is None:
            return deltas + ([{"content": content}] if content else [])
        for kind, value in self.calls.feed(content, final):
            if kind == "content":
                deltas.append({"content": value})
            else:
                deltas += call_deltas(self.num_calls, [value])
                self.num_calls += 1
        return deltas

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = [] if self.num_calls else [call_head_delta(0, self.tools.name)]
        self.num_calls = 1
        return deltas + ([arguments_delta(0, text)] if text else [])

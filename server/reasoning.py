"""Reasoning parsers (vLLM's `--reasoning-parser qwen3|deepseek_r1`): the <think> span of an output.

The reasoning is the text inside <think> ... </think>; the answer (`content`) is what follows the
close tag. An output cut short before </think> is all reasoning. Whitespace at the start of either
part is dropped (the models write "<think>\\n" and "</think>\\n\\n").

    qwen3        the output's reasoning opens with <think>, or in the prompt when the chat template
                 ended it with an open <think> (Qwen3's thinking-only templates); otherwise there is
                 none (enable_thinking=False leaves an empty, closed span in the prompt).
    deepseek_r1  the output starts inside the reasoning (R1's template opens <think> in the prompt);
                 a leading <think> the model writes anyway is dropped.

`split(text, final)` reads an output whole or, without `final`, only what later text cannot change,
so streamed reasoning and content deltas always reassemble to the non-streamed reply.

Structured outputs apply to the answer, after the reasoning ends (vLLM's behaviour): every constraint
becomes a Lark grammar (llguidance's) of the free reasoning span, then the constraint (`after_reasoning`):
a JSON schema or json_object as `%json`, a choice as literals, a regex as a regex terminal and a grammar
(Lark, or GBNF converted to Lark) as a nested `%lark { ... }` grammar, whose rule names stay its own.
"""

from __future__ import annotations

import dataclasses
import json

from llguidance.gbnf_to_lark import any_to_lark

from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.sample.structured_outputs import JSON_COMPILE_OPTIONS
from server.config import REASONING_PARSERS
from server.tool_parsers.base import held_from

OPEN, CLOSE = "<think>", "</think>"


def opens_in_prompt(prompt: str) -> bool:
    """Whether the prompt ends inside an open <think> span (the output continues the reasoning)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE) and not prompt[prompt.rfind(OPEN) + len(OPEN):].strip()


@dataclasses.dataclass(frozen=True)
class Split:
    reasoning: str  # "" when there is none
    content: str
    has_reasoning: bool  # the output has a reasoning span (even an empty one)
    closed: bool = False  # its </think> was read


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_open: bool  # the output begins inside the reasoning

    def __post_init__(self):
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {self.name!r}: choose one of {', '.join(REASONING_PARSERS)}")

    @classmethod
    def for_prompt(cls, name: str, prompt: str) -> ReasoningParser:
        return cls(name, name == "deepseek_r1" or opens_in_prompt(prompt))

    def split(self, text: str, final: bool) -> Split:
        body = text
        stripped = text.lstrip()
        if stripped.startswith(OPEN):
            body = stripped[len(OPEN):]
        elif not final and OPEN.startswith(stripped):  # may still open a span: wait
            return Split("", "", False)
        elif not self.starts_open:
            return Split("", text, False)
        end = body.find(CLOSE)
        if end < 0:
            kept = body if final else body[:held_from(body, (CLOSE,))]
            return Split(kept.lstrip(), "", True)
        return Split(body[:end].lstrip(), body[end + len(CLOSE):].lstrip(), True, True)


class ReasoningStream:
    """One streamed output: `feed` each text delta, get (new reasoning text, new content text)."""

    def __init__(self, parser: ReasoningParser):
        self.parser, self.text, self.sent_reasoning, self.sent_content = parser, "", 0, 0
        self.split = Split("", "", False)

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        self.split = self.parser.split(self.text, final)
        reasoning = self.split.reasoning[self.sent_reasoning:]
        content = self.split.content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(self.split.reasoning), len(self.split.content)
        return reasoning, content


def reasoning_token_count(decode, token_ids: list[int], parser: ReasoningParser, text: str) -> int:
    """How many of the output's tokens are reasoning: those up to the one completing </think> (all of
    them when the output ended inside the reasoning). `decode(ids)` is the request's detokenization."""
    split = parser.split(text, True)
    if not split.has_reasoning:
        return 0
    if not split.closed:
        return len(token_ids)
    low, high = 1, len(token_ids)  # the fewest tokens whose text holds the close tag
    while low < high:
        mid = (low + high) // 2
        if CLOSE in decode(token_ids[:mid]):
            high = mid
        else:
            low = mid + 1
    return low


# Free text up to and including the close tag (llguidance's `suffix`: the text ends at its first
# </think>, which stays in the output), then the whitespace the models put before the answer.
_THOUGHT = 'thought[suffix="</think>"]: /(.|\\n)*/\nGAP: /[ \\n]*/\n'


def lark_regex(regex: str) -> str:
    """`regex` as a regex terminal of llguidance's Lark (`/.../`): a bare / is escaped, a line break (bare or
    escaped) is written as its escape, and any other escaped character (\\/ included) is kept as it is."""
    breaks = {"\n": "\\n", "\r": "\\r"}
    out, i = [], 0
    while i < len(regex):
        pair = regex[i:i + 2]
        if len(pair) == 2 and pair[0] == "\\":
            out.append(breaks.get(pair[1], pair))
            i += 2
        else:
            out.append("\\/" if pair[0] == "/" else breaks.get(pair[0], pair[0]))
            i += 1
    return "/" + "".join(out) + "/"


def _answer(spec: StructuredOutputsParams) -> str:
    """`spec` as the body of the grammar's `answer` rule."""
    if spec.kind in ("json", "json_object"):
        schema = {"type": "object"} if spec.kind == "json_object" else \
            json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        schema = {} if schema is True else {"not": {}} if schema is False else schema
        # the JSON layout the engine gives a schema of its own (x-guidance: llguidance's options key)
        return f"%json {json.dumps({**schema, 'x-guidance': JSON_COMPILE_OPTIONS})}"
    if spec.kind == "choice":
        return " | ".join(json.dumps(c) for c in spec.choice)
    if spec.kind == "regex":
        return lark_regex(spec.regex)
    return "%lark {\n" + any_to_lark(spec.grammar) + "\n}"  # GBNF converts: its own compile passed first


def after_reasoning(spec: StructuredOutputsParams, parser: ReasoningParser) -> StructuredOutputsParams:
    """`spec` applied to the answer after the reasoning span (which may be absent when the output does not
    start inside it). Compile a regex or grammar on its own first: its errors then point into its own text,
    and one that is only valid nested (a `}` closing the `%lark` block early) is refused."""
    span = "thought GAP" if parser.starts_open else f"({json.dumps(OPEN)} thought GAP)?"
    return StructuredOutputsParams(grammar=f"start: {span} answer\n{_THOUGHT}answer: {_answer(spec)}\n")

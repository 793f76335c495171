"""server/reasoning.py and the chat reply it shapes, without a model: the <think> span as reasoning,
streamed in any chunking to the same reply, its token count, and reasoning together with tool calls."""

from __future__ import annotations

import random

import pytest

from server.chat_output import OutputPlan, StreamReader
from server.protocol import ChatCompletionRequest
from server.reasoning import ReasoningParser, ReasoningStream, opens_in_prompt, reasoning_token_count
from server.tools import plan_tools

QWEN3 = ReasoningParser("qwen3", starts_open=False)
R1 = ReasoningParser("deepseek_r1", starts_open=True)

CASES = [  # (parser, output, reasoning, content)
    (QWEN3, "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.\n", "Hello!"),
    (QWEN3, "Hello!", "", "Hello!"),  # enable_thinking=False: no span in the output
    (QWEN3, "<think>\nStill thinking when cut", "Still thinking when cut", ""),
    (QWEN3, "<think>\n\n</think>\n\nShort.", "", "Short."),
    (QWEN3, "<thinking about it>", "", "<thinking about it>"),
    (R1, "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 is 4.\n", "The answer is 4."),
    (R1, "<think>\nHmm.\n</think>4", "Hmm.\n", "4"),
    (R1, "Cut short while reasoning", "Cut short while reasoning", ""),
]


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_split_and_any_chunking_reassembles(parser, text, reasoning, content):
    split = parser.split(text, True)
    assert (split.reasoning, split.content) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(10, len(text) - 1))))
        stream, got = ReasoningStream(parser), ["", ""]
        bounds = [0, *cuts, len(text)]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            r, c = stream.feed(text[a:b], i == len(bounds) - 2)
            got[0] += r
            got[1] += c
        assert got == [reasoning, content], cuts


def test_qwen3_starts_inside_the_reasoning_when_the_prompt_opened_it():
    assert opens_in_prompt("<|im_start|>assistant\n<think>\n")
    assert not opens_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False
    assert not opens_in_prompt("<|im_start|>assistant\n")
    parser = ReasoningParser.for_prompt("qwen3", "<|im_start|>assistant\n<think>\n")
    assert parser.split("Thinking.</think>Answer.", True).content == "Answer."
    assert ReasoningParser.for_prompt("deepseek_r1", "").starts_open


def test_reasoning_tokens_are_those_up_to_the_close_tag():
    tokens = ["<think>", "\nI", " think", "</", "think>", "\n\n", "Yes", "."]

    def decode(ids: list[int]) -> str:
        return "".join(tokens[i] for i in ids)

    text = decode(list(range(len(tokens))))
    assert reasoning_token_count(decode, list(range(len(tokens))), QWEN3, text) == 5
    assert reasoning_token_count(decode, [6, 7], QWEN3, "Yes.") == 0
    assert reasoning_token_count(decode, [0, 1, 2], QWEN3, "<think>\nI think") == 3


def test_reasoning_then_tool_calls_whole_and_streamed():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="auto", tools=[
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])
    plan = OutputPlan(plan_tools(request, "hermes"), QWEN3)
    text = '<think>\nThe user wants the time.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n' \
           '</tool_call>'
    message, calls = plan.message(text)
    assert message["reasoning_content"] == message["reasoning"] == "The user wants the time.\n"
    assert message["content"] is None and [c["name"] for c in calls] == ["get_time"]
    reader, reasoning, names = StreamReader(plan), "", []
    for i in range(0, len(text), 4):
        for delta in reader.feed(text[i:i + 4], [], i + 4 >= len(text)):
            reasoning += delta.get("reasoning_content") or ""
            assert "content" not in delta
            names += [tc["function"]["name"] for tc in delta.get("tool_calls") or [] if "id" in tc]
    assert reasoning == message["reasoning_content"] and names == ["get_time"]


def test_forced_calls_have_no_reasoning():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required", tools=[
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])
    assert OutputPlan.create(plan_tools(request, None), "deepseek_r1", "<think>\n").reasoning is None

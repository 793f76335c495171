"""server/tool_parsers: each format read from text as its documentation shows it, malformed text as
content, and streamed pieces (any chunking) reassembling to the non-streamed result."""

from __future__ import annotations

import json
import random

import pytest

from server.tool_parsers import CallStream, make_parser, parse_output, resolve_parser_name

TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "zip": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}})

PARIS = ("get_weather", {"city": "Paris", "days": 3})
CLOCK = ("get_time", {})

# (parser, model text, expected content, expected calls)
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     None, [PARIS]),
    ("hermes", 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look that up.\n", [PARIS, CLOCK]),
    ("hermes", "The weather is sunny.", "The weather is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # bad JSON
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', '<tool_call>\n{"name": "get_time", '
                                                                     '"arguments": {}}', []),  # cut short
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.', "\nDone.", [CLOCK]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {}}]', None, [PARIS, CLOCK]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}',
     None, [PARIS, CLOCK]),
    ("mistral", '[{"name": "get_time", "arguments": {}}]', None, [CLOCK]),  # the special token skipped
    ("mistral", "[1] A numbered note.", "[1] A numbered note.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": ', '[TOOL_CALLS][{"name": "get_time", '
                                                                   '"arguments": ', []),
    ("mistral", 'Sure. [TOOL_CALLS]get_time[ARGS]{}', "Sure. ", [CLOCK]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {}}', None, [PARIS, CLOCK]),
    ("llama3_json", '{"name": "get_time", "parameters": {}} and some words', '{"name": "get_time", "parameters": '
                                                                              '{}} and some words', []),
    ("llama3_json", "Hello!", "Hello!", []),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time()]', None, [PARIS, CLOCK]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', None, [PARIS]),
    ("pythonic", "[get_weather(city='Paris', metric=true, days=3)]", None,
     [("get_weather", {"city": "Paris", "metric": True, "days": 3})]),
    ("pythonic", "[get_weather('Paris')]", "[get_weather('Paris')]", []),  # positional: not a call
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "It is sunny [source].", "It is sunny [source].", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None, [PARIS]),
    ("qwen3_coder", "I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n"
                    "<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_time>\n</function>\n</tool_call>", "I'll check.\n\n",
     [("get_weather", {"city": "Paris", "days": 3, "zip": "75001", "metric": True}), CLOCK]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\noops</function>\n</tool_call>",
     "<tool_call>\n<function=get_time>\noops</function>\n</tool_call>", []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parsers_read_the_documented_formats(name, text, content, calls):
    got_content, got_calls = parse_output(make_parser(name, TOOLS), text)
    assert got_content == content and _calls(got_calls) == calls


def _stream(name: str, text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[dict]]:
    stream, content, calls = CallStream(make_parser(name, TOOLS), parallel), "", []
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for kind, value in stream.feed(text[a:b], final=i == len(bounds) - 2):
            if kind == "content":  # it may follow calls too (text after them)
                content += value
            else:
                calls.append(value)
    return content, calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_pieces_reassemble_to_the_parse_in_any_chunking(name, text, content, calls):
    expected = parse_output(make_parser(name, TOOLS), text)
    rng = random.Random(len(text))
    chunkings = [list(range(1, len(text)))]  # one character at a time
    chunkings += [sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1)))) for _ in range(30)]
    for cuts in chunkings:
        got_content, got_calls = _stream(name, text, cuts)
        assert (got_content or None, got_calls) == expected, cuts


def test_partial_outputs_release_only_what_cannot_change():
    """Every prefix's reading is a prefix of the whole output's: streamed text is never taken back."""
    for name, text, _, _ in CASES:
        parser = make_parser(name, TOOLS)
        whole = parser.parse(text)
        for end in range(len(text) + 1):
            part = parser.split(text[:end], final=False)
            if part.content.strip():
                assert whole.content.startswith(part.content), (name, end)
            assert whole.calls[:len(part.calls)] == part.calls, (name, end)


def test_content_is_streamed_before_the_output_ends():
    stream = CallStream(make_parser("hermes", TOOLS))
    assert stream.feed("The answer", False) == [("content", "The answer")]
    assert stream.feed(" is <tool", False) == [("content", " is ")]  # "<tool" may open a call: held
    pieces = stream.feed('_call>{"name": "get_time", "arguments": {}}</tool_call>', False)
    assert pieces == [("call", {"name": "get_time", "arguments": "{}"})]  # a closed block goes out at once


def test_parallel_tool_calls_false_keeps_one_call():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
           '"arguments": {"city": "Rome"}}</tool_call>'
    assert [c["name"] for c in parse_output(make_parser("hermes", TOOLS), text, parallel=False)[1]] == ["get_time"]
    assert [c["name"] for c in _stream("hermes", text, [10, 40, 70], parallel=False)[1]] == ["get_time"]


@pytest.mark.parametrize("template, family, expected", [
    ("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}", "qwen2", "hermes"),
    ("<tool_call>\n<function={{ name }}>", "qwen3", "qwen3_coder"),
    ("[AVAILABLE_TOOLS]...[TOOL_CALLS]", "llama", "mistral"),
    ("<|python_tag|>{{ call }}", "llama", "llama3_json"),
    ("<|python_start|>", "llama", "pythonic"),
    ("<|im_start|>{{ message }}", "qwen3", "hermes"),
    ("[INST]{{ message }}[/INST]", "mistral", "mistral"),
])
def test_auto_picks_the_format_from_the_template_or_family(template, family, expected):
    assert resolve_parser_name("auto", template, family) == expected


def test_auto_refuses_to_guess_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="name one of"):
        resolve_parser_name("auto", "<|im_start|>{{ message }}", "llama")  # SmolLM2: no tool format
    with pytest.raises(ValueError, match="choose auto or one of"):
        resolve_parser_name("hermes2", None, "qwen3")
    assert resolve_parser_name("pythonic", None, "gemma3") == "pythonic"
    assert resolve_parser_name(None, None, "llama") is None


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"),
    ("mistral", "[TOOL_CALLS]" + "[" * 100_000 + "]" * 100_000),
    ("llama3_json", '{"name": "f", "parameters": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001),
    ("pythonic", "[f(a=" + "[" * 100_000 + "]" * 100_000 + ")]"),
])
def test_text_nested_too_deep_is_content_not_an_error(name, text):
    content, calls = parse_output(make_parser(name, TOOLS), text)
    assert content == text and calls == []


def test_qwen3_coder_keeps_a_value_it_cannot_read_as_text():
    deep = "[" * 100_000 + "]" * 100_000
    text = f"<tool_call><function=get_weather><parameter=days>{deep}</parameter></function></tool_call>"
    content, calls = parse_output(make_parser("qwen3_coder", TOOLS), text)
    assert content is None and _calls(calls) == [("get_weather", {"days": deep})]

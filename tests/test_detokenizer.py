"""IncrementalDetokenizer: streamed text equals the full decode; stop strings; special tokens."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged.engine.detokenizer import IncrementalDetokenizer, detokenize, find_stop_string
from jaxpaged.sampling_params import SamplingParams
from tests.conftest import tiny_tokenizer

MULTIBYTE_TEXTS = [
    "héllo wörld, ça va? Ñandú",
    "日本語のテキスト、中文文本",
    "emoji 🎉🚀 family 👨‍👩‍👧‍👦 flag 🇯🇵 skin 👍🏽",
    "e\u0301 combining, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and Ω≈ç√∫",
    "mixed ascii then 🙂 then 한국어 then end",
]
SMOL_TEXTS = MULTIBYTE_TEXTS + [
    "The quick brown fox jumps over the lazy dog.\nSecond line\twith a tab.",
    "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(3))",
    "   leading and trailing spaces   ",
    "Numbers 1234567890 and symbols !@#$%^&*()_+-=[]{}|;':\",./<>?",
]


@pytest.fixture(scope="module")
def tiny():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def smol():
    from jaxpaged.models.gguf_loader import open_gguf
    from jaxpaged.models.loader import resolve_model_path
    from jaxpaged.tokenizer import load_gguf_tokenizer
    return load_gguf_tokenizer(open_gguf(resolve_model_path("smollm2-135m-instruct")))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """`ids` cut into pieces of the given sizes (cycled; a size < 1 counts as 1)."""
    chunks, i, k = [], 0, 0
    while i < len(ids):
        size = max(1, sizes[k % len(sizes)]) if sizes else 1
        chunks.append(ids[i:i + size])
        i, k = i + size, k + 1
    return chunks


def stream(tokenizer, chunks, **kwargs):
    """Feed `chunks` like the engine does; returns (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, kwargs.pop("prompt_token_ids", ()), **kwargs)
    deltas = []
    for chunk in chunks:
        stop = detok.update(chunk)
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, detok
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, detok


# --- streamed text == full decode -------------------------------------------------------------

@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_byte_tokenizer_splits_characters_without_replacement_chars(tiny, text):
    ids = encode(tiny, text)
    assert len(ids) == len(text.encode())  # one token per byte: every multi-byte char is split
    deltas, detok = stream(tiny, [[t] for t in ids])
    assert "".join(deltas) == detok.output_text == text == detokenize(tiny, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # some token completed no character
    assert detok.num_output_tokens == len(ids)


@pytest.mark.parametrize("sizes", [[1], [3], [2, 5, 1], [10_000]])
@pytest.mark.parametrize("text", SMOL_TEXTS)
def test_smollm2_streamed_text_equals_decode(smol, text, sizes):
    ids = encode(smol, text)
    deltas, detok = stream(smol, chunked(ids, sizes))
    assert "".join(deltas) == detok.output_text == detokenize(smol, ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_prompt_context_does_not_leak_into_output(smol, tiny):
    for tok in (smol, tiny):
        prompt = encode(tok, "Some prompt that ends in 日本")
        ids = encode(tok, "語 and an answer 🎉")
        deltas, detok = stream(tok, [[t] for t in ids], prompt_token_ids=prompt)
        assert "".join(deltas) == detok.output_text == detokenize(tok, ids)


def test_decodes_a_bounded_window_per_token(tiny):
    """O(window) per token: no decode call sees more than a few tokens, however long the output."""
    seen = []

    class Counting:
        added_tokens_decoder = tiny.added_tokens_decoder

        def decode(self, ids, **kwargs):
            seen.append(len(ids))
            return tiny.decode(ids, **kwargs)

    text = "αβγ 🎉 " * 200
    ids = encode(tiny, text)
    deltas, detok = stream(Counting(), [[t] for t in ids], prompt_token_ids=encode(tiny, "prompt " * 50))
    assert "".join(deltas) == text
    assert max(seen) <= 8


def test_fast_tokenizers_stream_without_a_python_decode_per_token(tiny, smol, monkeypatch):
    """A fast tokenizer's tokens decode in tokenizers' DecodeStream: no Python decode call until the end."""
    for tokenizer in (tiny, smol):
        calls = []
        decode = tokenizer.decode
        monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(ids) or decode(ids, **kw))
        text = "αβγ 🎉 mixed " * 20
        deltas, detok = stream(tokenizer, [[t] for t in encode(tokenizer, text)],
                               prompt_token_ids=encode(tokenizer, "a prompt"))
        assert "".join(deltas) == text and calls == []
        monkeypatch.undo()


def test_a_failing_decode_stream_falls_back_to_python(tiny):
    """Where the DecodeStream fails (tokenizers refuses a window whose text does not extend its prefix's), the
    request decodes its window in Python from there on: same text."""
    class Failing:
        def step(self, tokenizer, token_id):
            raise Exception("invalid prefix")  # tokenizers raises plain Exceptions

    text = "héllo 🎉 wörld"
    detok = IncrementalDetokenizer(tiny, encode(tiny, "ctx"))
    ids = encode(tiny, text)
    detok.update(ids[:3])
    detok._stream = Failing()
    for t in ids[3:]:
        detok.update([t])
    assert detok._stream is None and detok.get_next_output_text(finished=True, delta=False) == text


@pytest.mark.parametrize("old", ["no DecodeStream", "no context ids"])
def test_an_older_tokenizers_decodes_in_python(tiny, monkeypatch, old):
    """tokenizers before 0.21 has no DecodeStream, before 0.22 one without context ids: the window then decodes in
    Python (the same text)."""
    from jaxpaged.engine import detokenizer

    def without_ids(*, skip_special_tokens=False):
        return object()
    monkeypatch.setattr(detokenizer, "DecodeStream", None if old == "no DecodeStream" else without_ids)
    text = "héllo 🎉 wörld"
    deltas, detok = stream(tiny, [[t] for t in encode(tiny, text)], prompt_token_ids=encode(tiny, "ctx"))
    assert detok._stream is None and "".join(deltas) == text


def test_a_tokenizer_without_a_rust_backend_decodes_in_python(tiny):
    """A slow tokenizer (no `backend_tokenizer`) has no DecodeStream: the window decodes in Python, the same text."""
    class Slow:
        def __getattr__(self, name):
            if name == "backend_tokenizer":
                raise AttributeError(name)
            return getattr(tiny, name)
    text = "héllo 🎉 wörld"
    deltas, detok = stream(Slow(), [[t] for t in encode(tiny, text)], prompt_token_ids=encode(tiny, "ctx"))
    assert detok._stream is None and "".join(deltas) == text


def test_non_incremental_text_reads_do_not_consume_deltas(tiny):
    detok = IncrementalDetokenizer(tiny, ())
    detok.update(encode(tiny, "hello"))
    assert detok.get_next_output_text(finished=False, delta=False) == "hello"
    assert detok.get_next_output_text(finished=False, delta=True) == "hello"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update(encode(tiny, " you"))
    assert detok.get_next_output_text(finished=True, delta=False) == "hello you"
    assert detok.get_next_output_text(finished=True, delta=True) == " you"


# --- incomplete characters at the end -----------------------------------------------------------

def test_flush_releases_trailing_incomplete_bytes_like_decode(tiny):
    ids = encode(tiny, "ok 🎉")[:-2]  # the emoji's last two bytes never come
    detok = IncrementalDetokenizer(tiny, ())
    detok.update(ids)
    assert detok.get_next_output_text(finished=False, delta=True) == "ok "
    assert detok.get_next_output_text(finished=True, delta=True) == detokenize(tiny, ids)[3:]
    assert detok.output_text == detokenize(tiny, ids)
    assert detok.flush() is None  # idempotent


def test_real_replacement_character_is_released_at_the_end(tiny):
    ids = encode(tiny, "bad \ufffd")
    deltas, detok = stream(tiny, [[t] for t in ids])
    assert "".join(deltas) == detok.output_text == "bad \ufffd"


# --- stop strings ---------------------------------------------------------------------------------

def test_stop_inside_one_token_drops_the_rest_of_it(smol):
    ids = encode(smol, "Hello information retrieval")
    assert detokenize(smol, ids[1:2]) == " information"  # precondition: one token
    deltas, detok = stream(smol, [[t] for t in ids], stop=("form",))
    assert detok.stop_reason == "form"
    assert "".join(deltas) == detok.output_text == "Hello in"
    assert detok.num_output_tokens == 2


def test_stop_across_tokens_and_multibyte_chars(tiny):
    ids = encode(tiny, "answer: 42 🎉🎉 and more")
    deltas, detok = stream(tiny, [[t] for t in ids], stop=("🎉🎉",))
    assert detok.stop_reason == "🎉🎉"
    assert "".join(deltas) == detok.output_text == "answer: 42 "
    assert not any("\ufffd" in d for d in deltas)


def test_stop_at_the_very_start(tiny, smol):
    for tok in (tiny, smol):
        deltas, detok = stream(tok, [[t] for t in encode(tok, "STOP right there")], stop=("STOP",))
        assert detok.stop_reason == "STOP"
        assert detok.output_text == "" and deltas[-1] == ""


@pytest.mark.parametrize("stops", [("STOP", "STOPPED"), ("STOPPED", "STOP")])
@pytest.mark.parametrize("sizes", [[1], [10_000]])
def test_shorter_stop_that_is_a_prefix_wins(tiny, stops, sizes):
    _, detok = stream(tiny, chunked(encode(tiny, "we STOPPED here"), sizes), stop=stops,
                      include_stop_str_in_output=True)
    assert detok.stop_reason == "STOP" and detok.output_text == "we STOP"


@pytest.mark.parametrize("stops", [("world", "hello"), ("hello", "world")])
@pytest.mark.parametrize("sizes", [[1], [4], [10_000]])
def test_first_stop_in_the_text_wins(tiny, stops, sizes):
    _, detok = stream(tiny, chunked(encode(tiny, "say hello world"), sizes), stop=stops)
    assert detok.stop_reason == "hello" and detok.output_text == "say "


def test_equal_ends_prefer_the_longer_stop():
    assert find_stop_string("xab", 0, ("b", "ab")) == ("ab", 1)
    assert find_stop_string("xab", 0, ("ab", "b")) == ("ab", 1)
    assert find_stop_string("abc", 3, ("abc",)) is None  # nothing new to search
    assert find_stop_string("abc", 2, ("abc",)) == ("abc", 0)


@pytest.mark.parametrize("sizes", [[1], [3], [10_000]])
def test_include_stop_str_in_output_keeps_it_and_drops_what_follows(tiny, smol, sizes):
    for tok in (tiny, smol):
        deltas, detok = stream(tok, chunked(encode(tok, "a list: 1, 2, 3. END of it"), sizes),
                               stop=("END", "3."), include_stop_str_in_output=True)
        assert detok.stop_reason == "3."
        assert "".join(deltas) == detok.output_text == "a list: 1, 2, 3."


def test_stream_holds_back_a_possible_stop_prefix(tiny):
    detok = IncrementalDetokenizer(tiny, (), stop=("STOP",))
    assert detok.update(encode(tiny, "go ST")) is None
    assert detok.get_next_output_text(finished=False, delta=True) == "go "  # "ST" held
    assert detok.update(encode(tiny, "OP and on")) == "STOP"
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.output_text == "go "

    detok = IncrementalDetokenizer(tiny, (), stop=("STOP",))
    detok.update(encode(tiny, "ST"))
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update(encode(tiny, "x"))
    assert detok.get_next_output_text(finished=False, delta=True) == "STx"
    detok.update(encode(tiny, "yzS"))
    assert detok.get_next_output_text(finished=False, delta=True) == "yz"
    assert detok.get_next_output_text(finished=True, delta=True) == "S"
    assert detok.output_text == "STxyzS" and detok.stop_reason is None


def test_hold_back_is_the_longest_possible_stop_prefix(tiny):
    detok = IncrementalDetokenizer(tiny, (), stop=("abcd", "cX"))
    assert detok.stop_buffer_length == 3
    for piece, released in (("xab", "x"), ("c", ""), ("Y", "abcY"), ("abcc", "abc"), ("X", "")):
        detok.update(encode(tiny, piece))
        assert detok.get_next_output_text(finished=False, delta=True) == released, piece
    assert detok.stop_reason == "cX" and detok.output_text == "xabcYabc"


def test_no_hold_back_without_stop_or_with_include(tiny):
    for kwargs in ({}, {"stop": ("STOP",), "include_stop_str_in_output": True}):
        detok = IncrementalDetokenizer(tiny, (), **kwargs)
        detok.update(encode(tiny, "go ST"))
        assert detok.get_next_output_text(finished=False, delta=True) == "go ST"


def test_min_tokens_ignores_stop_strings_in_early_text(tiny):
    ids = encode(tiny, "ab ab ab")
    _, detok = stream(tiny, [[t] for t in ids], stop=("ab",), min_tokens=4)
    assert detok.output_text == "ab " and detok.stop_reason == "ab"  # the stop ending at token 5


def test_update_after_stop_and_bad_arguments_raise(tiny):
    detok = IncrementalDetokenizer(tiny, (), stop="x")
    assert detok.update(encode(tiny, "ax")) == "x" and detok.finished
    with pytest.raises(RuntimeError, match="already ended"):
        detok.update(encode(tiny, "b"))
    # the detokenizer's stop strings and min_tokens come from SamplingParams, which refuses bad ones
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=("",))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)


# --- special tokens ---------------------------------------------------------------------------

@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tiny, smol, skip):
    cases = [(tiny, [256, *encode(tiny, "hé"), 258, 259, *encode(tiny, "llo 🎉"), 257]),
             (smol, [1, *encode(smol, "assistant\nhi 世界"), 2, 0])]
    for tok, ids in cases:
        deltas, detok = stream(tok, [[t] for t in ids], skip_special_tokens=skip)
        assert "".join(deltas) == detok.output_text == detokenize(tok, ids, skip_special_tokens=skip)
        assert ("<|" in detok.output_text) is not skip


def test_special_token_between_bytes_of_one_character(tiny):
    emoji = encode(tiny, "🎉")
    ids = [*emoji[:2], 258, *emoji[2:]]
    _, detok = stream(tiny, [[t] for t in ids], skip_special_tokens=True)
    assert detok.output_text == detokenize(tiny, ids, skip_special_tokens=True) == "🎉"


def test_stop_terminated_token_text_is_left_out(tiny):
    ids = [*encode(tiny, "done"), 257]
    for include, expected in ((False, "done"), (True, "done<|eos|>")):
        detok = IncrementalDetokenizer(tiny, (), skip_special_tokens=False,
                                       include_stop_str_in_output=include)
        assert detok.update(ids, stop_terminated=True) is None
        assert detok.get_next_output_text(finished=True, delta=False) == expected
        assert detok.num_output_tokens == 5


# --- properties -------------------------------------------------------------------------------

TEXT = st.text(max_size=40)
SIZES = st.lists(st.integers(1, 6), min_size=1, max_size=8)
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(text=TEXT, sizes=SIZES, use_smol=st.booleans())
def test_random_text_and_chunking_streams_to_decode(tiny, smol, text, sizes, use_smol):
    tok = smol if use_smol else tiny
    ids = encode(tok, text)
    decoded = detokenize(tok, ids)  # SmolLM2 lacks a few byte tokens (e.g. 0xF1): not always text
    deltas, detok = stream(tok, chunked(ids, sizes))
    assert "".join(deltas) == detok.output_text == decoded
    assert use_smol or decoded == text
    if "\ufffd" not in decoded:
        assert not any("\ufffd" in d for d in deltas)


@PROPERTY
@given(before=TEXT, stop=st.text(min_size=1, max_size=6), after=TEXT, sizes=SIZES,
       use_smol=st.booleans(), include=st.booleans())
def test_random_stop_string_cuts_at_first_occurrence(tiny, smol, before, stop, after, sizes,
                                                     use_smol, include):
    tok = smol if use_smol else tiny
    ids = encode(tok, before + stop + after)
    text = detokenize(tok, ids)  # == before + stop + after unless SmolLM2 lacks a byte token
    first = text.find(stop)
    deltas, detok = stream(tok, chunked(ids, sizes), stop=(stop,), include_stop_str_in_output=include)
    expected = text if first < 0 else text[:first + (len(stop) if include else 0)]
    assert detok.stop_reason == (None if first < 0 else stop)
    assert "".join(deltas) == detok.output_text == expected
    assert use_smol or first >= 0


@PROPERTY
@given(text=st.text(alphabet="abcé🎉 ", max_size=30),
       stops=st.lists(st.text(alphabet="abcé🎉 ", min_size=1, max_size=4), min_size=1, max_size=3),
       sizes=SIZES, include=st.booleans())
def test_stop_result_does_not_depend_on_chunking(tiny, text, stops, sizes, include):
    ids = encode(tiny, text)
    kwargs = dict(stop=tuple(stops), include_stop_str_in_output=include)
    one_by_one = stream(tiny, chunked(ids, [1]), **kwargs)
    random_chunks = stream(tiny, chunked(ids, sizes), **kwargs)
    all_at_once = stream(tiny, [ids], **kwargs)
    for deltas, detok in (one_by_one, random_chunks, all_at_once):
        assert "".join(deltas) == detok.output_text
        assert (detok.output_text, detok.stop_reason) == (one_by_one[1].output_text,
                                                          one_by_one[1].stop_reason)

"""Streaming text: incremental detokenization and stop-string matching."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from musegl_core.engine.detokenize import IncrementalDetokenizer, hidden_ids
from musegl_core.engine.stops import StopMatcher
from musegl_core.tiny import build_tiny_tokenizer
from musegl_core.tokenizer import MuseTokenizer, byte_level_alphabet

FIXTURE_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return build_tiny_tokenizer()


def byte_ids(tokenizer: MuseTokenizer, data: bytes) -> list[int]:
    """One single-byte token per byte: every split point of every character."""
    alphabet = byte_level_alphabet()
    return [tokenizer.token_id(alphabet[b]) for b in data]


def stream(tokenizer: MuseTokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.push(i) for i in ids] + [detokenizer.flush()]


# -- detokenizer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["é", "日本語", "🙂", "👩‍👩‍👧", "a🇳🇴b", "x\u0301y"])
def test_multibyte_characters_split_byte_by_byte(tokenizer: MuseTokenizer, text: str) -> None:
    data = text.encode()
    pieces = stream(tokenizer, byte_ids(tokenizer, data))
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)
    for k in range(len(data) + 1):  # after k bytes: exactly the complete characters
        emitted = "".join(pieces[:k])
        assert emitted == data[:k].decode("utf-8", errors="ignore")


@FIXTURE_SETTINGS
@given(text=st.text(max_size=40), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_split_into_byte_level_tokens(tokenizer: MuseTokenizer, text: str, cuts: list[int]) -> None:
    """Bytes grouped at arbitrary cut points (merged tokens where the vocabulary has them)."""
    data = text.encode()
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    ids: list[int] = []
    for start, end in zip(bounds, bounds[1:]):
        chunk = data[start:end]
        symbol = "".join(byte_level_alphabet()[b] for b in chunk)
        whole = tokenizer.token_id(symbol)
        ids.extend([whole] if whole is not None and whole < 200000 else byte_ids(tokenizer, chunk))
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces) or "\ufffd" in text


@FIXTURE_SETTINGS
@given(text=st.text(max_size=60))
def test_stream_of_encoded_text(tokenizer: MuseTokenizer, text: str) -> None:
    ids = tokenizer.encode(text, special=False)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == text
    for k in range(len(ids) + 1):
        assert text.startswith("".join(pieces[:k]))


def test_special_tokens_come_out_as_strings(tokenizer: MuseTokenizer) -> None:
    ids = [tokenizer.start_id, *tokenizer.encode("assistant", special=False), tokenizer.message_id,
           *byte_ids(tokenizer, "🙂".encode()), tokenizer.eom_id]
    assert "".join(stream(tokenizer, ids)) == "<|start|>assistant<|message|>🙂<|eom|>"


def test_incomplete_and_invalid_bytes(tokenizer: MuseTokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    first, second = byte_ids(tokenizer, "🙂".encode()[:2])
    assert detokenizer.push(first) == "" and detokenizer.push(second) == ""
    assert detokenizer.pending_bytes == "🙂".encode()[:2]
    # A special token interrupts the character: the bytes are invalid now, said at once.
    assert detokenizer.push(tokenizer.eot_id) == "\ufffd<|eot|>"
    assert detokenizer.push(byte_ids(tokenizer, b"\xe6")[0]) == ""
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.flush() == ""
    with pytest.raises(RuntimeError):
        detokenizer.push(first)


def test_ids_without_token_are_silent() -> None:
    from tests.support.toy_tokenizer import toy_tokenizer_document

    toy = MuseTokenizer(toy_tokenizer_document(), vocab_size=300, pre="llama4")
    assert "".join(stream(toy, [258, *toy.encode("ok", special=False), 299])) == "ok"


# -- stop strings ------------------------------------------------------------------------------------
def run(matcher: StopMatcher, chunks: list[str]) -> tuple[str, str | None]:
    out = []
    for chunk in chunks:
        text, matched = matcher.push(chunk)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    out.append(matcher.flush())
    return "".join(out), matcher.matched


def test_stop_is_removed_with_everything_after() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.push("The answer is 4.") == ("The answer is 4.", None)
    assert matcher.push(" E") == (" ", None)
    assert matcher.held == "E"
    assert matcher.push("NDnot shown") == ("", "END")
    assert matcher.push("more") == ("", None)
    assert matcher.flush() == ""
    assert matcher.matched == "END" and matcher.matched_request_stop


def test_hold_back_released_when_the_stop_fails() -> None:
    matcher = StopMatcher(["Hello"])
    assert matcher.push("Hel") == ("", None)
    assert matcher.push("p!") == ("Help!", None)
    assert matcher.push("Hell") == ("", None)
    assert matcher.flush() == "Hell"
    assert matcher.matched is None


def test_earliest_match_wins() -> None:
    assert run(StopMatcher(["world", "lo w"]), ["hello world"]) == ("hel", "lo w")
    assert run(StopMatcher(["b"], ["ab"]), ["xab"]) == ("x", "ab")  # a template stop that starts earlier


def test_request_stop_wins_at_the_same_position() -> None:
    assert run(StopMatcher(["ab"], ["ab"]), ["xab"]) == ("x", "ab")
    matcher = StopMatcher(["abc"], ["ab"])
    assert matcher.push("xab") == ("x", None)  # "ab" matched, but "abc" may still come
    assert matcher.push("c") == ("", "abc")
    assert matcher.matched_request_stop
    matcher = StopMatcher(["abc"], ["ab"])
    assert matcher.push("xab") == ("x", None)
    assert matcher.push("d") == ("", "ab")
    assert not matcher.matched_request_stop
    matcher = StopMatcher(["abc"], ["ab"])  # generation ends while undecided: the template stop holds
    assert matcher.push("xab") == ("x", None)
    assert matcher.flush() == "" and matcher.matched == "ab"


def test_shorter_stop_completes_first_and_empty_stops_are_ignored() -> None:
    assert run(StopMatcher(["abc", "ab", ""]), ["xa", "bc"]) == ("x", "ab")
    assert run(StopMatcher([""]), ["anything"]) == ("anything", None)


def oracle(text: str, request: list[str], template: list[str]) -> tuple[str, str | None]:
    """Whole-text answer: earliest start, then request before template, then shortest."""
    candidates = []
    for kind, stops in ((0, request), (1, template)):
        for stop in stops:
            if stop and (at := text.find(stop)) >= 0:
                candidates.append((at, kind, len(stop), stop))
    if not candidates:
        return text, None
    at, _kind, _length, stop = min(candidates)
    return text[:at], stop


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc<|>", max_size=30),
    request=st.lists(st.text(alphabet="abc<|>", min_size=1, max_size=4), max_size=3),
    template=st.lists(st.text(alphabet="abc<|>", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_chunking_never_changes_the_result(text: str, request: list[str], template: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run(StopMatcher(request, template), chunks) == oracle(text, request, template)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="ab", max_size=20), stop=st.text(alphabet="ab", min_size=1, max_size=4))
def test_emitted_text_never_contains_a_stop_prefix_that_could_complete(text: str, stop: str) -> None:
    matcher = StopMatcher([stop])
    emitted = ""
    for ch in text:
        out, matched = matcher.push(ch)
        emitted += out
        if matched:
            break
        assert stop not in emitted
        assert emitted + matcher.held == text[: len(emitted) + len(matcher.held)]
        assert len(matcher.held) < len(stop)


@pytest.mark.parametrize("special_tokens, expected", [
    ("all", "a<|patch|>b<|reserved_special_token_5|> c<|eom|>"),
    ("control", "ab c<|eom|>"),  # skip_special_tokens on chat: the channel parser still reads <|eom|>
    ("none", "ab c"),  # skip_special_tokens on /v1/completions
])
def test_skip_special_tokens_leaves_the_hidden_ids_out(tokenizer: MuseTokenizer, special_tokens: str,
                                                      expected: str) -> None:
    ids = tokenizer.encode("a<|patch|>b<|reserved_special_token_5|> c<|eom|>", special=True)
    detokenizer = IncrementalDetokenizer(tokenizer, hidden_ids(tokenizer, special_tokens))
    assert "".join(detokenizer.push(i) for i in ids) + detokenizer.flush() == expected

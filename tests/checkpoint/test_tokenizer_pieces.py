"""Long text is tokenized in bounded pieces with the same ids as the whole
string; a tokenizer failure (a Rust panic) is a TokenizationError; a budget
stops tokenization early; the length floor never exceeds the true count."""

from __future__ import annotations

import random

import pytest
from tokenizers import Regex, pre_tokenizers

import musegl_core.tokenizer as tk
from musegl_core.engine.request import PromptSegment
from musegl_core.tiny import build_tiny_tokenizer
from musegl_core.tokenizer import (
    PRE_TOKENIZER_PATTERNS,
    MuseTokenizer,
    TokenBudgetExceeded,
    TokenizationError,
    split_for_encoding,
)

PATTERNS = sorted(set(PRE_TOKENIZER_PATTERNS.values()))

#: Pieces of ordinary text, and the characters the split patterns treat specially.
ALPHABET = [
    "a", "b", "z", "Q", "Z", "the", "Hello", "WORLD", " ", " ", " ", "  ", "\t", "\n", "\n\n", "\r\n", "'", "'s",
    "'LL", "'t", "1", "23", "4567", ".", ",", "/", "-", "--", "!?", "(", ")", "é", "e\u0301", "中", "文", "ß",
    "ǅ", "ʰ", "²", "½", "٣", "\u00a0", "\u3000", "\u2009", "😀", "\u200b", "_", "\x1c", "ĳ", "Ⅻ",
]


def random_text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(pieces))


def ordinary_text() -> str:
    """About 200 KB of prose, code, numbers, lists and several scripts."""
    paragraphs = [
        "The quick brown fox jumps over the lazy dog. It's 3.14159 o'clock; don't WORRY, we'll be fine!\n",
        "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n\tfor _ in range(n):\n        a, b = b, a + b\r\n",
        "Zürich, Straße, naïve café — Ελληνικά, русский, 日本語のテキスト, 한국어 문장, العربية ١٢٣.\n\n",
        "id,name,price\n1,apple,0.5\n22,banana,12.25\n333,cherry,1999\n",
        "    indented   text  with   runs of   spaces\t\tand tabs   \n",
        "SGVsbG8gd29ybGQhIFRoaXMgaXMgYmFzZTY0IGRhdGEgMTIzNDU2Nzg5MA== https://example.com/a/b?c=1&d=2\n",
        "Emoji 🙂👍🏽 and ZWJ 👩‍👩‍👧, <|eot|> written by a user, [PAD12] and \\u1234 escapes.\n",
    ]
    rng = random.Random(7)
    return "".join(rng.choice(paragraphs) for _ in range(2500))


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return build_tiny_tokenizer()


def boundaries(pattern: str, text: str) -> list[tuple[int, int]]:
    splitter = pre_tokenizers.Split(Regex(pattern), "isolated")
    return [offsets for _piece, offsets in splitter.pre_tokenize_str(text)]


def piecewise_boundaries(pattern: str, pieces: list[str]) -> list[tuple[int, int]]:
    out, at = [], 0
    for piece in pieces:
        out.extend((at + a, at + b) for a, b in boundaries(pattern, piece))
        at += len(piece)
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_exact_cut_keeps_every_pattern_s_pre_tokens(pattern):
    """At every position the cut rule calls exact, the split regex finds the
    same pre-tokens in the two sides as in the whole text (so the ids are equal
    for any vocabulary)."""
    rng = random.Random(1)
    checked = 0
    for _ in range(500):
        text = random_text(rng, rng.randint(2, 40))
        whole = boundaries(pattern, text)
        for at in range(1, len(text)):
            if tk._exact_cut(text, at):
                assert piecewise_boundaries(pattern, [text[:at], text[at:]]) == whole, (text, at)
                checked += 1
    assert checked > 1000
    # The comparison does see a wrong cut: inside a digit group, before a word's space.
    for text, at in (("12345", 2), ("a word", 2)):
        assert not tk._exact_cut(text, at)
        assert piecewise_boundaries(pattern, [text[:at], text[at:]]) != boundaries(pattern, text)


def test_split_for_encoding_reports_hard_cuts():
    rng = random.Random(2)
    for _ in range(300):
        text = random_text(rng, rng.randint(10, 120))
        pieces, exact = split_for_encoding(text, 12)
        assert "".join(pieces) == text and all(0 < len(p) <= 12 for p in pieces)
        cuts = [sum(map(len, pieces[:i])) for i in range(1, len(pieces))]
        assert exact == all(tk._exact_cut(text, at) for at in cuts)
    pieces, exact = split_for_encoding("A" * 30, 12)
    assert pieces == ["A" * 12, "A" * 12, "A" * 6] and not exact


def test_ordinary_text_gives_the_ids_of_the_whole_string(tokenizer):
    text = ordinary_text()
    pieces, exact = split_for_encoding(text)
    assert exact and len(pieces) > 20
    whole = tokenizer._plain.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text, special=False) == whole
    for pattern in PATTERNS:
        assert piecewise_boundaries(pattern, pieces) == boundaries(pattern, text)


def test_special_text_keeps_added_tokens_across_pieces(tokenizer):
    text = ("<|start|>user<|message|>" + "Tell me about <|patch|> things. " * 600 + "<|eot|>") * 4
    assert len(text) > tk.PIECE_CHARS
    whole = tokenizer._tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text, special=True) == whole


def test_the_whole_segments_path_matches_for_a_long_prompt(tokenizer):
    text = ordinary_text()[:60_000]
    segments = (PromptSegment(text="<|begin_of_text|><|start|>user<|message|>", special=True),
                PromptSegment(text=text, special=False),
                PromptSegment(text="<|eot|><|start|>assistant<|message|>", special=True))
    ids = tokenizer.encode_segments(segments)
    reference = [tokenizer.bos_id, tokenizer.start_id, *tokenizer._plain.encode("user").ids, tokenizer.message_id,
                 *tokenizer._plain.encode(text).ids, tokenizer.eot_id, tokenizer.start_id,
                 *tokenizer._plain.encode("assistant").ids, tokenizer.message_id]
    assert ids == reference


@pytest.mark.slow  # 10 MiB twice (tests/http/test_hostile_input.py covers it over HTTP in the default suite)
def test_a_long_run_of_one_letter_is_tokenized_not_a_panic(tokenizer):
    """10 MiB of 'A' makes Oniguruma's regex search panic when tokenized whole
    (pyo3_runtime.PanicException, a BaseException); in pieces it works."""
    text = "A" * (10 << 20)
    with pytest.raises(BaseException) as whole:
        tokenizer._plain.encode(text, add_special_tokens=False)
    assert type(whole.value).__name__ == "PanicException"
    ids = tokenizer.encode(text, special=False)
    assert len(ids) >= len(text) // tokenizer.longest_token_bytes
    assert tokenizer.encode("Hello there", special=False) == tokenizer._plain.encode("Hello there").ids


def test_a_tokenizer_panic_is_a_tokenization_error(tokenizer, monkeypatch):
    """Whatever the tokenizer raises, a BaseException from Rust included, is a
    TokenizationError for that text; KeyboardInterrupt is not swallowed."""
    text = "A" * (tk.PIECE_CHARS + 1)

    class Failing:
        def __init__(self, error):
            self.error = error

        def encode(self, *args, **kwargs):
            raise self.error

        encode_batch = encode

    panic = type("PanicException", (BaseException,), {})("Onig: Regex search error: retry-limit-in-match over")
    for length in (10, len(text)):
        monkeypatch.setattr(tokenizer, "_plain_tokenizer", Failing(panic))
        with pytest.raises(TokenizationError, match="retry-limit-in-match"):
            tokenizer.encode(text[:length], special=False)
    monkeypatch.setattr(tokenizer, "_plain_tokenizer", Failing(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        tokenizer.encode(text, special=False)


def test_a_budget_stops_tokenizing_early(tokenizer, monkeypatch):
    calls = []
    real = tokenizer._plain

    class Counting:
        def encode(self, *args, **kwargs):
            return real.encode(*args, **kwargs)

        def encode_batch(self, batch, **kwargs):
            calls.append(sum(map(len, batch)))
            return real.encode_batch(batch, **kwargs)

    monkeypatch.setattr(tokenizer, "_plain_tokenizer", Counting())
    text = "word " * 2_000_000  # 10 MB
    segments = (PromptSegment(text="<|begin_of_text|>", special=True), PromptSegment(text=text, special=False))
    with pytest.raises(TokenBudgetExceeded) as exceeded:
        tokenizer.encode_segments(segments, limit=1000)
    assert exceeded.value.at_least > 1000
    assert sum(calls) <= tk.BATCH_PIECES * tk.PIECE_CHARS  # one batch, not 10 MB


def test_the_length_floor_never_exceeds_the_count(tokenizer):
    rng = random.Random(3)
    longest = "".join(sorted(tokenizer._id_to_symbol.values(), key=len)[-1:])
    texts = [random_text(rng, rng.randint(0, 300)) for _ in range(200)]
    texts += ["<|begin_of_text|>" * 3 + "hi", tokenizer.decode([tokenizer.token_id(longest)]) * 50, ""]
    for text in texts:
        for segments in ((PromptSegment(text=text, special=False),), (PromptSegment(text=text, special=True),),
                         (PromptSegment(text=text, special=True), PromptSegment(token_ids=(5, 6)))):
            assert tokenizer.token_count_floor(segments) <= len(tokenizer.encode_segments(segments))


def test_long_runs_are_tokenized_once_and_hits_are_exact(tokenizer, monkeypatch):
    """Agents resend the same system prompt and history every turn: a long text run's ids are
    remembered (RunCache), so the second prompt tokenizes only its new run, with the same ids."""
    tokenizer.runs = tk.RunCache()
    system, history = ordinary_text()[:20_000], ordinary_text()[20_000:23_000]
    first = (PromptSegment(text="<|begin_of_text|><|start|>system<|message|>", special=True),
             PromptSegment(text=system, special=False), PromptSegment(text="<|end|><|start|>user<|message|>"),
             PromptSegment(text=history, special=False), PromptSegment(text="<|eot|>"))
    second = first + (PromptSegment(text="<|start|>user<|message|>"),
                      PromptSegment(text=ordinary_text()[30_000:32_000], special=False), PromptSegment(text="<|eot|>"))
    cold = tokenizer.encode_segments(first)
    encoded: list[int] = []
    real = tokenizer.encode_bounded
    monkeypatch.setattr(tokenizer, "encode_bounded", lambda text, **kw: encoded.append(len(text)) or real(text, **kw))
    assert tokenizer.encode_segments(first) == cold
    assert not any(n >= tk.RUN_CACHE_MIN_CHARS for n in encoded)  # both long runs came from the cache
    encoded.clear()
    warm = tokenizer.encode_segments(second)
    assert [n for n in encoded if n >= tk.RUN_CACHE_MIN_CHARS] == [2_000]  # only the new run
    tokenizer.runs = tk.RunCache()
    assert tokenizer.encode_segments(second) == warm  # as without the cache
    assert tokenizer.runs.hits == 0


def test_a_cached_run_still_honours_the_budget(tokenizer):
    tokenizer.runs = tk.RunCache()
    segments = (PromptSegment(text="<|begin_of_text|>", special=True),
                PromptSegment(text=ordinary_text()[:10_000], special=False))
    n = len(tokenizer.encode_segments(segments))
    assert tokenizer.runs.size[0] == 1
    with pytest.raises(TokenBudgetExceeded) as exceeded:
        tokenizer.encode_segments(segments, limit=n - 10)
    assert exceeded.value.at_least >= n - 1 and tokenizer.runs.hits == 1  # (the BOS id is put first at the end)


def test_the_run_cache_keeps_the_most_recent_runs_within_its_bound():
    cache = tk.RunCache(max_ids=40, min_chars=4)
    for k in range(10):
        cache.put(f"text {k}", list(range(10)))
    assert cache.size == (4, 40)
    assert cache.get("text 0") is None and cache.get("text 9") == list(range(10))
    cache.put("tiny", list(range(11)))  # over a quarter of the bound: not kept
    assert cache.get("tiny") is None
    texts = tk.RunCache(max_ids=1000, min_chars=4, max_chars=40)
    for k in range(5):
        texts.put(f"run {k:5d}", [k])  # 9 characters each
    assert texts.size == (4, 4)  # 36 characters
    texts.put("x" * 11, [1])  # over a quarter of the characters: not kept
    assert texts.get("x" * 11) is None
    assert cache.get("abc") is None and cache.misses == 2  # shorter than min_chars: not even looked up


def test_warm_builds_what_the_first_request_would_wait_for():
    """The worker calls ``warm()`` before it reports ready: afterwards neither the client-text
    tokenizer nor the longest token's length is built on a request's time."""
    from musegl_core.tiny import build_tiny_tokenizer
    from musegl_core.tokenizer import MuseTokenizer

    shared = build_tiny_tokenizer()  # (one object per process)
    fresh = MuseTokenizer(shared._document, vocab_size=shared.vocab_size, pre="llama4")
    assert fresh._plain_tokenizer is None and "longest_token_bytes" not in vars(fresh)
    assert fresh._added_pattern is None
    fresh.warm()
    assert fresh._plain_tokenizer is not None and vars(fresh)["longest_token_bytes"] >= 1
    assert fresh._added_pattern is not None
    assert fresh.encode("hello there", special=False)

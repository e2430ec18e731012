"""The Muse Glimmer tokenizer: byte-level BPE with control tokens resolved by string.

:class:`MuseTokenizer` wraps a :class:`tokenizers.Tokenizer` built either from a
``tokenizer.json`` (a Hugging Face directory) or from the ``tokenizer.ggml.*``
metadata of a GGUF file. Both routes produce the same
tokenizer: one byte-level BPE model, a regex split chosen by the llama.cpp
pre-tokenizer tag, and the added (control) tokens pinned to their ids.

Two rules of the chat format shape the API:

* nothing adds a BOS behind the caller's back: :meth:`MuseTokenizer.encode`
  never does, and :meth:`MuseTokenizer.encode_segments` makes the prompt start
  with exactly one BOS id;
* text a client wrote is encoded with ``special=False``: a written
  ``<|eot|>`` is then plain characters, never the control token.

Every special id is looked up by its string at load time.
"""

from __future__ import annotations

import re

import array
import collections
import functools
import json
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from tokenizers import Tokenizer

from musegl_core.checkpoint.gguf_tokenizer import read_gguf_tokenizer_data
from musegl_core.checkpoint.tokenizer_data import (
    CONTROL,
    NORMAL,
    UNUSED,
    USER_DEFINED,
    GGUFTokenizerData,
    TokenizerError,
)

# load_once's per-process memo: (what, resolved path, size, mtime_ns) -> tokenizer.
_LOADED: dict[tuple[str, str, int, int], "MuseTokenizer"] = {}
_LOADED_LOCK = threading.Lock()

if TYPE_CHECKING:
    from gguf import GGUFReader

    from musegl_core.engine.request import PromptSegment

__all__ = [
    "MuseTokenizer",
    "TokenizerError",
    "TokenizationError",
    "TokenBudgetExceeded",
    "PIECE_CHARS",
    "split_for_encoding",
    "PRE_TOKENIZER_PATTERNS",
    "load_once",
    "byte_level_alphabet",
    "byte_level_bpe_document",
]

# -- pre-tokenizer split patterns, keyed by llama.cpp's ``tokenizer.ggml.pre`` tag ----------

#: The GPT-4o-style split that Llama 4's tokenizer.json carries; llama.cpp maps the
#: ``llama4`` and ``gpt-4o`` tags to (an Oniguruma-free rewrite of) this pattern.
GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Llama 3's split (llama.cpp tags ``llama3``, ``llama-v3``, ``llama-bpe``).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: GPT-2's split (llama.cpp tag ``gpt2``).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

PRE_TOKENIZER_PATTERNS: Mapping[str, str] = {
    "llama4": GPT4O_PATTERN,
    "gpt-4o": GPT4O_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "llama-v3": LLAMA3_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "gpt2": GPT2_PATTERN,
}
#: llama.cpp's Llama-3 family tags encode a whole pre-token found in the vocabulary
#: directly ("ignore_merges"); the other tags run the merges.
_IGNORE_MERGES_TAGS = frozenset({"llama3", "llama-v3", "llama-bpe"})
#: The tag (and pattern) used when a GGUF names a tag this module does not know.
FALLBACK_PRE = "llama4"

BOS_STRING = "<|begin_of_text|>"
EOS_STRING = "<|end_of_text|>"
PAD_STRING = "<|finetune_right_pad|>"
MASK_STRING = "<|mask|>"


class TokenizationError(ValueError):
    """The tokenizer failed on one text (a client's input): a 400 for that
    request, never a crash. ``tokenizers`` reports some failures as a Rust
    panic (``pyo3_runtime.PanicException``, a ``BaseException``); they become
    this error too."""


class TokenBudgetExceeded(ValueError):
    """A text certainly needs more than ``limit`` tokens: at least ``at_least``
    were counted when tokenization stopped."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the text needs at least {at_least} tokens, over the limit of {limit}")
        self.at_least = at_least
        self.limit = limit


# -- tokenizing long text in pieces -------------------------------------------------------------
#: Text longer than this many characters is tokenized in pieces of at most this
#: many characters, cut where the split regex (every pattern of
#: :data:`PRE_TOKENIZER_PATTERNS`) cannot join the two sides, so the ids are
#: those of the whole text. This bounds the regex engine's work per search
#: (one run of 10 MiB of ``A`` exhausts Oniguruma's retry limit and panics) and
#: lets other threads run between pieces.
PIECE_CHARS = 8192
#: Text up to this many characters is encoded with the GIL held (``Tokenizer.encode``); longer
#: text through ``encode_batch``, which releases it, so the engine thread runs meanwhile
#: (docs/engine.md, "Sharing the GIL with the engine thread").
SHORT_CHARS = 256
#: A text run of a rendered prompt (:meth:`MuseTokenizer.encode_segments`) at least this long
#: is remembered with its ids: agents resend the same system prompt, tool list and history
#: every turn, so a turn tokenizes only what is new. Shorter runs cost little to encode.
RUN_CACHE_MIN_CHARS = 1024
#: Most ids (4 bytes each) and characters of text the run cache holds, least recently used
#: out first (about 8 MB at most); a run over a quarter of either is not kept.
RUN_CACHE_IDS = 1 << 20
RUN_CACHE_CHARS = 1 << 22


class RunCache:
    """Ids of long text runs, least recently used evicted past ``max_ids`` (thread-safe:
    a worker prepares requests on several threads). The ids of a run are a function of
    its text alone (runs are tokenized on their own), so a hit is exact."""

    def __init__(self, max_ids: int = RUN_CACHE_IDS, min_chars: int = RUN_CACHE_MIN_CHARS,
                 max_chars: int = RUN_CACHE_CHARS):
        self.max_ids = max_ids
        self.min_chars = min_chars
        self.max_chars = max_chars
        self._runs: "collections.OrderedDict[str, array.array]" = collections.OrderedDict()
        self._ids = 0
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, text: str) -> list[int] | None:
        if len(text) < self.min_chars:
            return None
        with self._lock:
            ids = self._runs.get(text)
            if ids is None:
                self.misses += 1
                return None
            self._runs.move_to_end(text)
            self.hits += 1
        return ids.tolist()

    def put(self, text: str, ids: Sequence[int]) -> None:
        if not self.min_chars <= len(text) <= self.max_chars // 4 or len(ids) > self.max_ids // 4:
            return
        packed = array.array("i", ids)
        with self._lock:
            if text in self._runs:
                return
            self._runs[text] = packed
            self._ids += len(packed)
            self._chars += len(text)
            while self._ids > self.max_ids or self._chars > self.max_chars:
                dropped_text, dropped = self._runs.popitem(last=False)
                self._ids -= len(dropped)
                self._chars -= len(dropped_text)

    @property
    def size(self) -> tuple[int, int]:
        """``(runs, ids)`` held."""
        with self._lock:
            return len(self._runs), self._ids
#: Pieces per ``encode_batch`` call (the GIL is released during each call).
BATCH_PIECES = 64
#: Zero-width candidates for an exact cut; :func:`_exact_cut` decides.
_CUT_CANDIDATES = re.compile(r"(?<=\S)(?= )|(?<=[^\W_])(?=[\r\n])|(?<=[^\W\d_])(?=\d)|(?<=\d)(?=[^\W\d_])")
#: How far back from a piece's end to look for a cut, widening until found.
_CUT_TAILS = (256, 2048)


def _exact_cut(text: str, at: int) -> bool:
    """Whether no match of the known split patterns can contain both
    ``text[at - 1]`` and ``text[at]``, so tokenizing ``text[:at]`` and
    ``text[at:]`` apart gives the ids of ``text``.

    Holds for: a space after a non-space (a space only opens a match, or sits
    in an all-whitespace one); a line break after a letter or digit (only
    punctuation takes a line break behind it); a letter next to a decimal
    digit (letters and digits never share a match). Python's ``isspace`` is a
    superset of the regex's ``\\s``, ``isalpha`` is ``\\p{L}``, and
    ``isdecimal`` is ``\\p{Nd}``, so each test errs on the safe side.
    """
    before, after = text[at - 1], text[at]
    if after == " ":
        return not before.isspace()
    if after in "\r\n":
        return before.isalpha() or before.isdecimal()
    if after.isdecimal():
        return before.isalpha()
    return after.isalpha() and before.isdecimal()


def _last_cut(text: str, lo: int, hi: int) -> int | None:
    """The last exact cut in ``(lo, hi]``, looking back from ``hi`` (None: none)."""
    for tail in (*_CUT_TAILS, hi - lo):
        start = max(lo + 1, hi - tail)
        for match in reversed(list(_CUT_CANDIDATES.finditer(text, start, hi + 1))):
            at = match.start()
            if lo < at <= hi and _exact_cut(text, at):
                return at
        if start == lo + 1:
            break
    return None


def split_for_encoding(text: str, limit: int = PIECE_CHARS) -> tuple[list[str], bool]:
    """``text`` cut into pieces of at most ``limit`` characters, and whether
    every cut is exact (:func:`_exact_cut`). A stretch of more than ``limit``
    characters with no exact cut (a run without whitespace, letters next to
    digits or line breaks) is cut at ``limit`` anyway; only the ids at such a
    cut differ from the whole text's."""
    if len(text) <= limit:
        return [text], True
    pieces: list[str] = []
    exact = True
    lo = 0
    while len(text) - lo > limit:
        at = _last_cut(text, lo, lo + limit)
        if at is None:
            at, exact = lo + limit, False
        pieces.append(text[lo:at])
        lo = at
    pieces.append(text[lo:])
    return pieces, exact


# -- byte-level alphabet ---------------------------------------------------------------------
@functools.cache
def byte_level_alphabet() -> tuple[str, ...]:
    """GPT-2's byte → printable character map: ``byte_level_alphabet()[b]`` is byte ``b``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


@functools.cache
def _byte_decoder() -> Mapping[str, int]:
    return {ch: b for b, ch in enumerate(byte_level_alphabet())}


def _symbol_bytes(symbol: str) -> bytes:
    """The bytes a byte-level BPE symbol stands for (characters outside the alphabet as UTF-8)."""
    decoder = _byte_decoder()
    out = bytearray()
    for ch in symbol:
        b = decoder.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _looks_like_control(text: str) -> bool:
    return text.startswith("<|") and text.endswith("|>")


# -- tokenizer.json construction ---------------------------------------------------------------
def byte_level_bpe_document(
    vocab: Mapping[str, int],
    merges: Iterable[tuple[str, str]],
    added: Iterable[tuple[int, str, bool]],
    *,
    pattern: str,
    ignore_merges: bool,
) -> dict[str, Any]:
    """A ``tokenizer.json`` document for byte-level BPE (the layout Llama 4 ships).

    ``added`` holds ``(id, content, special)``; those tokens also enter the model
    vocabulary at their id, because ``tokenizers`` otherwise renumbers added tokens
    that lie beyond the model vocabulary. BPE cannot produce them (no merge leads
    there), so only the added-token matcher reaches them.
    """
    added = sorted(added)
    full_vocab = dict(vocab)
    for token_id, content, _special in added:
        full_vocab[content] = token_id
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for token_id, content, special in added
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": dict(sorted(full_vocab.items(), key=lambda item: item[1])),
            "merges": [[a, b] for a, b in merges],
        },
    }


def _split_pattern(document: Mapping[str, Any]) -> str | None:
    """The regex of the ``Split`` pre-tokenizer in a tokenizer.json document, if any."""
    pre = document.get("pre_tokenizer") or {}
    stack = [pre]
    while stack:
        node = stack.pop()
        if node.get("type") == "Split":
            pattern = node.get("pattern", {})
            return pattern.get("Regex") or pattern.get("String")
        stack.extend(reversed(node.get("pretokenizers", [])))
    return None


def _merge_pairs(raw: Iterable[Any]) -> list[tuple[str, str]]:
    """BPE merges as pairs, from either ``"a b"`` strings or ``[a, b]`` lists."""
    pairs = []
    for merge in raw:
        if isinstance(merge, str):
            a, sep, b = merge.partition(" ")
            if not sep:
                raise TokenizerError(f"malformed BPE merge {merge!r}")
            pairs.append((a, b))
        else:
            a, b = merge
            pairs.append((a, b))
    return pairs


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """A token named in tokenizer_config.json: a string or an ``AddedToken`` dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return value.get("content")
    return None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


# -- the tokenizer ------------------------------------------------------------------------------
class MuseTokenizer:
    """Byte-level BPE tokenizer of a Muse Glimmer checkpoint.

    Build it with :meth:`load`, :meth:`from_gguf` or :meth:`from_file`. The
    constructor takes a ``tokenizer.json`` document plus what the checkpoint
    declares beside it; ids it does not declare are resolved by token string.

    :param document: the ``tokenizer.json`` content (byte-level BPE).
    :param bos_id: BOS id the checkpoint declares; default: the id of ``<|begin_of_text|>``.
    :param eos_id: EOS id the checkpoint declares; default: the id of ``<|end_of_text|>``.
    :param extra_eos_ids: further end-of-generation ids the checkpoint lists
        (``generation_config.json``'s ``eos_token_id`` list).
    :param pad_id: pad id, if declared; default: ``<|finetune_right_pad|>`` when present.
    :param mask_id: DFlash mask id, if declared; default: ``<|mask|>`` when present.
    :param vocab_size: the model's vocabulary size (embedding rows); at least the
        highest token id + 1.
    :param pre: llama.cpp pre-tokenizer tag; detected from the split regex when omitted.
    :param chat_template: the checkpoint's Jinja chat template, if it ships one.
    """

    def __init__(
        self,
        document: Mapping[str, Any],
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        extra_eos_ids: Sequence[int] = (),
        pad_id: int | None = None,
        mask_id: int | None = None,
        vocab_size: int | None = None,
        pre: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        # A private copy of the levels changed here (the vocabulary is rebuilt below); the
        # rest (merges, the pre-tokenizer) is read only.
        document = {**document, "model": dict(document.get("model", {})),
                    "added_tokens": [dict(t) for t in document.get("added_tokens", [])]}
        model = document["model"]
        if model.get("type") != "BPE":
            raise TokenizerError(f"expected a byte-level BPE tokenizer, got model type {model.get('type')!r}")
        added = {int(t["id"]): t for t in document.get("added_tokens", [])}
        vocab: dict[str, int] = dict(model.get("vocab", {}))
        for token_id, token in added.items():
            vocab[token["content"]] = token_id
        model["vocab"] = vocab
        self._document = document
        self._tokenizer = Tokenizer.from_str(json.dumps(document))
        for token_id, token in added.items():
            if self._tokenizer.token_to_id(token["content"]) != token_id:
                raise TokenizerError(f"added token {token['content']!r} did not keep id {token_id}")

        self._plain_tokenizer: Tokenizer | None = None  # built on first use (:attr:`_plain`)
        self._plain_lock = threading.Lock()
        #: ids of the long text runs of rendered prompts (:meth:`encode_segments`)
        self.runs = RunCache()

        self._added: dict[int, tuple[str, bool]] = {i: (t["content"], bool(t.get("special"))) for i, t in added.items()}
        self._added_ids = {content: i for i, (content, _special) in self._added.items()}
        self._added_pattern: re.Pattern[str] | None = None
        self._id_to_symbol = {i: s for s, i in vocab.items() if i not in added}
        self._token_bytes_cache: dict[int, bytes] = {}
        self._merges = _merge_pairs(model.get("merges", []))
        # Long text is tokenized in pieces only where the cuts are known to be exact.
        self._cuts_exact = _split_pattern(document) in PRE_TOKENIZER_PATTERNS.values() and not document.get("normalizer")

        max_id = max(vocab.values(), default=-1)
        self.vocab_size: int = max(vocab_size or 0, max_id + 1)
        """Number of token ids (embedding rows); ids without a token decode to nothing."""
        pattern = _split_pattern(document)
        if pre is None:
            pre = next((tag for tag, p in PRE_TOKENIZER_PATTERNS.items() if p == pattern), "default")
        self.pre: str = pre
        """llama.cpp's pre-tokenizer tag for this split (``default`` when unknown)."""
        self.chat_template: str | None = chat_template
        """The checkpoint's Jinja chat template, if shipped."""

        self.bos_id: int = self._declared(bos_id, BOS_STRING, "BOS")
        """Beginning of text, the first id of every prompt."""
        self.eos_id: int = self._declared(eos_id, EOS_STRING, "EOS")
        """End of text, the model's end-of-generation id."""
        self.pad_id: int | None = pad_id if pad_id is not None else self.token_id(PAD_STRING)
        """Padding id, when the checkpoint has one."""
        self.mask_id: int | None = mask_id if mask_id is not None else self.token_id(MASK_STRING)
        """DFlash mask id, when the checkpoint has one."""
        self._extra_eos_ids = tuple(extra_eos_ids)

    @property
    def _plain(self) -> Tokenizer:
        """The tokenizer for client text: the same BPE without added tokens, so that
        written control strings stay ordinary bytes (built once, on first use)."""
        if self._plain_tokenizer is None:
            with self._plain_lock:
                if self._plain_tokenizer is None:
                    document = self._document
                    added = {int(t["id"]) for t in document["added_tokens"]}
                    vocab = {s: i for s, i in document["model"]["vocab"].items() if i not in added}
                    plain = {**document, "added_tokens": [], "model": {**document["model"], "vocab": vocab}}
                    self._plain_tokenizer = Tokenizer.from_str(json.dumps(plain))
        return self._plain_tokenizer

    def _declared(self, declared: int | None, string: str, what: str) -> int:
        if declared is not None and 0 <= declared < self.vocab_size:
            return declared
        found = self.token_id(string)
        if found is None:
            raise TokenizerError(f"the tokenizer declares no {what} id and has no {string!r} token")
        return found

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def load(cls, model_path: str | Path) -> MuseTokenizer:
        """The tokenizer of a checkpoint's own files: a GGUF file or a Hugging Face directory.

        A GGUF without tokenizer metadata, and any other file (an exported
        program), uses the ``tokenizer.json`` beside it. Built once per process
        for a given file (:func:`load_once`). A model served from a bare
        ``config.json`` gets the demo tokenizer instead:
        :func:`musegl_core.model_tokenizer.load_tokenizer` decides.
        """
        path = Path(model_path)
        return load_once("files", path, lambda: cls._load(path))

    @classmethod
    def _load(cls, path: Path) -> MuseTokenizer:
        if path.is_dir():
            return cls.from_file(path)
        if path.suffix == ".json":
            return cls.from_file(path)
        if not _is_gguf(path) and (path.parent / "tokenizer.json").is_file():
            return cls.from_file(path.parent)
        data = read_gguf_tokenizer_data(path)
        if data is not None:
            return cls.from_gguf_data(data)
        if (path.parent / "tokenizer.json").is_file():
            return cls.from_file(path.parent)
        raise TokenizerError(f"{path} has no tokenizer metadata and no tokenizer.json beside it")

    @classmethod
    def from_gguf(cls, source: str | Path | GGUFReader) -> MuseTokenizer:
        """Rebuild the tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata."""
        data = read_gguf_tokenizer_data(source)
        if data is None:
            raise TokenizerError("the GGUF file has no tokenizer.ggml.tokens")
        return cls.from_gguf_data(data)

    @classmethod
    def from_gguf_data(cls, data: GGUFTokenizerData) -> MuseTokenizer:
        """Build from GGUF tokenizer metadata.

        NORMAL tokens form the BPE vocabulary, CONTROL and USER_DEFINED tokens
        become added tokens (special for CONTROL), and UNUSED ``[PAD…]`` fillers
        are left out entirely: no encoding reaches them and they decode to nothing,
        as ids missing from a tokenizer.json do.
        """
        if data.model != "gpt2":
            raise TokenizerError(f"unsupported GGUF tokenizer model {data.model!r}")
        pattern = PRE_TOKENIZER_PATTERNS.get(data.pre)
        pre = data.pre
        if pattern is None:
            warnings.warn(
                f"unknown GGUF pre-tokenizer {data.pre!r}; splitting with the {FALLBACK_PRE!r} (GPT-4o style) pattern",
                stacklevel=2,
            )
            pre, pattern = FALLBACK_PRE, PRE_TOKENIZER_PATTERNS[FALLBACK_PRE]
        vocab: dict[str, int] = {}
        added: list[tuple[int, str, bool]] = []
        for token_id, (token, kind) in enumerate(zip(data.tokens, data.token_types, strict=True)):
            if kind in (CONTROL, USER_DEFINED):
                added.append((token_id, token, kind == CONTROL))
            elif kind != UNUSED:
                vocab.setdefault(token, token_id)
        document = byte_level_bpe_document(
            vocab, _merge_pairs(data.merges), added, pattern=pattern, ignore_merges=pre in _IGNORE_MERGES_TAGS
        )
        return cls(
            document,
            bos_id=data.bos_token_id if data.bos_token_id >= 0 else None,
            eos_id=data.eos_token_id if data.eos_token_id >= 0 else None,
            extra_eos_ids=() if data.eot_token_id is None else (data.eot_token_id,),
            pad_id=data.padding_token_id,
            mask_id=data.mask_token_id,
            vocab_size=len(data.tokens),
            pre=pre,
            chat_template=data.chat_template,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> MuseTokenizer:
        """Load a ``tokenizer.json``, or a Hugging Face directory that holds one.

        In a directory, BOS/EOS/pad/mask ids, the vocabulary size and the chat
        template are read from ``tokenizer_config.json``, ``config.json`` (and
        its ``text_config``) and ``generation_config.json`` when present.
        """
        path = Path(path)
        directory, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json at {file}")
        document = _read_json(file)
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        config = _read_json(directory / "config.json")
        text_config = config.get("text_config") or {}
        generation_config = _read_json(directory / "generation_config.json")
        added = {t["content"]: int(t["id"]) for t in document.get("added_tokens", [])}
        vocab = document.get("model", {}).get("vocab", {})

        def by_name(key: str) -> int | None:
            content = _token_content(tokenizer_config.get(key))
            if content is None:
                return None
            return added.get(content, vocab.get(content))

        def by_id(key: str) -> list[int]:
            for source in (config, text_config, generation_config):
                ids = _as_ids(source.get(key))
                if ids:
                    return ids
            return []

        bos = by_name("bos_token")
        if bos is None:
            bos = next(iter(by_id("bos_token_id")), None)
        eos_ids = by_id("eos_token_id")
        eos = by_name("eos_token")
        if eos is None:
            eos = next(iter(eos_ids), None)
        pad = by_name("pad_token")
        if pad is None:
            pad = next(iter(by_id("pad_token_id")), None)
        mask = next(iter(by_id("mask_token_id")), None)
        vocab_size = text_config.get("vocab_size") or config.get("vocab_size")
        return cls(
            document,
            bos_id=bos,
            eos_id=eos,
            extra_eos_ids=_as_ids(generation_config.get("eos_token_id")) + eos_ids,
            pad_id=pad,
            mask_id=mask,
            vocab_size=vocab_size,
            chat_template=tokenizer_config.get("chat_template"),
        )

    # -- special tokens ---------------------------------------------------------------------
    def token_id(self, string: str) -> int | None:
        """The id of an added token (or of a vocabulary token) by its string; None if absent."""
        found = self._added_ids.get(string)
        if found is None:
            found = self._tokenizer.token_to_id(string)
        return found

    def special_ids(self) -> frozenset[int]:
        """The ids of every special (control) token."""
        return frozenset(i for i, (_content, special) in self._added.items() if special)

    def special_token(self, name: str) -> int:
        """The id of a special token, given as ``"<|eot|>"`` or just ``"eot"``.

        :raises TokenizerError: the tokenizer has no such token.
        """
        string = name if _looks_like_control(name) else f"<|{name}|>"
        found = self._added_ids.get(string)
        if found is None:
            raise TokenizerError(f"the tokenizer has no {string!r} token")
        return found

    @property
    def eot_id(self) -> int:
        """``<|eot|>``: end of message and of the turn."""
        return self.special_token("<|eot|>")

    @property
    def eom_id(self) -> int:
        """``<|eom|>``: end of message; the assistant turn goes on."""
        return self.special_token("<|eom|>")

    @property
    def start_id(self) -> int:
        """``<|start|>``: opens a message header."""
        return self.special_token("<|start|>")

    @property
    def message_id(self) -> int:
        """``<|message|>``: closes a message header."""
        return self.special_token("<|message|>")

    @property
    def patch_id(self) -> int:
        """``<|patch|>``: image placeholder, one merged image row."""
        return self.special_token("<|patch|>")

    @property
    def image_start_id(self) -> int:
        """``<|image_start|>``: opens an expanded image span."""
        return self.special_token("<|image_start|>")

    @property
    def image_end_id(self) -> int:
        """``<|image_end|>``: closes an expanded image span."""
        return self.special_token("<|image_end|>")

    @property
    def end_of_generation_ids(self) -> tuple[int, ...]:
        """Ids that end generation: EOS and ``<|eot|>`` (as llama.cpp), plus declared extras.

        ``<|eom|>`` is deliberately not one of them.
        """
        ids = [self.eos_id, *self._extra_eos_ids]
        eot = self.token_id("<|eot|>")
        if eot is not None:
            ids.append(eot)
        return tuple(sorted(set(ids)))

    @property
    def special_strings(self) -> frozenset[str]:
        """The strings of the control (special) added tokens."""
        return frozenset(content for content, special in self._added.values() if special)

    @property
    def added_tokens(self) -> Mapping[int, str]:
        """Every added token (control and user-defined), id → string."""
        return {i: content for i, (content, _special) in self._added.items()}

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str, *, special: bool) -> list[int]:
        """Token ids of ``text``; never adds a BOS.

        :param special: True for text the renderer wrote (control-token strings
            become their single ids); False for text a client wrote (control-token
            strings stay ordinary characters).
        """
        return self.encode_bounded(text, special=special)

    def encode_bounded(self, text: str, *, special: bool, limit: int | None = None) -> list[int]:
        """:meth:`encode`, stopping early once the ids certainly exceed ``limit``.

        Text longer than :data:`PIECE_CHARS` is tokenized in pieces cut where the
        split regex cannot join the two sides (:func:`split_for_encoding`), so for
        ordinary text the ids are those of the whole string; a longer stretch
        without such a cut (a run of one letter) is cut anyway. An unrecognised
        split pattern or a normalizer is tokenized whole. Either way the GIL is
        released while ``tokenizers`` works on long text.

        :raises TokenBudgetExceeded: more than ``limit`` ids (checked between batches of pieces).
        :raises TokenizationError: the tokenizer failed on the text (a Rust panic included).
        """
        if not text:
            return []
        tokenizer = self._tokenizer if special else self._plain
        try:
            if len(text) <= SHORT_CHARS:
                ids = tokenizer.encode(text, add_special_tokens=False).ids
            elif len(text) <= PIECE_CHARS or not self._cuts_exact:
                # whole: encode_batch releases the GIL (encode does not), and is no slower
                ids = tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
            else:
                ids = self._encode_pieces(tokenizer, text, special, limit)
        except TokenBudgetExceeded:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # pyo3_runtime.PanicException is a BaseException
            detail = str(exc).strip().splitlines()
            raise TokenizationError(f"the tokenizer failed on a text of {len(text)} characters"
                                    + (f" ({detail[0]})" if detail else "")) from None
        if limit is not None and len(ids) > limit:
            raise TokenBudgetExceeded(len(ids), limit)
        return ids

    def _encode_pieces(self, tokenizer: Tokenizer, text: str, special: bool, limit: int | None) -> list[int]:
        """Ids of ``text`` (longer than :data:`PIECE_CHARS`) from its pieces, in batches."""
        parts = self._split_added(text) if special else [(text, None)]
        ids: list[int] = []
        batch: list[str] = []

        def run_batch() -> None:
            if batch:
                for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                    ids.extend(encoding.ids)
                batch.clear()
                if limit is not None and len(ids) > limit:
                    raise TokenBudgetExceeded(len(ids), limit)

        for part, token_id in parts:
            if token_id is not None:  # an added token (special text only): its id, between pieces
                run_batch()
                ids.append(token_id)
                continue
            for piece in split_for_encoding(part)[0]:
                batch.append(piece)
                if len(batch) == BATCH_PIECES:
                    run_batch()
        run_batch()
        return ids

    def encode_segments(self, segments: Sequence[PromptSegment], *, add_bos: bool = True,
                        limit: int | None = None) -> list[int]:
        """Token ids of a rendered prompt.

        Text is tokenized in *runs*: consecutive text between two control tokens
        is encoded as one string even when it spans several segments, so the BPE
        merges are the same as for the whole rendered string (template text such
        as ``tool `` followed by a client's tool name merges as it would in the
        reference). Control-token strings are recognised only inside
        ``special=True`` segments; in client text they stay ordinary characters.

        With ``add_bos`` the result starts with exactly one BOS id: a rendered
        BOS string that opens the prompt is stripped before the numeric BOS is
        put first, and explicit leading BOS ids are not repeated.

        ``limit`` stops the work early: :class:`TokenBudgetExceeded` as soon as
        more than ``limit`` ids are certain (a prompt that cannot fit the
        context is not tokenized to its end).
        """
        ids: list[int] = []
        run: list[str] = []
        bos_string = self._added.get(self.bos_id, (None, False))[0]

        def over() -> None:
            if limit is not None and len(ids) > limit:
                raise TokenBudgetExceeded(len(ids), limit)

        def flush() -> None:
            if run:
                budget = None if limit is None else max(limit - len(ids), 0)
                text = "".join(run)
                try:
                    piece = self.runs.get(text)
                    if piece is None:
                        piece = self.encode_bounded(text, special=False, limit=budget)
                        self.runs.put(text, piece)
                    elif budget is not None and len(piece) > budget:
                        raise TokenBudgetExceeded(len(piece), budget)
                    ids.extend(piece)
                except TokenBudgetExceeded as exc:
                    raise TokenBudgetExceeded(len(ids) + exc.at_least, limit) from None
                run.clear()
                over()

        for segment in segments:
            if segment.token_ids is not None:
                flush()
                ids.extend(int(i) for i in segment.token_ids)
                over()
                continue
            text = segment.text or ""
            if add_bos and not ids and not run and segment.special and bos_string:
                while text.startswith(bos_string):
                    text = text[len(bos_string) :]
            if not segment.special:
                run.append(text)
                continue
            for piece, token_id in self._split_added(text):
                if token_id is None:
                    run.append(piece)
                else:
                    flush()
                    ids.append(token_id)
        flush()
        if not add_bos:
            return ids
        start = 0
        while start < len(ids) and ids[start] == self.bos_id:
            start += 1
        return [self.bos_id, *ids[start:]]

    def warm(self) -> None:
        """Build now what the first request would otherwise wait for: the tokenizer
        for client text, :attr:`longest_token_bytes` and the added tokens' pattern
        (together over a second on a 200k-id vocabulary with 2,048 added tokens). The
        worker calls this before it reports ready."""
        self._plain  # noqa: B018 (built on first use)
        self.longest_token_bytes  # noqa: B018
        self._added_regex()

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes any one id stands for (added tokens included): every id
        of a text covers at most this many of its UTF-8 bytes."""
        symbols = (len(_symbol_bytes(symbol)) for symbol in self._id_to_symbol.values())
        added = (len(content.encode("utf-8")) for content, _special in self._added.values())
        return max(1, *symbols, *added)

    def token_count_floor(self, segments: Sequence[PromptSegment]) -> int:
        """A lower bound on ``len(encode_segments(segments))``, from lengths alone.

        No id covers more than :attr:`longest_token_bytes` bytes, so the text of
        the segments needs at least ``ceil(bytes / longest)`` ids; explicit ids
        count one each. A rendered BOS string that opens the prompt is stripped
        (it is itself a token, so no longer than the longest: stripping takes at
        most one id off the bound); every BOS string of renderer text is
        subtracted, which errs on the safe side."""
        longest = self.longest_token_bytes
        text_bytes = ids = strippable = 0
        bos_string = self._added.get(self.bos_id, (None, False))[0]
        for segment in segments:
            if segment.token_ids is not None:
                ids += len(segment.token_ids)
                continue
            text = segment.text or ""
            if segment.special and bos_string:
                strippable += text.count(bos_string)
            text_bytes += len(text.encode("utf-8", errors="surrogatepass"))
        return max(0, -(-text_bytes // longest) - strippable) + ids

    def _added_regex(self) -> re.Pattern[str]:
        """The alternation of every added-token string, longest first (compiled once: a
        quarter of a second for 2,048 of them)."""
        if self._added_pattern is None:
            strings = sorted(self._added_ids, key=len, reverse=True)
            self._added_pattern = re.compile("|".join(map(re.escape, strings))) if strings else re.compile(r"(?!)")
        return self._added_pattern

    def _split_added(self, text: str) -> list[tuple[str, int | None]]:
        """Split renderer text at added-token strings: ``(text, None)`` or ``(string, id)``."""
        out: list[tuple[str, int | None]] = []
        pos = 0
        for match in self._added_regex().finditer(text):
            if match.start() > pos:
                out.append((text[pos : match.start()], None))
            out.append((match.group(), self._added_ids[match.group()]))
            pos = match.end()
        if pos < len(text):
            out.append((text[pos:], None))
        return out

    # -- decoding -----------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (an added token: its UTF-8 string).

        Ids without a token (gaps, GGUF ``[PAD…]`` fillers) stand for no bytes.
        """
        cached = self._token_bytes_cache.get(token_id)
        if cached is not None:
            return cached
        added = self._added.get(token_id)
        if added is not None:
            value = added[0].encode("utf-8")
        else:
            symbol = self._id_to_symbol.get(token_id)
            value = b"" if symbol is None else _symbol_bytes(symbol)
        self._token_bytes_cache[token_id] = value
        return value

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``, special tokens written as their strings.

        Invalid or incomplete UTF-8 becomes U+FFFD, as in ``tokenizers``' ByteLevel decoder.
        """
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    # -- export -------------------------------------------------------------------------------
    def to_tokenizer_json(self) -> str:
        """The ``tokenizer.json`` text of this tokenizer (added tokens kept in the vocabulary)."""
        return json.dumps(self._document, ensure_ascii=False, indent=2) + "\n"

    def to_gguf_data(self, vocab_size: int | None = None) -> GGUFTokenizerData:
        """The GGUF tokenizer metadata for this tokenizer.

        :param vocab_size: length of the token list (default :attr:`vocab_size`);
            ids without a token become ``[PAD{id}]`` entries of type UNUSED.
        """
        size = max(vocab_size or self.vocab_size, self.vocab_size)
        tokens = [f"[PAD{i}]" for i in range(size)]
        types = [UNUSED] * size
        for token_id, symbol in self._id_to_symbol.items():
            tokens[token_id] = symbol
            types[token_id] = NORMAL
        for token_id, (content, special) in self._added.items():
            tokens[token_id] = content
            types[token_id] = CONTROL if special or _looks_like_control(content) else USER_DEFINED
        eot = self.token_id("<|eot|>")
        return GGUFTokenizerData(
            tokens=tuple(tokens),
            token_types=tuple(types),
            merges=tuple(f"{a} {b}" for a, b in self._merges),
            bos_token_id=self.bos_id,
            eos_token_id=self.eos_id,
            eot_token_id=eot,
            padding_token_id=self.pad_id,
            mask_token_id=self.mask_id,
            pre=self.pre if self.pre in PRE_TOKENIZER_PATTERNS else "default",
            chat_template=self.chat_template,
        )

    def __repr__(self) -> str:
        return (
            f"MuseTokenizer(vocab_size={self.vocab_size}, added={len(self._added)}, "
            f"merges={len(self._merges)}, pre={self.pre!r})"
        )


def load_once(what: str, path: Path, build: Callable[[], MuseTokenizer]) -> MuseTokenizer:
    """``build()``, once per process for ``what`` of a file unchanged on disk (same
    resolved path, size and modification time): a later call returns the same
    (immutable) tokenizer. A path that cannot be read is not remembered, so
    ``build`` says what is wrong."""
    try:
        stat = path.stat()
        key = (what, str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    except OSError:
        return build()
    with _LOADED_LOCK:
        found = _LOADED.get(key)
    if found is None:
        found = build()
        with _LOADED_LOCK:
            _LOADED[key] = found
    return found

"""Tiny random Muse Glimmer checkpoints (``musegl make-tiny``) for tests, demos and benchmarks.

:func:`make_tiny` writes ``model.gguf`` (llama.cpp's layout, the tokenizer in its
metadata) and ``tokenizer.json`` beside it. Everything is derived from the
preset and the seed, so the same inputs give byte-identical files:

* the tokenizer is byte-level BPE over the 256 byte symbols plus merges learned
  by a small deterministic BPE learner from the text embedded below, split with
  the Llama 4 (GPT-4o style) pattern; the Muse Glimmer control tokens sit at
  their real ids and the rest of 200000..202047 holds
  ``<|reserved_special_token_N|>``; ids in between are GGUF ``[PAD…]`` fillers;
* every weight comes from its own numpy generator seeded with ``(seed, name)``,
  so the tensors do not depend on the order anything reads them.

The vocabulary keeps its real size (202048) so that the special ids are real,
which makes the embedding and the head the bulk of the file: 2 × 202048 × 64
values for the ``tiny`` preset, about 100 MB in F32. Make-tiny therefore writes
F16 matrices by default (about 52 MB); norms stay F32 as the converter keeps them.

:func:`default_model_path` builds the tiny checkpoint once into the user cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Mapping

import attrs
import numpy as np

from musegl_core.checkpoint.config import TextConfig
from musegl_core.tokenizer import (
    GPT4O_PATTERN,
    MuseTokenizer,
    TokenizerError,
    byte_level_alphabet,
    byte_level_bpe_document,
)

log = logging.getLogger("musegl.tokenizer")

__all__ = [
    "TinyPreset",
    "PRESETS",
    "MUSE_SPECIAL_TOKENS",
    "build_tiny_tokenizer",
    "demo_tokenizer_for",
    "tiny_text_config",
    "tiny_weights",
    "make_tiny",
    "default_model_path",
    "demo_mmproj_path",
    "make_tiny_mmproj",
    "CACHE_ENV",
    "cache_key",
]

Progress = Callable[[int, int, str], None]

#: Environment variable that overrides where :func:`default_model_path` caches.
CACHE_ENV = "MUSEGL_CACHE_DIR"
#: Bump when the generated files change for the same preset and seed.
FORMAT_VERSION = 1

VOCAB_SIZE = 202048
SPECIAL_RANGE = range(200000, 202048)

#: The Muse Glimmer control tokens at their real ids.
MUSE_SPECIAL_TOKENS: Mapping[int, str] = {
    200000: "<|begin_of_text|>",
    200001: "<|end_of_text|>",
    200007: "<|eom|>",
    200008: "<|eot|>",
    200018: "<|finetune_right_pad|>",
    200022: "<|start|>",
    200023: "<|message|>",
    200080: "<|image_start|>",
    200081: "<|image_end|>",
    200082: "<|vid_start|>",
    200083: "<|vid_end|>",
    200087: "<|vid_frame_separator|>",
    200091: "<|video|>",
    200092: "<|patch|>",
    201818: "<|mask|>",
}

#: Number of BPE merges the tiny tokenizer learns (fewer if the corpus runs out of pairs).
TINY_MERGES = 400

# English prose, chat-ish phrases and some code: enough for a few hundred merges.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model is a model that fits in a test.
Hello! How can I help you today? I would like to know the weather in Oslo and in Bergen.
The weather is sunny with a light breeze; the temperature is around eighteen degrees.
What is 17 * 23? It is 391. What is 2 + 2? It is 4. And 3 + 3? That makes 6.
You are a helpful assistant. Think step by step, then answer the question clearly.
Reasoning: the user wants the time in Tokyo, so the assistant should call the clock tool.
The recipient of this message is the user. The message ends with an end-of-turn token.
Streaming responses send one chunk per token; the server holds back partial characters.
Sessions keep their transcript and their cache, so a follow-up question is cheap to serve.
In the beginning there was the text, and the text was tokenized into bytes and merges.
She said that they would meet at the station at seven o'clock, but the train was late.
We're testing contractions: don't, won't, can't, it's, they've, I'm, you'll, he'd.
Numbers like 1234567 and 3.14159 and 2026-01-04 are split into groups of digits.
Unicode text: café, naïve, résumé, Zürich, Straße, São Paulo, Ελληνικά, русский, 日本語, 한국어.
Emoji: 🙂 👍 🚀 ✨ — and symbols such as ©, ®, €, £, ¥, ±, ×, ÷, →, ≤, ≥.

def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Session:
    def __init__(self, session_id: str, tokens: list[int]) -> None:
        self.session_id = session_id
        self.tokens = tokens

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)


if __name__ == "__main__":
    for i in range(10):
        print(f"fibonacci({i}) = {fibonacci(i)}")

function add(a, b) { return a + b; }
const result = items.map((item) => item.value * 2).filter((value) => value > 10);
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY name;
{"model": "muse-glimmer", "messages": [{"role": "user", "content": "Hi"}], "stream": true}
<atem:function_calls><atem:invoke name="weather.get_forecast"><atem:parameter name="city">Oslo
</atem:parameter></atem:invoke></atem:function_calls>
"""


# -- presets ----------------------------------------------------------------------------------
@attrs.frozen
class TinyPreset:
    """The shape of a tiny random checkpoint.

    Layer kinds follow the released rule: every fourth layer
    counted back from the last is full attention without RoPE, the others are
    sliding-window layers with RoPE, so four layers already hold both kinds.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    sliding_window: int
    vocab_size: int = attrs.field(default=VOCAB_SIZE)
    rope_theta: float = attrs.field(default=500000.0)
    max_position_embeddings: int = attrs.field(default=131072)
    #: scale of the random matrices (normal × init_std)
    init_std: float = attrs.field(default=0.02)

    @vocab_size.validator
    def _check_vocab(self, _attribute: attrs.Attribute, value: int) -> None:
        if value <= max(SPECIAL_RANGE):
            raise ValueError(f"vocab_size must exceed {max(SPECIAL_RANGE)} so the special ids are real")


PRESETS: Mapping[str, TinyPreset] = {
    "tiny": TinyPreset(
        name="tiny", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, sliding_window=32,
    ),
    "bench": TinyPreset(
        name="bench", hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=128,
        intermediate_size=2816, sliding_window=256,
    ),
}


def _preset(preset: str | TinyPreset) -> TinyPreset:
    if isinstance(preset, TinyPreset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}") from None


# -- tokenizer --------------------------------------------------------------------------------
def _learn_merges(words: Counter[tuple[str, ...]], limit: int) -> list[tuple[str, str]]:
    """Byte-pair merges, most frequent pair first; ties go to the smaller pair (deterministic).

    Pair counts are kept up to date incrementally: a merge touches only the words
    that contain the merged pair.
    """
    symbols = [list(word) for word in words]
    counts = list(words.values())
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for index, word in enumerate(symbols):
        for pair in zip(word, word[1:]):
            pairs[pair] += counts[index]
            where.setdefault(pair, set()).add(index)
    merges: list[tuple[str, str]] = []
    while len(merges) < limit:
        live = [(pair, n) for pair, n in pairs.items() if n > 0]
        if not live:
            break
        best, _count = min(live, key=lambda item: (-item[1], item[0]))
        merges.append(best)
        for index in sorted(where.pop(best, ())):
            word, n = symbols[index], counts[index]
            for pair in zip(word, word[1:]):
                pairs[pair] -= n
            merged: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            symbols[index] = merged
            for pair in zip(merged, merged[1:]):
                pairs[pair] += n
                where.setdefault(pair, set()).add(index)
        del pairs[best]
    return merges


@functools.cache
def _corpus_merges(limit: int) -> tuple[tuple[str, str], ...]:
    """The merges learned from the embedded corpus (pure data, so cached per process)."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GPT4O_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    words = Counter(tuple(piece) for piece, _offsets in split.pre_tokenize_str(_CORPUS))
    return tuple(_learn_merges(words, limit))


@functools.cache
def build_tiny_tokenizer(*, merges: int = TINY_MERGES, vocab_size: int = VOCAB_SIZE) -> MuseTokenizer:
    """The tiny checkpoints' tokenizer (deterministic: no randomness, no hash order).

    Built once per process for each (merges, vocab_size): the object is immutable."""
    vocab = {symbol: i for i, symbol in enumerate(byte_level_alphabet())}
    learned = _corpus_merges(merges)
    for a, b in learned:
        vocab.setdefault(a + b, len(vocab))
    words = _demo_words()
    while len(vocab) < SPECIAL_RANGE.start:
        vocab.setdefault(next(words), len(vocab))
    added = [
        (token_id, MUSE_SPECIAL_TOKENS.get(token_id, f"<|reserved_special_token_{token_id - SPECIAL_RANGE.start}|>"), True)
        for token_id in SPECIAL_RANGE
    ]
    document = byte_level_bpe_document(vocab, learned, added, pattern=GPT4O_PATTERN, ignore_merges=False)
    return MuseTokenizer(document, vocab_size=vocab_size, pre="llama4")


def _demo_words() -> Iterator[str]:
    """Pronounceable made-up words (``Ġ`` = a leading space in the byte alphabet).

    They fill the ordinary ids between the learned merges and the first special
    id, so that a random-weight model samples visible words instead of empty
    ids. No merge produces them: encoding never uses them, decoding shows them.
    """
    consonants, vowels = "bdfghklmnprstvwz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    for length in itertools.count(1):
        for combo in itertools.product(syllables, repeat=length):
            yield "\u0120" + "".join(combo)


#: Files whose presence makes a directory a checkpoint with its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
#: Suffixes of weight files: a directory with one is a real checkpoint.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def demo_tokenizer_for(path: str | os.PathLike[str]) -> MuseTokenizer | None:
    """The demo tokenizer for a bare ``config.json`` (or a directory holding only a
    config): no tokenizer files and no weight files beside it, which only serves with
    random weights (``--load-format dummy``). Sized to the config's vocabulary so
    every id the model can emit decodes. None for anything else."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    config = directory / "config.json"
    if path.is_file() and path.name != "config.json":
        return None
    if not config.is_file() or any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    if any(child.suffix in WEIGHT_SUFFIXES for child in directory.iterdir()):
        return None
    with config.open(encoding="utf-8") as f:
        raw = json.load(f)
    vocab_size = int((raw.get("text_config") or raw).get("vocab_size") or 0)
    if vocab_size <= 0:
        raise TokenizerError(f"{config} declares no vocab_size")
    if vocab_size < SPECIAL_RANGE.stop:
        raise TokenizerError(f"{config}: vocab_size {vocab_size} is smaller than the Muse special ids "
                             f"(up to {SPECIAL_RANGE.stop - 1}); add a tokenizer.json beside it")
    log.warning("%s has no tokenizer files: using the built-in demo tokenizer (%d ids); its text is made-up words",
                directory, vocab_size)
    return build_tiny_tokenizer(vocab_size=vocab_size)


# -- model ----------------------------------------------------------------------------------------
def tiny_text_config(preset: str | TinyPreset, tokenizer: MuseTokenizer) -> TextConfig:
    """The :class:`TextConfig` of a preset, BOS/EOS taken from the tokenizer."""
    p = _preset(preset)
    layout = TextConfig.default_layout(p.num_layers)
    return TextConfig(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_layers=p.num_layers,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        sliding_window=p.sliding_window,
        sliding=layout,
        rope=layout,
        rope_theta=p.rope_theta,
        max_position_embeddings=p.max_position_embeddings,
        bos_token_id=tokenizer.bos_id,
        eos_token_ids=tokenizer.end_of_generation_ids,
    )


@attrs.frozen
class _RandomTensor:
    """One weight, generated on demand from ``(seed, name)``; ``np.asarray`` materializes it."""

    name: str
    shape: tuple[int, ...]
    seed: int
    std: float

    def generate(self) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, zlib.crc32(self.name.encode())]))
        values = rng.standard_normal(self.shape, dtype=np.float32)
        if self.name == "norm.weight":  # a plain scale: near one
            return np.float32(1.0) + np.float32(0.02) * values
        if self.name.endswith("layernorm.weight"):  # centered (used as 1 + w): small
            return np.float32(0.05) * values
        return np.float32(self.std) * values

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        values = self.generate()
        return values if dtype is None else values.astype(dtype, copy=False)


def tiny_weights(config: TextConfig, *, seed: int = 0, std: float = 0.02) -> Mapping[str, _RandomTensor]:
    """Lazy random weights for ``config`` under transformers names (without the model prefix)."""
    from musegl_core.checkpoint.hf_reader import expected_shape, text_weight_names

    return {name: _RandomTensor(name, expected_shape(config, name), seed, std) for name in text_weight_names(config)}


@contextlib.contextmanager
def _progress_reporter(progress: bool | Progress | None, title: str) -> Iterator[Progress | None]:
    if progress is True:
        from musegl_core.progress import loading_progress

        with loading_progress(title) as update:
            yield update
    elif callable(progress):
        yield progress
    else:
        yield None


def tiny_vision_config(text: TextConfig):
    """The tiny random projector's shape: a two-layer vision tower (a window layer
    over 4x4-patch windows, then a full layer), 32 wide, into the text width."""
    from musegl_core.checkpoint.vision import VisionConfig

    return VisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, pos_side=4,
                        full=VisionConfig.default_full(2), out_hidden_size=128, projector_hidden_size=64,
                        text_hidden_size=text.hidden_size)


def tiny_vision_weights(config, *, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random projector weights (LayerNorms near 1, biases small), seeded per name."""
    from musegl_core.checkpoint.vision import vision_shape, vision_weight_names

    out = {}
    for name in vision_weight_names(config):
        values = _RandomTensor("vision." + name, vision_shape(config, name), seed, std).generate()
        if name.endswith(("norm1.weight", "norm2.weight", "ln_pre.weight", "ln_post.weight")):
            values = np.float32(1.0) + values
        elif name.endswith(".bias"):
            values = values * np.float32(0.1 / std)
        elif name in ("patch_embedding.weight", "position_embedding.weight"):
            values = values * np.float32(0.5 / std)
        out[name] = values
    return out


def make_tiny_mmproj(path: str | os.PathLike[str], text: TextConfig, *, seed: int = 0,
                     file_type: str = "f16") -> Path:
    """Write the tiny random projector GGUF (llama.cpp's mmproj layout) to ``path``."""
    from musegl_core.checkpoint.vision import write_mmproj_gguf

    config = tiny_vision_config(text)
    write_mmproj_gguf(path, config, tiny_vision_weights(config, seed=seed), file_type=file_type,
                      name="Muse Glimmer tiny projector")
    return Path(path)


def make_tiny(
    outdir: str | os.PathLike[str],
    *,
    preset: str | TinyPreset = "tiny",
    seed: int = 0,
    file_type: str = "f16",
    progress: bool | Progress | None = None,
    mmproj: bool = False,
) -> Path:
    """Write a tiny random checkpoint into ``outdir``; return the path of its ``model.gguf``.

    :param preset: a name from :data:`PRESETS` or a :class:`TinyPreset`.
    :param seed: seeds every weight; same inputs give byte-identical files.
    :param file_type: matrix dtype (``f32``, ``f16``, ``bf16``, ``q8_0``); F16 by
        default, which halves the vocabulary-sized embedding and head.
    :param progress: True for a rich progress bar, or a ``progress(done, total, what)`` callback.
    :param mmproj: also write ``mmproj.gguf``, a tiny random vision projector
        (``musegl serve model.gguf --mmproj mmproj.gguf``).
    """
    from musegl_core.checkpoint.gguf_writer import write_text_gguf

    p = _preset(preset)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(vocab_size=p.vocab_size)
    config = tiny_text_config(p, tokenizer)
    (out / "tokenizer.json").write_text(tokenizer.to_tokenizer_json(), encoding="utf-8")
    gguf_path = out / "model.gguf"
    with _progress_reporter(progress, f"make-tiny {p.name}") as report:
        write_text_gguf(
            gguf_path,
            config,
            tiny_weights(config, seed=seed, std=p.init_std),
            tokenizer.to_gguf_data(p.vocab_size),
            file_type=file_type,
            name=f"Muse Glimmer tiny-{p.name}",
            progress=report,
        )
    if mmproj:
        make_tiny_mmproj(out / "mmproj.gguf", config, seed=seed, file_type="f32" if file_type == "f32" else "f16")
    return gguf_path


# -- the cached default checkpoint ---------------------------------------------------------------
def cache_root() -> Path:
    """The musegl cache: ``$MUSEGL_CACHE_DIR``, else the user cache dir."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("musegl"))


def cache_key(preset: TinyPreset, seed: int, file_type: str) -> str:
    """A short hash of everything that shapes the files: inputs and the generating code."""
    import musegl_core
    from musegl_core.checkpoint import gguf_writer

    digest = hashlib.sha256()
    digest.update(f"{FORMAT_VERSION}|{musegl_core.__version__}|{preset!r}|{seed}|{file_type}".encode())
    from musegl_core.checkpoint import vision

    for module_file in (__file__, gguf_writer.__file__, vision.__file__):
        digest.update(Path(module_file).read_bytes())
    return digest.hexdigest()[:16]


def default_model_path(
    *, preset: str | TinyPreset = "tiny", seed: int = 0, file_type: str = "f16", progress: bool | Progress | None = None
) -> Path:
    """The GGUF of the cached tiny checkpoint, built on first use (with its tiny
    random projector ``mmproj.gguf`` beside it: :func:`demo_mmproj_path`).

    The cache is ``<user cache dir>/musegl/tiny-<hash>`` (``$MUSEGL_CACHE_DIR``
    replaces ``<user cache dir>/musegl``). A build goes to a temporary folder that
    is renamed into place, so concurrent first starts never see a half-written
    checkpoint; the loser of the race discards its copy.
    """
    p = _preset(preset)
    root = cache_root()
    final = root / f"tiny-{cache_key(p, seed, file_type)}"
    model = final / "model.gguf"
    if model.is_file():
        return model
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=root))
    try:
        make_tiny(staging, preset=p, seed=seed, file_type=file_type, progress=progress, mmproj=True)
        try:
            os.rename(staging, final)
        except OSError:
            if not model.is_file():  # not a lost race: a real failure
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return model


def demo_mmproj_path(model: str | os.PathLike[str]) -> str | None:
    """The projector written beside a cached tiny checkpoint, if there is one."""
    path = Path(model).parent / "mmproj.gguf"
    return str(path) if path.is_file() else None

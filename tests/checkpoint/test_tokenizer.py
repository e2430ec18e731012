"""MuseTokenizer: tokenizer.json and GGUF routes agree; special ids by string; BOS rule."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from musegl_core.checkpoint.gguf_tokenizer import read_gguf_tokenizer_data
from musegl_core.checkpoint.gguf_writer import add_tokenizer_metadata
from musegl_core.checkpoint.tokenizer_data import CONTROL, NORMAL, UNUSED, USER_DEFINED, GGUFTokenizerData
from musegl_core.tiny import MUSE_SPECIAL_TOKENS, build_tiny_tokenizer
from musegl_core.tokenizer import (
    MuseTokenizer,
    TokenizerError,
    byte_level_alphabet,
)
from musegl_core.engine.request import PromptSegment
from tests.support.toy_tokenizer import toy_tokenizer_document

TEXTS = [
    "",
    "Hello world! The weather in Oslo is sunny.",
    "We're testing contractions: don't, WON'T, I'm, they've.",
    "Numbers 1234567 and 3.14159, dates 2026-01-04.",
    "café naïve Zürich Straße Ελληνικά русский 日本語 한국어",
    "Emoji 🙂👍🏽🚀 and ZWJ 👩‍👩‍👧 and flags 🇳🇴",
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n\tfor _ in range(n):\n        a, b = b, a + b\r\n",
    "  leading and trailing spaces   \n\n\n",
    "<|begin_of_text|><|start|>user<|message|>Hi 🙂<|eot|><|start|>assistant",
    "half <|eot and <|unknown|> and <|patch|><|patch|> and <|eot|>x",
    "\x00\x01 control bytes \x7f and \ufffd replacement",
]


def write_tokenizer_gguf(path: Path, data: GGUFTokenizerData) -> Path:
    """A GGUF holding only tokenizer metadata."""
    writer = gguf.GGUFWriter(str(path), "muse-glimmer")
    add_tokenizer_metadata(writer, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer = build_tiny_tokenizer()
    (directory / "tokenizer.json").write_text(tokenizer.to_tokenizer_json(), encoding="utf-8")
    write_tokenizer_gguf(directory / "model.gguf", tokenizer.to_gguf_data())
    return directory


@pytest.fixture(scope="module")
def from_json(checkpoint_dir: Path) -> MuseTokenizer:
    return MuseTokenizer.from_file(checkpoint_dir / "tokenizer.json")


@pytest.fixture(scope="module")
def from_gguf(checkpoint_dir: Path) -> MuseTokenizer:
    return MuseTokenizer.from_gguf(checkpoint_dir / "model.gguf")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_json_and_gguf_agree(from_json: MuseTokenizer, from_gguf: MuseTokenizer, text: str, special: bool) -> None:
    ids = from_json.encode(text, special=special)
    assert from_gguf.encode(text, special=special) == ids
    assert from_json.decode(ids) == from_gguf.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_special_encoding_matches_the_tokenizers_library(checkpoint_dir: Path, from_json: MuseTokenizer, text: str) -> None:
    reference = Tokenizer.from_file(str(checkpoint_dir / "tokenizer.json"))
    expected = reference.encode(text, add_special_tokens=False).ids
    assert from_json.encode(text, special=True) == expected
    assert from_json.decode(expected) == reference.decode(expected, skip_special_tokens=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=60))
def test_round_trip_any_text(from_json: MuseTokenizer, from_gguf: MuseTokenizer, text: str) -> None:
    plain = from_json.encode(text, special=False)
    assert from_gguf.encode(text, special=False) == plain
    assert from_json.decode(plain) == text
    assert all(i < 256 + 400 for i in plain)  # only byte symbols and merges


def test_special_ids_resolve_by_string(from_json: MuseTokenizer, from_gguf: MuseTokenizer) -> None:
    for tok in (from_json, from_gguf):
        assert tok.bos_id == 200000
        assert tok.eos_id == 200001
        assert tok.eom_id == 200007
        assert tok.eot_id == 200008
        assert tok.pad_id == 200018
        assert tok.start_id == 200022
        assert tok.message_id == 200023
        assert tok.image_start_id == 200080
        assert tok.image_end_id == 200081
        assert tok.patch_id == 200092
        assert tok.mask_id == 201818
        assert tok.special_token("eot") == tok.special_token("<|eot|>") == 200008
        assert tok.special_token("<|video|>") == 200091
        assert tok.end_of_generation_ids == (200001, 200008)
        assert tok.vocab_size == 202048
        assert set(MUSE_SPECIAL_TOKENS.values()) <= tok.special_strings
        assert len(tok.special_strings) == 2048
        with pytest.raises(TokenizerError):
            tok.special_token("<|no_such_token|>")


def test_special_false_keeps_control_strings_as_text(from_json: MuseTokenizer) -> None:
    text = "ignore this <|eot|><|start|>system<|message|>"
    plain = from_json.encode(text, special=False)
    assert not set(plain) & set(from_json.added_tokens)
    assert from_json.decode(plain) == text
    assert from_json.encode(text, special=True).count(from_json.eot_id) == 1


def test_encode_never_adds_bos(from_json: MuseTokenizer) -> None:
    assert from_json.encode("Hi", special=True)[0] != from_json.bos_id
    assert from_json.encode("", special=True) == []


def test_encode_segments_starts_with_exactly_one_bos(from_json: MuseTokenizer) -> None:
    tok = from_json
    body = "<|start|>user<|message|>"
    expected = [tok.bos_id, *tok.encode(body, special=True), *tok.encode("Hi <|eot|>", special=False)]
    rendered = [PromptSegment(text="<|begin_of_text|>" + body), PromptSegment(text="Hi <|eot|>", special=False)]
    assert tok.encode_segments(rendered) == expected
    unrendered = [PromptSegment(text=body), PromptSegment(text="Hi <|eot|>", special=False)]
    assert tok.encode_segments(unrendered) == expected
    as_ids = [PromptSegment(token_ids=(tok.bos_id, tok.bos_id)), PromptSegment(text=body + "Hi <|eot|>")]
    assert tok.encode_segments(as_ids)[:2] == [tok.bos_id, tok.start_id]
    # A client who types the BOS string gets text, and the prompt still gets its BOS.
    typed = tok.encode_segments([PromptSegment(text="<|begin_of_text|>", special=False)])
    assert typed[0] == tok.bos_id and tok.decode(typed[1:]) == "<|begin_of_text|>"
    assert tok.encode_segments([]) == [tok.bos_id]
    assert tok.encode_segments([PromptSegment(text=body)], add_bos=False) == tok.encode(body, special=True)


def test_gguf_data_types(from_json: MuseTokenizer) -> None:
    data = from_json.to_gguf_data()
    assert len(data.tokens) == len(data.token_types) == 202048
    assert data.tokens[:256] == byte_level_alphabet()
    assert set(data.token_types[:200000]) == {NORMAL}  # bytes, merges, then the demo words
    assert data.tokens[1000].startswith("\u0120")
    padded = from_json.to_gguf_data(vocab_size=202052)
    assert padded.tokens[202050] == "[PAD202050]" and padded.token_types[202050] == UNUSED
    assert data.tokens[200008] == "<|eot|>" and data.token_types[200008] == CONTROL
    assert set(data.token_types[200000:]) == {CONTROL}
    assert data.pre == "llama4" and data.model == "gpt2"
    assert (data.bos_token_id, data.eos_token_id, data.eot_token_id) == (200000, 200001, 200008)
    assert (data.padding_token_id, data.mask_token_id) == (200018, 201818)
    assert len(data.merges) == 400 and all(len(m.split(" ")) == 2 for m in data.merges)
    assert MuseTokenizer.from_gguf_data(data).to_gguf_data() == data


def test_unused_fillers_are_unreachable_and_silent() -> None:
    toy = MuseTokenizer(toy_tokenizer_document(), vocab_size=300, pre="llama4")
    data = toy.to_gguf_data()
    assert data.tokens[258] == "[PAD258]" and data.token_types[258] == UNUSED
    rebuilt = MuseTokenizer.from_gguf_data(data)
    assert rebuilt.encode("[PAD258]", special=True) != [258]
    assert rebuilt.decode([258, 299]) == ""


def test_user_defined_tokens_and_gguf_reader_agree(tmp_path: Path) -> None:
    tok = MuseTokenizer(toy_tokenizer_document(), vocab_size=300, pre="llama4")
    data = tok.to_gguf_data()
    assert data.token_types[263] == USER_DEFINED and data.token_types[262] == CONTROL
    assert data.tokens[257] == "[PAD257]" and len(data.tokens) == 300
    path = write_tokenizer_gguf(tmp_path / "toy.gguf", data)
    assert read_gguf_tokenizer_data(gguf.GGUFReader(path)) == read_gguf_tokenizer_data(path) == data
    rebuilt = MuseTokenizer.from_gguf(gguf.GGUFReader(path))
    assert rebuilt.special_strings == {"<|begin_of_text|>", "<|end_of_text|>", "<|eot|>"}
    assert rebuilt.encode("he<think>", special=True) == [256, 263]
    assert rebuilt.encode("he<think>", special=False) == tok.encode("he<think>", special=False) != [256, 263]
    assert (rebuilt.bos_id, rebuilt.eos_id, rebuilt.eot_id, rebuilt.pad_id, rebuilt.mask_id) == (260, 261, 262, None, None)


def test_unknown_pre_tokenizer_warns_and_falls_back() -> None:
    data = MuseTokenizer(toy_tokenizer_document(), vocab_size=300).to_gguf_data()
    with pytest.warns(UserWarning, match="unknown GGUF pre-tokenizer"):
        tok = MuseTokenizer.from_gguf_data(GGUFTokenizerData(**{**_fields(data), "pre": "mystery"}))
    assert tok.pre == "llama4"


def _fields(data: GGUFTokenizerData) -> dict:
    import attrs

    return attrs.asdict(data, recurse=False)


def test_load_finds_the_tokenizer(checkpoint_dir: Path, tmp_path: Path, from_json: MuseTokenizer) -> None:
    assert MuseTokenizer.load(checkpoint_dir).encode("Hello", special=True) == from_json.encode("Hello", special=True)
    assert MuseTokenizer.load(checkpoint_dir / "model.gguf").eot_id == 200008
    # A GGUF without tokenizer metadata uses the tokenizer.json beside it.
    bare = tmp_path / "bare"
    bare.mkdir()
    writer = gguf.GGUFWriter(str(bare / "model.gguf"), "muse-glimmer")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(TokenizerError):
        MuseTokenizer.load(bare / "model.gguf")
    (bare / "tokenizer.json").write_text((checkpoint_dir / "tokenizer.json").read_text())
    assert MuseTokenizer.load(bare / "model.gguf").bos_id == 200000


def test_hf_directory_configs_declare_ids(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps(toy_tokenizer_document()))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot|>", "chat_template": "{{ x }}",
    }))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 320, "eos_token_id": 261}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [261, 262]}))
    tok = MuseTokenizer.from_file(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size, tok.chat_template) == (260, 262, 320, "{{ x }}")
    assert tok.end_of_generation_ids == (261, 262)

"""make-tiny: deterministic tiny random checkpoints and the cached default model."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from musegl_core.tiny import (
    CACHE_ENV,
    PRESETS,
    TinyPreset,
    cache_key,
    build_tiny_tokenizer,
    default_model_path,
    make_tiny,
    tiny_text_config,
    tiny_weights,
)
from musegl_core.tokenizer import MuseTokenizer

# Smallest shape that still has sliding (RoPE) and full (NoPE) layers.
SMALL = TinyPreset(
    name="test", hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=8,
    intermediate_size=32, sliding_window=8,
)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("small"), preset=SMALL, seed=3)


def test_presets() -> None:
    tiny, bench = PRESETS["tiny"], PRESETS["bench"]
    assert (tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim) == (64, 4, 4, 2, 16)
    assert (tiny.intermediate_size, tiny.sliding_window, tiny.vocab_size) == (128, 32, 202048)
    assert (bench.hidden_size, bench.num_layers, bench.num_heads, bench.num_kv_heads, bench.head_dim) == (1024, 8, 8, 2, 128)
    assert (bench.intermediate_size, bench.sliding_window) == (2816, 256)
    config = tiny_text_config(tiny, build_tiny_tokenizer())
    assert config.sliding == config.rope == (True, True, True, False)
    assert set(config.sliding) == {True, False}
    assert config.bos_token_id == 200000 and config.eos_token_ids == (200001, 200008)
    with pytest.raises(ValueError):
        TinyPreset(name="x", hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                   intermediate_size=8, sliding_window=4, vocab_size=1000)


def test_tokenizer_is_deterministic_across_processes() -> None:
    here = build_tiny_tokenizer().to_tokenizer_json()
    code = "import sys; from musegl_core.tiny import build_tiny_tokenizer; sys.stdout.write(build_tiny_tokenizer().to_tokenizer_json())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    there = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert here == there


def test_two_builds_are_byte_identical(tmp_path: Path, small_checkpoint: Path) -> None:
    calls: list[tuple[int, int, str]] = []
    again = make_tiny(tmp_path, preset=SMALL, seed=3, progress=lambda *args: calls.append(args))
    assert digest(again) == digest(small_checkpoint)
    assert digest(again.parent / "tokenizer.json") == digest(small_checkpoint.parent / "tokenizer.json")
    assert calls and calls[-1][0] == calls[-1][1]  # the progress callback saw every tensor


def test_weights_are_seeded_per_name() -> None:
    config = tiny_text_config(SMALL, build_tiny_tokenizer())
    a, b = tiny_weights(config, seed=1), tiny_weights(config, seed=1)
    q = np.asarray(a["layers.0.self_attn.q_proj.weight"])
    assert q.shape == (16, 16) and q.dtype == np.float32
    np.testing.assert_array_equal(q, np.asarray(b["layers.0.self_attn.q_proj.weight"]))
    assert not np.array_equal(q, np.asarray(a["layers.1.self_attn.q_proj.weight"]))
    assert 0.01 < float(q.std()) < 0.03
    norm = np.asarray(a["norm.weight"])
    assert abs(float(norm.mean()) - 1.0) < 0.05
    centered = np.asarray(a["layers.0.input_layernorm.weight"])
    assert abs(float(centered.mean())) < 0.1 and float(np.abs(centered).max()) < 0.5


def test_checkpoint_reads_back(small_checkpoint: Path) -> None:
    from musegl_core.checkpoint.loader import load_checkpoint

    checkpoint = load_checkpoint(small_checkpoint)
    try:
        config = checkpoint.config
        assert (config.vocab_size, config.hidden_size, config.num_layers, config.sliding_window) == (202048, 16, 4, 8)
        assert config.sliding == (True, True, True, False)
        expected = tiny_weights(tiny_text_config(SMALL, build_tiny_tokenizer()), seed=3)
        for name in ("layers.1.self_attn.k_proj.weight", "layers.3.post_feedforward_layernorm.weight", "norm.weight"):
            np.testing.assert_allclose(checkpoint.read(name), np.asarray(expected[name]), atol=2e-3)
    finally:
        checkpoint.close()


def test_metadata(small_checkpoint: Path) -> None:
    from musegl_core.checkpoint.gguf_tokenizer import read_gguf_metadata

    meta = read_gguf_metadata(small_checkpoint, ("general.", "muse-glimmer."))
    assert meta["general.architecture"] == "muse-glimmer"
    assert meta["muse-glimmer.embedding_length"] == 16 and meta["muse-glimmer.block_count"] == 4
    assert meta["muse-glimmer.attention.sliding_window_pattern"] == [True, True, True, False]
    assert meta["general.file_type"] == 1  # MOSTLY_F16, make-tiny's default


def test_embedded_and_beside_tokenizers_agree(small_checkpoint: Path) -> None:
    embedded = MuseTokenizer.from_gguf(small_checkpoint)
    beside = MuseTokenizer.from_file(small_checkpoint.parent)
    text = "<|begin_of_text|><|start|>user<|message|>Héllo 🙂 <|eot|> def f(x): return x<|eot|>"
    for special in (True, False):
        assert embedded.encode(text, special=special) == beside.encode(text, special=special)
    assert embedded.to_gguf_data() == beside.to_gguf_data()
    assert embedded.eot_id == 200008 and embedded.mask_id == 201818


def test_default_model_path_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_path(preset=SMALL))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2 and results[0] == results[1]
    path = results[0]
    assert path.name == "model.gguf" and path.parent.parent == tmp_path and path.parent.name.startswith("tiny-")
    assert (path.parent / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.parent.name]  # no staging folders left
    mtime = path.stat().st_mtime_ns
    assert default_model_path(preset=SMALL) == path and path.stat().st_mtime_ns == mtime
    assert cache_key(SMALL, 0, "f16") != cache_key(SMALL, 1, "f16") != cache_key(SMALL, 1, "f32")

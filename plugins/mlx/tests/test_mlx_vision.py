"""The MLX vision tower against transformers (float32): image feature rows through the
Hugging Face directory and through GGUF + mmproj, and a chat with an image through the
HTTP API continuing exactly as transformers does."""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.checkpoint.vision import load_vision
from musegl_core.config import ServeConfig
from musegl_core.engine.request import ImageInput
from musegl_core.vision.preprocess import ImagePreprocessor, pixel_values
from musegl_mlx.executor import MLXExecutor
from musegl_mlx.loader import checkpoint_weights
from musegl_core.testing.server import running_server
from musegl_core.testing.reference_models import build_tiny_vl_model

FEATURE_TOL = 1e-4

# The torch executor's vision tests hold the fixtures that build a tiny VL model's twins
# (HF directory, GGUF + mmproj) and PNG images; load them from there rather than copy them.
_spec = importlib.util.spec_from_file_location(
    "cuda_vision_parity", Path(__file__).resolve().parents[2] / "cuda" / "tests" / "test_vision_parity.py")
_cuda = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cuda)
png, twin, plain_reference, answer_text = _cuda.png, _cuda.twin, _cuda.plain_reference, _cuda.answer_text


def image_of(width: int, height: int, seed: int, patches: int = 4096):
    return ImagePreprocessor(patches).preprocess(ImageInput("image/png", base64.b64encode(png(width, height, seed)).decode()))


@pytest.fixture(scope="module")
def small_vl(tmp_path_factory):
    model = build_tiny_vl_model(seed=3)
    return (model, *twin(model, tmp_path_factory.mktemp("mlx_vl")))


def executor(path, mmproj=None) -> MLXExecutor:
    checkpoint = load_checkpoint(path)
    vision = load_vision(path, mmproj, checkpoint.config.hidden_size)
    return MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype="float32",
                       vision=vision)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_image_feature_rows_match_transformers(small_vl, source):
    model, hf, gguf_path, mmproj = small_vl
    ex = executor(hf) if source == "hf" else executor(gguf_path, mmproj)
    assert ex.info.vision
    for (width, height), patches, grid in (((140, 84), 4096, (6, 10)), ((400, 300), 64, (6, 8))):
        image = image_of(width, height, 7, patches)
        assert image.grid == grid
        rows = np.array(ex.embed_image(image))
        with torch.no_grad():
            ref = model.model.get_image_features(torch.from_numpy(pixel_values(image)),
                                                 torch.tensor([[1, *grid]])).pooler_output[0].numpy()
        assert rows.shape == ref.shape == (grid[0] * grid[1] // 4, 64)
        assert float(np.abs(rows - ref).max()) <= FEATURE_TOL


def test_text_only_gguf_cannot_embed(small_vl):
    ex = executor(small_vl[2])
    assert not ex.info.vision
    with pytest.raises(ValueError, match="without a vision projector"):
        ex.embed_image(image_of(28, 28, 1))


@pytest.mark.slow  # about 40 s on two loaded cores; the feature rows above run by default
def test_chat_with_an_image_continues_like_transformers(tmp_path_factory):
    from musegl_core.tiny import build_tiny_tokenizer
    from musegl_core.tokenizer import MuseTokenizer

    model = build_tiny_vl_model(seed=1, vocab_size=202048, bos_token_id=200000, eos_token_id=200001)
    hf, gguf_path, mmproj = twin(model, tmp_path_factory.mktemp("mlx_chat_vl"), tokenizer=build_tiny_tokenizer())
    tokenizer = MuseTokenizer.load(hf)
    _, body, ids, expected = plain_reference(model, tokenizer)  # (an image seed whose reference is plain text)
    config = ServeConfig(model=str(gguf_path), mmproj=str(mmproj), port=0, executor="mlx", dtype="float32",
                         max_context=512)
    with running_server(config) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        result = response.json()
        assert result["usage"]["prompt_tokens"] == len(ids)
        assert answer_text(result) == tokenizer.decode(expected)

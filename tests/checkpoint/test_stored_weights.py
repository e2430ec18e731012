"""Checkpoint.read_stored: weights in their stored dtype (f16, bf16, GGUF blocks), not upcast."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from musegl_core.testing.reference_models import tiny_tokenizer_data
from musegl_core.checkpoint.gguf_writer import write_text_gguf
from musegl_core.checkpoint.hf_reader import CENTERED_NORMS
from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.checkpoint.stored import StoredTensor


@pytest.fixture(scope="module")
def hf_weights(tiny_hf):
    checkpoint = load_checkpoint(tiny_hf.path)
    return checkpoint.config, dict(checkpoint.iter_weights())


def check_against_read(checkpoint, *, matrix_dtype: str) -> None:
    """Every stored tensor decodes to exactly what ``read`` gives, in transformers layout."""
    for stored in checkpoint.iter_stored():
        assert isinstance(stored, StoredTensor)
        expected = checkpoint.read(stored.name)
        assert stored.shape == expected.shape, stored.name
        if len(stored.shape) == 1:
            assert stored.dtype == "f32" and stored.data.dtype == np.float32
        else:
            assert stored.dtype == matrix_dtype, stored.name
        np.testing.assert_array_equal(stored.to_float32(), expected, err_msg=stored.name)


@pytest.mark.parametrize("file_type", ["f32", "f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_gguf_stored_matches_read(tmp_path, hf_weights, file_type, fuse_qkv):
    config, weights = hf_weights
    path = tmp_path / f"m-{file_type}.gguf"
    write_text_gguf(path, config, weights, tiny_tokenizer_data(), file_type=file_type, fuse_qkv=fuse_qkv)
    checkpoint = load_checkpoint(path)
    check_against_read(checkpoint, matrix_dtype=file_type)
    q = checkpoint.read_stored("layers.2.self_attn.q_proj.weight")
    if file_type == "f16":
        assert q.data.dtype == np.float16 and q.data.shape == q.shape
    elif file_type == "bf16":
        assert q.data.dtype == np.uint16 and q.data.shape == q.shape
    elif file_type in ("q8_0", "q4_0"):
        qtype = gguf.GGMLQuantizationType[file_type.upper()]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert q.quantized and q.ggml_type == qtype and q.block_size == block
        assert q.data.dtype == np.uint8 and q.data.shape == (q.shape[0], q.shape[1] // block * size)
        # The blocks are the file's own blocks, rows reordered: re-encoding the
        # transformers-layout weight gives the same bytes.
        ref = weights["layers.2.self_attn.q_proj.weight"]
        np.testing.assert_array_equal(q.data, gguf.quants.quantize(ref, qtype))


def test_q4_k_blocks_are_unpermuted_as_rows():
    """Q4_K (gguf-py has no quantizer for it): random valid 144-byte super-blocks; the
    RoPE row un-permutation moves whole block rows, so decoding commutes with it."""
    from musegl_core.checkpoint.gguf_file import GGUFTensor
    from musegl_core.checkpoint.gguf_reader import unpermute_rope_rows
    from musegl_core.checkpoint.stored import stored_from_gguf, unpermute_stored_rows

    rng = np.random.default_rng(0)
    rows, cols, heads = 32, 512, 2
    qtype = gguf.GGMLQuantizationType.Q4_K
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(rows, cols // block, 2)).astype(np.float16)
    raw[:, :, :4] = scales.view(np.uint8).reshape(rows, cols // block, 4)  # d, dmin
    tensor = GGUFTensor("blk.0.attn_q.weight", (cols, rows), qtype, raw.reshape(rows, -1))
    stored = stored_from_gguf("layers.0.self_attn.q_proj.weight", tensor)
    assert stored.dtype == "q4_k" and stored.shape == (rows, cols) and stored.quantized
    moved = unpermute_stored_rows(stored, heads)
    np.testing.assert_array_equal(moved.to_float32(), unpermute_rope_rows(stored.to_float32(), heads))


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_hf_half_precision_stays_half(tmp_path, tiny_hf, kind):
    import torch
    from safetensors.torch import save_file

    from musegl_core.checkpoint.hf_reader import text_weight_names

    checkpoint = load_checkpoint(tiny_hf.path)
    torch_dtype = {"F16": torch.float16, "BF16": torch.bfloat16}[kind]
    tensors = {f"model.language_model.{n}": torch.from_numpy(w).to(torch_dtype)
               for n, w in checkpoint.iter_weights()}
    (tmp_path / "config.json").write_text((tiny_hf.path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    half = load_checkpoint(tmp_path)
    for name in text_weight_names(half.config):
        stored = half.read_stored(name)
        if len(stored.shape) == 1:
            assert stored.dtype == "f32"
            np.testing.assert_array_equal(stored.data, half.read(name))
            continue
        assert stored.dtype == kind.lower()
        as_torch = torch.from_numpy(stored.data)
        if kind == "BF16":
            as_torch = as_torch.view(torch.bfloat16)
        assert torch.equal(as_torch, tensors[f"model.language_model.{name}"]), name
        np.testing.assert_array_equal(stored.to_float32(), half.read(name))


def test_centered_norms_are_float32_without_the_plus_one(tmp_path, hf_weights):
    config, weights = hf_weights
    path = tmp_path / "m.gguf"
    write_text_gguf(path, config, weights, tiny_tokenizer_data(), file_type="q8_0")
    checkpoint = load_checkpoint(path)
    for suffix in CENTERED_NORMS:
        name = f"layers.1.{suffix}"
        stored = checkpoint.read_stored(name)
        assert stored.dtype == "f32"
        np.testing.assert_array_equal(np.float32(1) + stored.data, np.float32(1) + weights[name])

"""GGUF k-quants and mlx-lm's quantized safetensors as MLX quantized matrices (kept as stored)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_mlx.executor import MLXExecutor
from musegl_mlx.loader import checkpoint_weights, fuse
from musegl_mlx.model import LinearGroup
from musegl_mlx.quant import q6_k_error, q6_k_values, quantized_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cuda" / "tests"))
from stored_weights_support import stored_weight  # noqa: E402  (random GGUF blocks, shared with the CPU kernel tests)

BLOCK = 16


def dequantized(weight) -> np.ndarray:
    scales, biases = weight.dense_values()
    return np.array(mx.dequantize(mx.array(weight.packed), mx.array(scales), mx.array(biases),
                                  group_size=weight.group_size, bits=weight.bits))


@pytest.mark.parametrize("dtype, bits", [("q4_k", 4), ("q5_k", 5)])
def test_q4_k_and_q5_k_are_affine_groups_of_32_exactly(dtype, bits):
    """Every value MLX decodes is gguf-py's value, bit for bit."""
    stored = stored_weight(dtype, 24, 512, seed=4)
    weight = quantized_weight(stored)
    assert (weight.bits, weight.group_size) == (bits, 32)
    assert weight.packed.nbytes == 24 * 512 * bits // 8
    assert np.array_equal(dequantized(weight), stored.to_float32())
    linear = weight.linear(mx.float32)  # the scales kept as the file's factors: about the file's bytes
    assert sum(a.nbytes for a in linear.arrays()) <= 1.03 * stored.data.nbytes
    x = mx.random.normal((3, 512))
    assert np.allclose(np.array(linear(x)), np.array(x) @ stored.to_float32().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
def test_32_value_blocks_map_exactly_at_about_their_size(dtype):
    """Q8_0/Q4_0/Q4_1: MLX decodes gguf-py's values; float16 scales (Q4_0's bias computed
    from its scale) keep the matrix within 1.06x its stored bytes; rows looked up from
    the table (the embedding) decode in float32."""
    from musegl_mlx.model import dequantized_rows

    stored = stored_weight(dtype, 24, 512, seed=6)
    weight = quantized_weight(stored)
    assert np.array_equal(dequantized(weight), stored.to_float32())
    linear = weight.linear(mx.float32)
    assert sum(a.nbytes for a in linear.arrays()) <= 1.06 * stored.data.nbytes
    rows = dequantized_rows(linear, mx.array([3, 0, 7]))
    assert rows.dtype == mx.float32 and np.array_equal(np.array(rows), stored.to_float32()[[3, 0, 7]])


def test_q6_k_takes_its_nearest_mlx_form_with_a_bounded_error():
    """Q6_K's 16-value scales have no MLX layout: 6-bit groups of 32 (the file's size) keep
    the half with the larger scale on its own grid (exact but for float32's rounding of
    scale·code + bias) and round the other half by at most half a step (a step where it
    reaches +32 steps, which 6 bits cannot hold)."""
    stored = stored_weight("q6_k", 24, 512, seed=5)
    weight = quantized_weight(stored)
    assert (weight.bits, weight.group_size) == (6, 32)
    linear = weight.linear(mx.float32)
    assert sum(a.nbytes for a in linear.arrays()) <= 1.02 * stored.data.nbytes
    exact, approx = stored.to_float32(), dequantized(weight)
    assert not np.array_equal(exact, approx)
    step = np.abs(np.repeat(weight.dense_values()[0], 32, axis=1))
    assert np.all(np.abs(approx - exact) <= step + 1e-6 * np.abs(exact))
    _, scales = q6_k_values(stored)
    halves = np.abs(scales.reshape(24, -1, 2))
    bigger = np.repeat(np.where(halves[..., 0] >= halves[..., 1], 0, 1), 32, axis=1)
    in_bigger_half = (np.arange(512) % 32 // 16)[None, :] == bigger
    rounding = 64 * step * 2.0 ** -23  # float32's rounding of scale·code + bias (|code|, |bias/scale| <= 63)
    assert np.all(np.abs(approx - exact)[in_bigger_half] <= rounding[in_bigger_half])
    clipped = np.abs(approx - exact) > step / 2 + 1e-6 * np.abs(exact)
    assert clipped.mean() < 0.01
    error = q6_k_error(stored)
    assert 0 < error < 0.02, error


@pytest.mark.parametrize("dtype", ["q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "q4_1"])
def test_large_matrices_convert_in_row_chunks_to_the_same_form(dtype, monkeypatch):
    """Row chunks (bounded temporaries for a 30B head) give the whole matrix's form, and
    scales and biases that share their factors still hold them once."""
    from musegl_mlx import quant

    stored = stored_weight(dtype, 24, 512, seed=7)
    whole = quantized_weight(stored)
    monkeypatch.setattr(quant, "CHUNK_ROWS", 10)
    chunked = quantized_weight(stored)
    assert np.array_equal(chunked.packed, whole.packed)
    for a, b in zip(chunked.dense_values(), whole.dense_values()):
        assert np.array_equal(a, b)
    assert sum(a.nbytes for a in chunked.linear(mx.float32).arrays()) == \
        sum(a.nbytes for a in whole.linear(mx.float32).arrays())


def test_projections_of_different_layouts_stay_quantized():
    """A Q4_K_M file's Q4_K q/k beside its Q6_K v: each part keeps its own layout, and the
    group's product is the parts' products side by side."""
    dtype = mx.float32
    parts = [quantized_weight(stored_weight(kind, 64, 256, seed=i)).linear(dtype)
             for i, kind in enumerate(("q4_k", "q4_k", "q6_k", "q4_k"))]
    group = fuse(parts, dtype)
    assert isinstance(group, LinearGroup) and [p.bits for p in group.parts] == [4, 6, 4]
    assert all(p.quantized for p in group.parts) and group.parts[0].weight.shape[0] == 128
    x = mx.random.normal((5, 256))
    expected = mx.concatenate([p(x) for p in parts], axis=-1)
    assert np.allclose(np.array(group(x)), np.array(expected), rtol=1e-6, atol=1e-6)


def executor_for(path, dtype: str = "float32") -> MLXExecutor:
    checkpoint = load_checkpoint(path)
    ex = MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype=dtype,
                     block_size=BLOCK)
    checkpoint.close()
    ex.allocate_kv(32)
    return ex


def greedy(ex, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    blocks = list(range(-(-(len(ids) + n) // BLOCK)))
    out = ex.step(Step([SeqChunk(seq=0, tokens=ids, positions=list(range(len(ids))), blocks=blocks, sample=True,
                                 logit_rows=True)]))
    logits, tokens = np.asarray(out.logits[0]), [out.tokens[0][-1]]
    while len(tokens) < n:
        out = ex.step(Step([SeqChunk(seq=0, tokens=[tokens[-1]], positions=[len(ids) + len(tokens) - 1],
                                     blocks=blocks, sample=True)]))
        tokens.append(out.tokens[0][-1])
    return logits, tokens


@pytest.fixture(scope="module")
def mlx_lm_4bit(tiny_hf, tmp_path_factory):
    """The tiny checkpoint through mlx-lm's converter: 4-bit, groups of 64."""
    pytest.importorskip("mlx_lm")
    from musegl_core.testing.mlx_lm_tools import mlx_lm_quantize

    return mlx_lm_quantize(tiny_hf.path, tmp_path_factory.mktemp("mlx_lm") / "q4g64", bits=4, group_size=64)


def test_mlx_lm_quantized_safetensors_load_as_stored_and_match_transformers(tiny_hf, mlx_lm_4bit):
    """Every matrix of mlx-lm's file (embedding and head too) stays 4-bit in MLX; logits and
    32 greedy tokens equal transformers running the file's weights dequantized, in float32."""
    import json

    from musegl_core.testing.quantized_reference import reference_with_weights

    assert json.loads((mlx_lm_4bit / "config.json").read_text())["quantization"]["bits"] == 4
    checkpoint = load_checkpoint(mlx_lm_4bit)
    assert checkpoint.file_type == "mlx_q4_g64"
    reference = reference_with_weights(tiny_hf.model, checkpoint)
    ex = executor_for(mlx_lm_4bit)
    layer = ex.model.layers[0]
    linears = (layer.qkvg, layer.gate_up, layer.down_proj, layer.o_proj, ex.model.lm_head, ex.model.embed_tokens.table)
    assert all(linear.quantized and (linear.bits, linear.group_size) == (4, 64) for linear in linears)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(12)).tolist()
    logits, tokens = greedy(ex, ids, 32)
    with torch.no_grad():
        ref_logits = reference(input_ids=torch.tensor([ids])).logits[0].numpy()
        ref_tokens = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 40, dtype=torch.long),
                                        max_new_tokens=32, do_sample=False)[0, 40:].tolist()
    assert float(np.abs(logits - ref_logits).max()) <= 1e-4
    assert tokens == ref_tokens


def test_mlx_lm_file_on_torch_cpu_matches_transformers(tiny_hf, mlx_lm_4bit):
    """The torch-cpu executor reads mlx-lm's file too (its matrices decoded to float32: the
    CPU kernels have no MLX layout): ``musegl generate`` is greedy-identical to transformers
    on the file's values."""
    from musegl_core.testing.quantized_files import greedy_cli, reference_greedy
    from musegl_core.testing.quantized_reference import reference_with_weights

    checkpoint = load_checkpoint(mlx_lm_4bit)
    reference = reference_with_weights(tiny_hf.model, checkpoint)
    checkpoint.close()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(13)).tolist()
    assert greedy_cli(mlx_lm_4bit, "torch-cpu", ids, 24) == reference_greedy(reference, ids, 24)


def test_a_linear_groups_rows_run_across_its_parts():
    """FP8 KV's V scales read V's rows of a fused q/k/v/g matrix whose parts are kept in
    different forms (a Q4_K_M file's Q4_K q/k beside its Q6_K v): rows across parts."""
    import mlx.core as mx

    from musegl_mlx.model import Linear, LinearGroup

    rng = np.random.default_rng(0)
    dense = rng.standard_normal((96, 64)).astype(np.float32)
    weight, scales, biases = mx.quantize(mx.array(dense[40:]), group_size=32, bits=8)
    group = LinearGroup([Linear(mx.array(dense[:40])), Linear(weight, scales, biases, group_size=32, bits=8)])
    want = np.concatenate([dense[:40], np.array(group.parts[1].rows(0, 56))])
    for start, stop in ((0, 96), (30, 50), (40, 41), (45, 96), (0, 40)):
        np.testing.assert_array_equal(np.array(group.rows(start, stop)), want[start:stop])
    assert np.abs(want[40:] - dense[40:]).max() < 0.05

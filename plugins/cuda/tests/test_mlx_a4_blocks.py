"""mlx-lm's 4-bit, group-64 matrices run as stored by the CPU kernels (A4 blocks): on each
kernel path this CPU runs, the decoded values are numpy's ``scale·q + bias`` bit for bit,
products are float32-accurate with rows independent of their batch, and the matrix holds
the file's bytes (codes, scales and biases in the file's dtype)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.checkpoint.stored import StoredTensor, mlx_dtype
from musegl_cuda.cpu import native
from musegl_cuda.cpu.stored_matrix import StoredMatrix, mlx_a4_blocks, stored_matrix
from test_kernel_paths import assert_float32_accuracy, assert_rows_ignore_their_batch, path_kernels

ROWS, COLS = 42, 512


@pytest.fixture(autouse=True)
def fresh_choice():
    native.reset()
    yield
    native.reset()


def mlx_matrix(scale_dtype: str, seed: int = 0) -> tuple[StoredTensor, int]:
    """A random MLX 4-bit, group-64 matrix as the Hugging Face reader gives it (scales and
    biases as float32 values of ``scale_dtype``), and its bytes in the file."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=(ROWS, COLS // 8), dtype=np.uint64).astype(np.uint32)
    scales = rng.uniform(0.001, 0.02, size=(ROWS, COLS // 64)).astype(np.float32)
    biases = rng.uniform(-0.1, 0.1, size=(ROWS, COLS // 64)).astype(np.float32)
    if scale_dtype == "bf16":
        scales, biases = ((a.view(np.uint32) & 0xFFFF0000).view(np.float32) for a in (scales, biases))
    elif scale_dtype == "f16":
        scales, biases = (a.astype(np.float16).astype(np.float32) for a in (scales, biases))
    size = 4 if scale_dtype == "f32" else 2
    stored = StoredTensor("w", mlx_dtype(4, 64), (ROWS, COLS), words, scales=scales, biases=biases)
    return stored, words.nbytes + 2 * scales.size * size


@pytest.mark.parametrize("scale_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("path", native.PATH_NAMES)
def test_mlx_4_bit_groups_of_64_run_as_stored(path, scale_dtype):
    kernels = path_kernels(path)
    stored, file_bytes = mlx_matrix(scale_dtype)
    kind, blocks = mlx_a4_blocks(stored)
    assert kind == f"a4_{scale_dtype}" and blocks.nbytes == file_bytes
    matrix = StoredMatrix(kind, torch.from_numpy(blocks), ROWS, COLS, kernels=kernels)
    w = torch.from_numpy(stored.to_float32())
    assert torch.equal(matrix.dequantize(), w)
    assert torch.equal(matrix.dequantize(torch.tensor([5, 0, 41])), w[[5, 0, 41]])
    x = torch.randn(70, COLS, generator=torch.Generator().manual_seed(1))
    assert_float32_accuracy(matrix.matmul(x), x, w)
    assert_rows_ignore_their_batch(matrix.matmul, x)


def test_the_loader_keeps_mlx_4_bit_matrices_stored_and_decodes_other_layouts():
    """``stored_matrix`` gives an A4 :class:`StoredMatrix` for 4-bit groups of 64 (mlx-lm's
    default); another MLX layout (8-bit here) is decoded to float32 as before."""
    if native.load() is None:
        pytest.skip("no stored-weight kernels here")
    stored, file_bytes = mlx_matrix("bf16")
    matrix = stored_matrix(stored)
    assert isinstance(matrix, StoredMatrix) and matrix.dtype == "a4_bf16" and matrix.nbytes == file_bytes
    rng = np.random.default_rng(3)
    eight = StoredTensor("w", mlx_dtype(8, 64), (ROWS, COLS),
                         rng.integers(0, 2**32, size=(ROWS, COLS // 4), dtype=np.uint64).astype(np.uint32),
                         scales=stored.scales, biases=stored.biases)
    assert stored_matrix(eight).dtype == "f32"

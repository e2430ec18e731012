"""The executor conformance suite (musegl_core.testing.conformance) on the MLX executor (float32)."""

from __future__ import annotations

import pytest

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.testing.conformance import ExecutorConformance

pytest.importorskip("mlx.core", reason="MLX is not installed")


class TestMLXExecutor(ExecutorConformance):
    logits_atol = 1e-4

    @pytest.fixture(scope="class")
    @classmethod
    def executor(cls, tiny_hf):
        from musegl_mlx.executor import MLXExecutor
        from musegl_mlx.loader import checkpoint_weights

        checkpoint = load_checkpoint(tiny_hf.path)
        executor = MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype="float32",
                               block_size=4)
        yield executor
        executor.close()

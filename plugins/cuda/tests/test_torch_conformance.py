"""The executor conformance suite (musegl_core.testing.conformance) on the torch executor (CPU, float32)."""

from __future__ import annotations

import pytest

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.testing.conformance import ExecutorConformance
from musegl_cuda.executor import TorchExecutor


class TestTorchExecutorOnTheCPU(ExecutorConformance):
    logits_atol = 1e-4  # float32 products round by batch shape

    @pytest.fixture(scope="class")
    @classmethod
    def executor(cls, tiny_hf):
        executor = TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", dtype="float32", block_size=4)
        yield executor
        executor.close()

"""The executor conformance suite (musegl_core.testing.conformance) on the example executor."""

from __future__ import annotations

import pytest

from musegl_core.testing.conformance import ExecutorConformance
from musegl_core.testing.example_executor import ExampleExecutor


class TestExampleExecutor(ExecutorConformance):
    logits_atol = 0.0  # a hash for a model: exact

    @pytest.fixture(scope="class")
    @classmethod
    def executor(cls):
        executor = ExampleExecutor(vocab_size=1000)
        yield executor
        executor.close()

"""--max-prefill-chunk: as configured, else the executor's ExecutorLimits.prefill_chunk, else 512."""

from __future__ import annotations

import attrs
import pytest

from musegl_core.engine.engine import Engine, EngineConfig, prefill_chunk
from musegl_core.engine.executor import DEFAULT_PREFILL_CHUNK, GREEDY, ExecutorLimits
from musegl_core.engine.request import PreparedRequest
from musegl_core.testing.example_executor import ExampleExecutor


def test_configured_then_the_executors_then_the_default():
    assert prefill_chunk(64, ExecutorLimits(prefill_chunk=2048)) == 64
    assert prefill_chunk(None, ExecutorLimits(prefill_chunk=2048)) == 2048
    assert prefill_chunk(None, ExecutorLimits()) == DEFAULT_PREFILL_CHUNK == 512


@pytest.fixture(scope="module")
def tokenizer():
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(str(default_model_path()))


@pytest.mark.parametrize("configured,executor_default,rows", [(None, 96, 96), (40, 96, 40), (None, None, 512)])
def test_a_prompt_prefills_in_chunks_of_that_size(tokenizer, configured, executor_default, rows):
    executor = ExampleExecutor(tokenizer.vocab_size)
    executor.limits = attrs.evolve(executor.limits, prefill_chunk=executor_default)
    engine = Engine(executor, tokenizer, EngineConfig(max_context=1024, max_prefill_chunk=configured),
                    lambda event: None)
    assert engine.scheduler.limits.max_prefill_chunk == rows
    prompt = tuple(range(100, 100 + 700))
    engine.submit(PreparedRequest(id="a", prompt_ids=prompt, max_tokens=2, ignore_eos=True, sampling=GREEDY))
    engine.run_until_idle()
    steps = [step.num_tokens for step in executor.steps]
    assert steps[:-1] == [min(rows, 700 - done) for done in range(0, 700, rows)]  # then one decode step


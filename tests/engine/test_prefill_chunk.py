"""--max-prefill-chunk: as configured, else the executor's ExecutorLimits.prefill_chunk, else 512."""

from __future__ import annotations

import attrs
import pytest

from musegl_core.engine.engine import Engine, EngineConfig, prefill_chunk, solo_prefill_chunk
from musegl_core.engine.executor import DEFAULT_PREFILL_CHUNK, GREEDY, ExecutorLimits
from musegl_core.engine.request import PreparedRequest
from musegl_core.errors import ConfigError
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


def test_solo_chunk_configured_then_the_executors_within_the_step_limit():
    limits = ExecutorLimits(max_step_tokens=8192, solo_prefill_chunk=4096)
    assert solo_prefill_chunk(1024, limits, 256) == 1024
    assert solo_prefill_chunk(None, limits, 256) == 4096
    assert solo_prefill_chunk(None, ExecutorLimits(), 256) == 256  # no solo chunk: the prefill chunk
    assert solo_prefill_chunk(100, limits, 256) == 256  # never below the prefill chunk
    with pytest.raises(ConfigError, match="wider than the 8192 rows"):  # past the executor's widest step
        solo_prefill_chunk(65536, limits, 256)
    assert solo_prefill_chunk(None, attrs.evolve(limits, solo_prefill_chunk=65536), 256) == 8192


def test_a_lone_prompt_takes_the_solo_chunk_and_a_second_request_brings_back_the_prefill_chunk(tokenizer):
    executor = ExampleExecutor(tokenizer.vocab_size)
    executor.limits = attrs.evolve(executor.limits, prefill_chunk=96, solo_prefill_chunk=400)
    engine = Engine(executor, tokenizer, EngineConfig(max_context=2048, max_inflight_requests=2,
                                                      max_sessions=2), lambda event: None)
    prompt = tuple(range(100, 100 + 700))
    engine.submit(PreparedRequest(id="a", prompt_ids=prompt, max_tokens=2, ignore_eos=True, sampling=GREEDY))
    engine.run_until_idle()
    assert [step.num_tokens for step in executor.steps] == [400, 300, 1]  # alone: 400-row steps, then decode

    executor.steps.clear()
    other = tuple(range(2000, 2000 + 300))
    engine.submit(PreparedRequest(id="b", prompt_ids=prompt[::-1], max_tokens=2, ignore_eos=True, sampling=GREEDY))
    engine.submit(PreparedRequest(id="c", prompt_ids=other, max_tokens=2, ignore_eos=True, sampling=GREEDY))
    engine.run_until_idle()
    steps = [[len(c.tokens) for c in step.chunks] for step in executor.steps]
    both = max(i for i, step in enumerate(steps) if len(step) == 2) + 1  # until the first request is done
    assert all(sum(step) <= 96 + 1 for step in steps[:both])  # two requests: the prefill chunk
    assert steps[both:] == [[136], [1]]  # then the second alone: its rest in one step, then its decode

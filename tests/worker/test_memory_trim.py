"""The worker gives freed memory back once a burst of work is over (musegl_core/worker/memory.py,
issue 47): a trim when the engine is idle after committing steps, none while nothing ran."""

from __future__ import annotations

import sys

import pytest

from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.testing.engine_runs import example_engine
from musegl_core.worker.memory import IdleTrim


@pytest.fixture(scope="module")
def tokenizer():
    from musegl_core.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_a_trim_follows_each_burst_of_work_once_the_engine_is_idle(tokenizer):
    engine, events = example_engine(tokenizer, max_context=64, max_sessions=2, max_inflight_requests=2,
                                    max_decode_sequences=2)
    trims: list[int] = []
    trim = IdleTrim(lambda: engine.steps, lambda: engine.idle, lambda: trims.append(engine.steps))
    assert not trim.check() and trims == []  # nothing ran yet
    busy = [False]
    during = IdleTrim(lambda: engine.steps + 1, lambda: not busy[0], lambda: trims.append(-1))
    busy[0] = True
    assert not during.check()  # work done, but the engine is not idle: no trim
    for burst in range(2):
        engine.submit(PreparedRequest(id=f"r{burst}", prompt_ids=tuple(range(10, 30)), max_tokens=4,
                                      ignore_eos=True, sampling=GREEDY))
        engine.run_until_idle()
        assert trim.check() and trims[-1] == engine.steps > 0  # once per burst
        assert not trim.check()  # and not again until more work
    assert trim.trims == 2 and len(trims) == 2


def test_a_failing_trim_is_counted_and_does_not_stop_the_checks():
    steps = [0]

    def fail():
        raise OSError("no malloc_trim")

    trim = IdleTrim(lambda: steps[0], lambda: True, fail)
    steps[0] = 3
    assert trim.check() and not trim.check()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_default_trim_is_glibcs():
    trim = IdleTrim(lambda: 0, lambda: True)
    from musegl_core.allocator import release_free_heap

    assert trim.release is release_free_heap
    trim.release()  # runs (True or False: whether glibc gave pages back)

"""The launch gate (musegl_core/engine/launch_gate.py): closed while the engine thread launches a
step on an asynchronous executor, open while the step runs and on host-computing executors;
waiting at it is bounded."""

from __future__ import annotations

import threading
import time

import attrs

from musegl_core.engine import launch_gate
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.testing.example_executor import ExampleExecutor


class Pending:
    def __init__(self, output, seen: list, gate):
        self.output, self.seen, self.gate = output, seen, gate

    def result(self):
        self.seen.append(("result", self.gate._open.is_set()))
        return self.output


class AsyncExample(ExampleExecutor):
    """The example executor announcing asynchronous launches; records the gate at each call."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.limits = attrs.evolve(self.limits, async_steps=True)
        self.seen: list = []
        self.gate = None

    def launch(self, step):
        self.seen.append(("launch", self.gate._open.is_set()))
        return Pending(super().step(step), self.seen, self.gate)


def tokenizer():
    from musegl_core.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def run(executor) -> Engine:
    tok = tokenizer()
    engine = Engine(executor, tok, EngineConfig(max_context=256, max_prefill_chunk=8), lambda event: None)
    executor.gate = engine.launch_gate
    engine.submit(PreparedRequest(id="r", prompt_ids=tuple(range(100, 130)), max_tokens=4, ignore_eos=True,
                                  sampling=GREEDY))
    engine.run_until_idle()
    return engine


def test_the_gate_is_closed_for_each_launch_and_open_while_the_step_runs():
    executor = AsyncExample(tokenizer().vocab_size)
    engine = run(executor)
    launches = [open_ for what, open_ in executor.seen if what == "launch"]
    assert launches[:4] == [False] * 4  # the prefill steps (30 rows in chunks of 8); decode steps that
    # follow the previous one on the device launch a graph (a few calls) and are not gated
    assert all(open_ for what, open_ in executor.seen if what == "result")
    assert engine.launch_gate.closed_count >= 4  # 30 prompt rows in chunks of 8
    assert engine.launch_gate._open.is_set()


def test_a_host_computing_executor_never_closes_it():
    engine = run(ExampleExecutor(tokenizer().vocab_size))
    assert engine.launch_gate.closed_count == 0
    executor = AsyncExample(tokenizer().vocab_size)  # asynchronous, but the host computes the step
    executor.limits = attrs.evolve(executor.limits, host_compute=True)
    assert run(executor).launch_gate.closed_count == 0


def test_waiting_returns_at_once_when_open_and_is_bounded_when_closed(monkeypatch):
    # Bounds wide enough for a loaded 2-core CI machine: the waiting thread signals
    # before it waits, and the gate stays closed well past any scheduling delay.
    monkeypatch.setattr(launch_gate, "MOST_WAIT", 5.0)
    gate = launch_gate.LaunchGate()
    started = time.perf_counter()
    gate.wait()
    assert time.perf_counter() - started < 0.5
    waited = []
    ready = threading.Event()

    def other():
        t = time.perf_counter()
        ready.set()
        gate.wait()
        waited.append(time.perf_counter() - t)

    with gate.launching():
        thread = threading.Thread(target=other)
        thread.start()
        assert ready.wait(30)
        time.sleep(0.3)
    thread.join()
    assert 0.3 <= waited[0] < 4.0  # it went on when the gate opened, before MOST_WAIT
    monkeypatch.setattr(launch_gate, "MOST_WAIT", 0.3)
    with gate.launching():
        t = time.perf_counter()
        gate.wait()
        assert 0.25 < time.perf_counter() - t < 3.0  # never stuck behind a closed gate

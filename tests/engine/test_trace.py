"""``--trace-steps``: the worker's timeline (musegl_core/engine/trace.py) has every committed step and
every request's stages, in order, with times that add up."""

from __future__ import annotations

import json

from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.testing.example_executor import ExampleExecutor


def test_the_trace_has_every_step_and_each_requests_stages_in_order(tmp_path):
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    tokenizer = MuseTokenizer.load(str(default_model_path()))
    path = tmp_path / "trace.jsonl"
    events: list = []
    config = EngineConfig(max_context=256, max_sessions=4, max_prefill_chunk=16, max_decode_sequences=4,
                          trace_steps=str(path))
    engine = Engine(ExampleExecutor(tokenizer.vocab_size), tokenizer, config, events.append)
    for index, length in enumerate((40, 7)):  # prompts with nothing in common
        first = 100 + 200 * index
        engine.submit(PreparedRequest(id=f"r{index}", prompt_ids=tuple(range(first, first + length)), max_tokens=3,
                                      ignore_eos=True, sampling=GREEDY))
    engine.run_until_idle()
    engine.trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]

    steps = [line for line in lines if line["event"] == "step"]
    assert len(steps) == engine.steps
    assert sum(s["prefill"] for s in steps) == 47
    assert sum(s["decode"] for s in steps) == 2 * 2  # 3 tokens each: the first comes with the prefill
    assert steps[0]["kind"] == "prefill" and steps[0]["prefill"] == 16 and steps[0]["prefilling"] == 2
    assert all(s["seconds"] >= 0 for s in steps)
    times = [line["t"] for line in lines]
    assert times == sorted(times)
    for rid in ("r0", "r1"):
        stages = [line["event"] for line in lines if line.get("id") == rid]
        assert stages == ["admitted", "first_token", "finished"]
    finished = {line["id"]: line for line in lines if line["event"] == "finished"}
    assert {f["reason"] for f in finished.values()} == {"length"} and finished["r0"]["generated"] == 3
    assert {e.id for e in events if isinstance(e, ev.Done)} == {"r0", "r1"}


def test_long_garbage_collections_are_traced(tmp_path, monkeypatch):
    from musegl_core.engine import trace as trace_module

    monkeypatch.setattr(trace_module, "GC_MIN_SECONDS", 0.0)
    path = tmp_path / "trace.jsonl"
    trace = trace_module.Trace.open(path)
    import gc

    gc.collect()
    trace.close()
    written = path.read_text()
    gc.collect()  # closed: no longer traced
    assert path.read_text() == written
    lines = [json.loads(line) for line in written.splitlines()]
    assert 2 in [line["generation"] for line in lines if line["event"] == "gc"]

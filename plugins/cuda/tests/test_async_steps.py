"""Asynchronous steps (executor contract: ``AsyncExecutor``, ``SeqChunk.follows``)
through the engine, on the CPU: the engine launches decode step N+1, its rows
following step N's ids, before it commits step N. Whatever is pipelined, every
request must get exactly what the synchronous engine gives it (same executor,
same requests), including requests that stop, are cancelled, share a session
or need the host between steps (penalties, which are never pipelined)."""

from __future__ import annotations

import pytest
from engine_run_support import Recording

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY, AsyncExecutor, SamplingParams, SeqChunk, Step
from musegl_core.engine.request import PreparedRequest
from musegl_cuda.executor import TorchExecutor

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tiny_hf):
    return load_checkpoint(tiny_hf.path)


def run(checkpoint, tokenizer, requests, *, pipelined: bool, cancel_after: dict[str, int] | None = None,
        max_decode: int = 8):
    """Run ``requests`` (lists submitted together, one list after the other) and
    return (events by request id, the executor, the engine's stats). ``cancel_after[id] = n``: cancel
    the request once it has n tokens reported."""
    executor = Recording(checkpoint, device="cpu", block_size=BLOCK, async_steps=pipelined)
    events: list = []
    config = EngineConfig(max_context=128, max_sessions=8, max_inflight_requests=16,
                          max_decode_sequences=max_decode, max_prefill_chunk=64, prefix_caching=True)
    engine = Engine(executor, tokenizer, config, events.append)
    cancel_after = dict(cancel_after or {})
    for group in requests:
        for request in group:
            engine.submit(request)
        while True:  # Engine.run_until_idle, with a cancellation injected at a chosen token count
            engine._drain(block=False)
            if engine._dispatch_due:  # queued requests start here (the admission queue)
                engine._dispatch()
            for rid, n in list(cancel_after.items()):
                got = sum(len(e.ids) for e in events if isinstance(e, ev.Tokens) and e.id == rid)
                if got >= n:
                    engine.cancel(rid)
                    del cancel_after[rid]
            if engine.idle:
                break
            engine.step()
    by_id: dict[str, list] = {}
    for e in events:
        by_id.setdefault(e.id, []).append(e)
    return by_id, executor, engine.stats()


def request(rid: str, seed: int, n: int = 9, **kw) -> PreparedRequest:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("ignore_eos", True)
    kw.setdefault("sampling", GREEDY)
    prompt = [(seed * 37 + 11 * i) % 500 + 3 for i in range(n)]
    return PreparedRequest(id=rid, prompt_ids=tuple(prompt), **kw)


def outcome(events: list) -> tuple:
    """What a client sees: the streamed text and ids, the logprobs, the end."""
    text = "".join(e.text for e in events if isinstance(e, ev.Tokens))
    ids = [t for e in events if isinstance(e, ev.Tokens) for t in e.ids]
    logprobs = [lp for e in events if isinstance(e, ev.Tokens) for lp in e.logprobs]
    done = [(e.finish_reason, e.matched_stop, e.completion_tokens, e.generated_ids)
            for e in events if isinstance(e, ev.Done)]
    failed = [e.error for e in events if isinstance(e, ev.Failed)]
    return text, ids, logprobs, done, failed


def followed(executor) -> int:
    return sum(c.follows for s in executor.launched for c in s.chunks)


def test_the_cpu_executor_is_an_async_executor_when_asked(checkpoint):
    executor = TorchExecutor(checkpoint, device="cpu", block_size=BLOCK, async_steps=True)
    assert isinstance(executor, AsyncExecutor) and executor.limits.async_steps
    assert not TorchExecutor(checkpoint, device="cpu", block_size=BLOCK).limits.async_steps


def test_a_following_chunk_takes_the_previous_launch_s_id(checkpoint):
    executor = TorchExecutor(checkpoint, device="cpu", block_size=BLOCK, async_steps=True)
    executor.allocate_kv(32)
    prompt = [5, 17, 99, 3, 250, 7]
    first = executor.launch(Step([SeqChunk(1, prompt, list(range(6)), [0, 1], sample=1)]))
    ahead = executor.launch(Step([SeqChunk(1, [0], [6], [0, 1], sample=1, follows=True)]))
    token = first.result().tokens[1][0]
    # the same two steps with the id known: the same answer
    other = TorchExecutor(checkpoint, device="cpu", block_size=BLOCK)
    other.allocate_kv(32)
    assert other.step(Step([SeqChunk(1, prompt, list(range(6)), [0, 1], sample=1)])).tokens[1] == [token]
    known = other.step(Step([SeqChunk(1, [token], [6], [0, 1], sample=1)]))
    assert ahead.result().tokens == known.tokens
    with pytest.raises(ValueError, match="only a one-row decode chunk"):
        SeqChunk(1, [0, 0], [7, 8], [0, 1, 2], sample=2, follows=True)
    fresh = TorchExecutor(checkpoint, device="cpu", block_size=BLOCK, async_steps=True)
    fresh.allocate_kv(8)
    with pytest.raises(ValueError, match="no step was launched before"):
        fresh.launch(Step([SeqChunk(1, [0], [6], [0, 1], sample=1, follows=True)]))


def test_pipelined_engine_answers_exactly_like_the_synchronous_one(checkpoint, tokenizer):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    group = [
        request("greedy", 1, max_tokens=14),
        request("short", 2, max_tokens=3),  # stops long before the others: its ahead row is discarded
        request("sampled", 3, sampling=seeded, max_tokens=10, logprobs=2),
        request("penalized", 4, sampling=SamplingParams(temperature=0.0, presence_penalty=1.5), max_tokens=8),
        request("one", 5, max_tokens=1),
    ]
    later = [request("second-wave", 6, max_tokens=7), request("greedy-2", 7, max_tokens=9)]
    sync, sync_ex, sync_stats = run(checkpoint, tokenizer, [group, later], pipelined=False)
    piped, piped_ex, piped_stats = run(checkpoint, tokenizer, [group, later], pipelined=True)
    assert set(sync) == set(piped)
    for rid in sync:
        assert outcome(piped[rid]) == outcome(sync[rid]), rid
    assert followed(sync_ex) == 0 and sync_stats["steps_ahead"] == 0
    assert followed(piped_ex) > 0  # once the penalized request is done, steps run ahead
    assert piped_stats["steps_ahead"] == sum(any(c.follows for c in s.chunks) for s in piped_ex.launched)
    # every following chunk sits in a step whose sequences decode one row each
    for step in piped_ex.launched:
        if any(c.follows for c in step.chunks):
            assert all(c.follows and len(c.tokens) == 1 for c in step.chunks)


def test_stops_cancellation_and_sessions_are_unchanged_by_pipelining(checkpoint, tokenizer):
    probe, _, _ = run(checkpoint, tokenizer, [[request("probe", 11, max_tokens=16)]], pipelined=False)
    text = outcome(probe["probe"])[0]
    stop = text[len(text) // 2: len(text) // 2 + 3]  # a stop string met in the middle of the answer
    assert stop.strip()
    first = [
        request("stopped", 11, max_tokens=16, stop=(stop,)),
        request("cancelled", 12, max_tokens=40),
        request("turn-1", 13, max_tokens=6, session_id="s"),
        request("turn-2", 14, max_tokens=6, session_id="s"),  # queued behind turn-1 on its session
    ]
    second = [request("turn-3", 15, max_tokens=5, session_id="s")]
    runs = [run(checkpoint, tokenizer, [first, second], pipelined=p, cancel_after={"cancelled": 4})
            for p in (False, True)]
    (sync, _, _), (piped, piped_ex, _) = runs
    for rid in sync:
        if rid == "cancelled":  # cancelled after its 4th token: the same tokens up to there
            s, p = outcome(sync[rid]), outcome(piped[rid])
            assert p[1][:4] == s[1][:4] and p[3][0][0] == s[3][0][0] == "cancelled"
            continue
        assert outcome(piped[rid]) == outcome(sync[rid]), rid
    assert outcome(piped["stopped"])[3][0][:2] == ("stop", stop)
    done = {rid: outcome(events)[3][0] for rid, events in piped.items() if outcome(events)[3]}
    assert done["turn-2"][2] == 6 and done["turn-3"][2] == 5
    assert followed(piped_ex) > 0


def test_a_stop_string_wastes_one_row_ahead_and_nothing_else(checkpoint, tokenizer):
    """A sequence alone, stopped by a stop string: the step launched ahead of the step
    that matched it carries its row, which is discarded (cancellations and
    ``max_tokens`` are known before a step is launched ahead, so they waste none)."""
    probe, _, _ = run(checkpoint, tokenizer, [[request("probe", 31, max_tokens=16)]], pipelined=False)
    text = outcome(probe["probe"])[0]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    stopped = [[request("stopped", 31, max_tokens=16, stop=(stop,))]]
    (sync, _, sync_stats), (piped, _, piped_stats) = (run(checkpoint, tokenizer, stopped, pipelined=p)
                                                      for p in (False, True))
    assert outcome(piped["stopped"]) == outcome(sync["stopped"])
    assert outcome(piped["stopped"])[3][0][:2] == ("stop", stop)
    assert piped_stats["discarded_rows"] == 1 and sync_stats["discarded_rows"] == 0
    assert piped_stats["steps"] == sync_stats["steps"]  # the discarded step is not counted as run
    length, _, length_stats = run(checkpoint, tokenizer, [[request("length", 31, max_tokens=16)]], pipelined=True)
    assert length_stats["discarded_rows"] == 0 and length_stats["steps_ahead"] > 0


def test_more_sequences_than_decode_slots_take_turns_without_pipelining_errors(checkpoint, tokenizer):
    group = [request(f"r{i}", 20 + i, max_tokens=5 + i) for i in range(5)]
    sync, _, _ = run(checkpoint, tokenizer, [group], pipelined=False, max_decode=2)
    piped, _, _ = run(checkpoint, tokenizer, [group], pipelined=True, max_decode=2)
    for rid in sync:
        assert outcome(piped[rid]) == outcome(sync[rid]), rid

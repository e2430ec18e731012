"""The admission queue (engine/admission.py): --max-inflight-requests bounds the
running requests, --max-queued-requests the waiting ones; queued requests hold
no KV, leave the queue when cancelled, and refusals carry a truthful Retry-After."""

from __future__ import annotations

from musegl_core.engine import events as ev
from musegl_core.engine.errors import Busy, NoSessionSlot
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.testing.example_executor import ExampleExecutor


def engine_for(tokenizer, **config):
    events: list = []
    settings = dict(max_context=64, max_sessions=8, max_inflight_requests=2, max_decode_sequences=8)
    executor = ExampleExecutor(tokenizer.vocab_size)
    engine = Engine(executor, tokenizer, EngineConfig(**{**settings, **config}), events.append)
    return engine, executor, events


def request(rid: str, session: str | None = None, max_tokens: int = 4) -> PreparedRequest:
    return PreparedRequest(id=rid, prompt_ids=(100, 200, 300 + len(rid)), max_tokens=max_tokens, ignore_eos=True,
                           sampling=GREEDY, session_id=session)


def of(events, kind, rid=None):
    return [e for e in events if isinstance(e, kind) and (rid is None or e.id == rid)]


def snapshot(engine) -> dict:
    """The engine's stats right after the commands submitted so far (before any step)."""
    seen: list = []
    engine.call(seen.append)
    engine._drain(block=False)
    return seen[0]


def test_requests_beyond_the_running_limit_wait_and_all_finish(tokenizer):
    engine, executor, events = engine_for(tokenizer)
    for i in range(6):
        engine.submit(request(f"r{i}"))
    stats = snapshot(engine)
    assert (stats["running"], stats["waiting"]) == (2, 4)
    # Queued requests hold no KV; blocks on demand: the two running requests reserve only what their
    # prompt and max_tokens can fill (3 + 4 positions), not --max-context.
    per_request = engine.pool.blocks_for(3 + 4)
    assert stats["kv_blocks_used"] + stats["kv_blocks_reserved"] == 2 * per_request
    assert per_request < engine.pool.blocks_for(64)
    assert engine.sessions.slots_in_use == 2
    engine.run_until_idle()
    assert not of(events, ev.Failed)
    assert len(of(events, ev.Done)) == 6
    assert max(len({c.seq for c in step.chunks}) for step in executor.steps) == 2  # never more than 2 ran
    started = {e.id: e for e in of(events, ev.Started)}
    assert list(started)[:2] == ["r0", "r1"] and sorted(started) == [f"r{i}" for i in range(6)]
    assert started["r5"].queue_seconds > started["r0"].queue_seconds  # it waited; first come first served
    assert engine.pool.used_blocks == 0


def test_a_full_queue_refuses_with_server_busy_and_a_retry_after(tokenizer):
    engine, _, events = engine_for(tokenizer, max_inflight_requests=1, max_queued_requests=1)
    for i in range(3):
        engine.submit(request(f"r{i}"))
    engine.run_until_idle()
    (refused,) = of(events, ev.Failed)
    assert refused.id == "r2" and isinstance(refused.error, Busy)
    assert refused.error == Busy(running=1, queued=1, retry_after=refused.error.retry_after)
    assert refused.error.retry_after >= 1
    assert {e.id for e in of(events, ev.Done)} == {"r0", "r1"}
    assert engine.stats()["queue_refused"] == 1


def test_no_queue_refuses_what_cannot_run_at_once(tokenizer):
    engine, _, events = engine_for(tokenizer, max_inflight_requests=1, max_queued_requests=0)
    engine.submit(request("a"))
    engine.submit(request("b"))
    engine.run_until_idle()
    assert [type(e.error) for e in of(events, ev.Failed)] == [Busy]


def test_a_cancelled_queued_request_leaves_the_queue(tokenizer):
    engine, _, events = engine_for(tokenizer, max_inflight_requests=1)
    for rid in ("a", "b", "c"):
        engine.submit(request(rid, max_tokens=8))
    engine.cancel("b")
    stats = snapshot(engine)
    assert (stats["running"], stats["waiting"]) == (1, 1)
    engine.run_until_idle()
    assert {e.id for e in of(events, ev.Done)} == {"a", "c"}
    assert not of(events, ev.Started, "b") and not of(events, ev.Failed)


def test_anonymous_requests_wait_for_a_slot_that_frees(tokenizer):
    engine, _, events = engine_for(tokenizer, max_sessions=2, max_inflight_requests=4)
    for i in range(5):
        engine.submit(request(f"r{i}"))
    stats = snapshot(engine)
    assert (stats["running"], stats["waiting"]) == (2, 3)  # two slots: the others wait, holding none
    engine.run_until_idle()
    assert len(of(events, ev.Done)) == 5 and not of(events, ev.Failed)


def test_a_session_request_waits_behind_its_session_without_blocking_others(tokenizer):
    engine, _, events = engine_for(tokenizer, max_inflight_requests=2)
    engine.submit(request("s1", session="chat", max_tokens=8))
    engine.submit(request("s2", session="chat"))
    engine.submit(request("other"))
    stats = snapshot(engine)
    assert (stats["running"], stats["waiting"]) == (2, 1)  # s1 and other run; s2 waits for s1
    (info,) = engine.sessions.describe()
    assert info.queued_requests == 1 and info.state == "active"
    engine.run_until_idle()
    done = [e.id for e in of(events, ev.Done)]
    assert done.index("s1") < done.index("s2") and len(done) == 3


def test_slots_held_by_persisting_sessions_fail_a_new_session_at_once_without_a_retry_after(tokenizer):
    engine, _, events = engine_for(tokenizer, max_sessions=1)
    engine.submit(request("keep", session="resident"))
    engine.run_until_idle()
    engine.submit(request("new", session="newcomer"))
    engine.run_until_idle()
    (failed,) = of(events, ev.Failed)
    assert isinstance(failed.error, NoSessionSlot)
    assert failed.error.retry_after is None  # no slot frees on its own


def test_anonymous_work_always_finds_room(tokenizer):
    """Issue 47 item 11: sessions named by one client took every slot and every anonymous
    request got 503; now the least recently used idle named session gives way."""
    engine, _, events = engine_for(tokenizer, max_sessions=2)
    engine.submit(request("one", session="first"))
    engine.run_until_idle()
    engine.submit(request("two", session="second"))
    engine.run_until_idle()
    engine.submit(request("anon"))
    engine.run_until_idle()
    assert not of(events, ev.Failed) and {e.id for e in of(events, ev.Done)} == {"one", "two", "anon"}
    assert [info.id for info in engine.sessions.describe()] == ["second"]  # "first" was the least recently used
    # a named session with a request running is never evicted: the anonymous request waits for it
    engine.submit(request("busy", session="second", max_tokens=8))
    engine.submit(request("third-name", session="third"))
    engine.submit(request("anon2"))
    engine.run_until_idle()
    assert {e.id for e in of(events, ev.Done)} >= {"busy", "third-name", "anon2"}


def test_with_an_idle_timeout_the_retry_after_is_when_a_session_can_expire(tokenizer):
    engine, _, events = engine_for(tokenizer, max_sessions=1, session_idle_timeout=30.0)
    engine.submit(request("keep", session="resident"))
    engine.run_until_idle()
    engine.submit(request("new", session="newcomer"))
    engine.run_until_idle()
    (failed,) = of(events, ev.Failed)
    assert isinstance(failed.error, NoSessionSlot) and 29 <= failed.error.retry_after <= 30

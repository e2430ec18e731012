"""Admission fairness (issue 47 items 11 and 15, docs/engine.md "Admission"): queued
requests start round-robin over client keys, in arrival order within a client and
within a named session; the ``n`` choices of one response start together even when
named sessions hold the other slots."""

from __future__ import annotations

from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.testing.example_executor import ExampleExecutor


def engine_for(tokenizer, **config):
    events: list = []
    settings = dict(max_context=64, max_sessions=8, max_inflight_requests=1, max_decode_sequences=8)
    engine = Engine(ExampleExecutor(tokenizer.vocab_size), tokenizer, EngineConfig(**{**settings, **config}),
                    events.append)
    return engine, events


def request(rid: str, client: str | None = None, *, session: str | None = None, group: str | None = None,
            max_tokens: int = 4) -> PreparedRequest:
    return PreparedRequest(id=rid, prompt_ids=(100, 200, 300 + len(rid)), max_tokens=max_tokens, ignore_eos=True,
                           sampling=GREEDY, session_id=session, client=client, group=group)


def started(events) -> list[str]:
    return [e.id for e in events if isinstance(e, ev.Started)]


def stats(engine) -> dict:
    """The engine's stats right after the commands submitted so far (before any step)."""
    seen: list = []
    engine.call(seen.append)
    engine._drain(block=False)
    return seen[0]


def test_queued_requests_start_round_robin_over_clients_in_arrival_order_within_each(tokenizer):
    engine, events = engine_for(tokenizer)
    for rid in ("a0", "a1", "a2", "b0", "b1", "b2"):
        engine.submit(request(rid, client=rid[0]))
    engine.submit(request("c0", client="c", max_tokens=1))
    engine.run_until_idle()
    assert not [e for e in events if isinstance(e, ev.Failed)]
    # a0 started at once; then the clients that have not started anything, oldest first, then in turns
    assert started(events) == ["a0", "b0", "c0", "a1", "b1", "a2", "b2"]


def test_a_late_client_starts_next_whatever_another_has_queued(tokenizer):
    """Issue 47 item 11: one client's 200 requests in flight delayed another user's 1-token request by 90 s."""
    engine, events = engine_for(tokenizer)
    for i in range(20):
        engine.submit(request(f"busy{i}", client="10.0.0.1"))
    engine.submit(request("probe", client="10.0.0.2", max_tokens=1))
    engine.run_until_idle()
    order = started(events)
    assert order.index("probe") == 1  # right after the request that was running when it came
    assert [rid for rid in order if rid != "probe"] == [f"busy{i}" for i in range(20)]  # FIFO within a client


def test_requests_without_a_client_key_keep_arrival_order(tokenizer):
    engine, events = engine_for(tokenizer)
    for i in range(5):
        engine.submit(request(f"r{i}"))
    engine.run_until_idle()
    assert started(events) == [f"r{i}" for i in range(5)]


def test_a_sessions_requests_run_in_arrival_order_whoever_sent_them(tokenizer):
    engine, events = engine_for(tokenizer)
    engine.submit(request("a0", client="a"))
    engine.submit(request("a-chat", client="a", session="chat"))
    engine.submit(request("b-chat", client="b", session="chat"))  # b is owed a turn, but a-chat came first
    engine.submit(request("b1", client="b"))
    engine.run_until_idle()
    order = started(events)
    assert order.index("a-chat") < order.index("b-chat")
    assert order.index("b1") == 1  # b's turn goes to its next request that may run


def resident_sessions(engine, count: int) -> None:
    for i in range(count):
        engine.submit(request(f"keep{i}", session=f"resident{i}"))
        engine.run_until_idle()
    assert len(engine.sessions.named) == count


def test_n_choices_start_together_while_named_sessions_are_resident(tokenizer):
    """Issue 47 item 15: with 3 resident sessions (4 slots), an n=4 request's choices ran one after
    another, each waiting for the previous one's slot, before any output was sent."""
    engine, events = engine_for(tokenizer, max_sessions=4, max_inflight_requests=8)
    resident_sessions(engine, 3)
    engine.submit(request("resp", group="resp", max_tokens=8))  # choice 0, then the others once it started
    assert stats(engine)["running"] == 1
    for i in range(1, 4):
        engine.submit(request(f"resp-{i}", group="resp", max_tokens=8))
    now = stats(engine)
    assert (now["running"], now["waiting"]) == (4, 0)
    engine.run_until_idle()
    assert not [e for e in events if isinstance(e, ev.Failed)]
    assert not engine.sessions.named  # the idle named sessions gave way, least recently used first


def test_unrelated_anonymous_requests_still_wait_for_a_slot_that_frees(tokenizer):
    """The group rule is narrow: anonymous requests of different responses still wait for a running
    anonymous request's slot rather than evict a resident session."""
    engine, events = engine_for(tokenizer, max_sessions=4, max_inflight_requests=8)
    resident_sessions(engine, 3)
    engine.submit(request("one", max_tokens=8))
    engine.submit(request("two", max_tokens=8))
    now = stats(engine)
    assert (now["running"], now["waiting"]) == (1, 1)
    engine.run_until_idle()
    assert len(engine.sessions.named) == 3 and not [e for e in events if isinstance(e, ev.Failed)]

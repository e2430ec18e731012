"""Soft sessions (issue 27 item 4): sessions named by a client's own conversation
key. They keep the KV between turns like named sessions, but idle out, are
evicted first when slots run short, and a request that cannot have its soft
session runs anonymously (on the prefix cache) instead of waiting or failing."""

from __future__ import annotations

from musegl_core.engine import events as ev
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.service.sessions import client_session, soft_session_name
from musegl_core.testing.engine_runs import example_engine

PROMPT = tuple(range(100, 124))  # 24 ids: six full blocks of the example executor


def engine_for(tokenizer, **config):
    settings = dict(max_context=128, max_sessions=2, max_inflight_requests=4, max_decode_sequences=8,
                    prefix_caching=False)  # reuse below comes from the session alone
    return example_engine(tokenizer, **{**settings, **config})


def soft(rid: str, prompt: tuple[int, ...], name: str = "claude-code:abc", max_tokens: int = 4) -> PreparedRequest:
    return PreparedRequest(id=rid, prompt_ids=prompt, max_tokens=max_tokens, ignore_eos=True, sampling=GREEDY,
                           session_id=name, soft_session=True)


def hard(rid: str, prompt: tuple[int, ...], name: str | None) -> PreparedRequest:
    return PreparedRequest(id=rid, prompt_ids=prompt, max_tokens=4, ignore_eos=True, sampling=GREEDY,
                           session_id=name)


def done(events, rid) -> ev.Done:
    (found,) = [e for e in events if isinstance(e, ev.Done) and e.id == rid]
    return found


def run(engine, *requests) -> None:
    for request in requests:
        engine.submit(request)
    engine.run_until_idle()


def test_the_client_key_names_a_soft_session_and_an_explicit_session_wins():
    assert client_session(None, [("claude-code", None), ("claude-code", "0b5c-11")]) == ("claude-code:0b5c-11", True)
    assert client_session("mine", [("claude-code", "0b5c-11")]) == ("mine", False)
    assert client_session(None, [("codex", "")]) == (None, False)
    odd = soft_session_name("codex", "a key with spaces/and slashes")
    assert odd.startswith("codex:sha256-") and len(odd) == len("codex:sha256-") + 40


def test_turn_two_extends_the_soft_session_and_executes_only_its_suffix(tokenizer):
    engine, events = engine_for(tokenizer)
    run(engine, soft("t1", PROMPT))
    session = engine.sessions.named["claude-code:abc"]
    assert session.soft and not engine.sessions.anonymous
    turn_two = PROMPT + tuple(done(events, "t1").generated_ids) + (300, 301)
    run(engine, soft("t2", turn_two))
    assert done(events, "t2").cached_tokens == len(PROMPT) + 3  # all but the last generated id had K/V


def test_a_busy_soft_session_does_not_hold_up_a_second_request(tokenizer):
    engine, events = engine_for(tokenizer, max_sessions=3)
    engine.submit(soft("main", PROMPT, max_tokens=12))
    engine.submit(soft("side", (7, 8, 9)))  # Claude Code's side call, same key, at the same time
    stats: list = []
    engine.call(stats.append)
    engine._drain(block=False)
    assert stats[0]["running"] == 2  # it runs now, anonymously, rather than waiting
    engine.run_until_idle()
    assert not [e for e in events if isinstance(e, ev.Failed)]
    assert engine.sessions.named["claude-code:abc"].tokens[: len(PROMPT)] == list(PROMPT)


def test_a_shorter_other_conversation_runs_anonymously_and_leaves_the_session_alone(tokenizer):
    engine, events = engine_for(tokenizer)
    run(engine, soft("main", PROMPT))
    kept = list(engine.sessions.named["claude-code:abc"].tokens)
    run(engine, soft("side", (7, 8, 9, 10)))
    assert engine.sessions.named["claude-code:abc"].tokens == kept
    turn_two = PROMPT + tuple(done(events, "main").generated_ids) + (300,)
    run(engine, soft("t2", turn_two))
    assert done(events, "t2").cached_tokens == len(PROMPT) + 3
    longer = tuple(range(500, 540))  # a longer conversation under the same key takes the session over
    run(engine, soft("new", longer))
    assert engine.sessions.named["claude-code:abc"].tokens[:40] == list(longer)


def test_idle_soft_sessions_are_evicted_first_without_evict_idle_sessions(tokenizer):
    engine, events = engine_for(tokenizer, max_sessions=2, evict_idle_sessions=False)
    run(engine, soft("a", PROMPT, name="claude-code:a"), soft("b", PROMPT, name="claude-code:b"))
    run(engine, hard("named", (1, 2, 3), "mine"))  # a new named session takes the LRU soft slot
    assert set(engine.sessions.named) == {"claude-code:b", "mine"}
    run(engine, soft("c", PROMPT, name="claude-code:c"))
    assert set(engine.sessions.named) == {"claude-code:c", "mine"}
    assert not [e for e in events if isinstance(e, ev.Failed)]


def test_a_soft_request_finding_every_slot_busy_waits_for_one_rather_than_failing(tokenizer):
    engine, events = engine_for(tokenizer, max_sessions=2)
    run(engine, hard("h", (1, 2, 3), "resident"))  # persists: its slot never frees on its own
    engine.submit(PreparedRequest(id="long", prompt_ids=(4, 5, 6), max_tokens=16, ignore_eos=True, sampling=GREEDY))
    engine.submit(soft("s", PROMPT))  # no slot now: it waits for the anonymous request's, never a 503
    engine.run_until_idle()
    assert not [e for e in events if isinstance(e, ev.Failed)]
    assert done(events, "s").completion_tokens == 4
    assert engine.sessions.named["claude-code:abc"].soft  # the slot freed in time for its session


def test_soft_sessions_idle_out(tokenizer):
    engine, _ = engine_for(tokenizer, soft_session_idle_timeout=30.0)
    run(engine, soft("a", PROMPT), hard("h", (1, 2, 3), "resident"))
    session = engine.sessions.named["claude-code:abc"]
    assert engine.sessions.expire_idle(now=session.last_used + 31) == 1
    assert set(engine.sessions.named) == {"resident"}  # named sessions persist (no --session-idle-timeout)


def test_an_x_session_id_that_its_affinity_header_repeats_is_a_client_key_not_a_named_session():
    from musegl_core.service.sessions import explicit_header_session, header_keys

    opencode = {"x-session-id": "ses_abc", "x-session-affinity": "ses_abc"}
    assert explicit_header_session(opencode) is None
    assert client_session(explicit_header_session(opencode), header_keys(opencode)) == ("opencode:ses_abc", True)
    assert explicit_header_session({"x-session-id": "mine"}) == "mine"
    # an affinity header with another value leaves the named session as it is
    assert explicit_header_session({"x-session-id": "mine", "x-session-affinity": "other"}) == "mine"

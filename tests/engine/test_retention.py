"""Retention a client asks for (issue 45 item 5): each value maps to a residency the engine
honours (engine/retention.py, service/retention.py, docs/sessions.md "Retention")."""

from __future__ import annotations

import pytest

from musegl_core.engine import events as ev
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.engine.retention import RESIDENCIES, idle_timeout
from musegl_core.errors import ApiError
from musegl_core.service import retention as sr
from musegl_core.testing.engine_runs import example_engine

PROMPT = tuple(range(100, 124))


def engine_for(tokenizer, **config):
    settings = dict(max_context=128, max_sessions=2, max_inflight_requests=4, max_decode_sequences=8,
                    soft_session_idle_timeout=30.0)
    return example_engine(tokenizer, **{**settings, **config})


def soft(rid: str, prompt, name: str, retention: str | None = None) -> PreparedRequest:
    return PreparedRequest(id=rid, prompt_ids=prompt, max_tokens=4, ignore_eos=True, sampling=GREEDY,
                           session_id=name, soft_session=True, retention=retention)


def run(engine, *requests) -> None:
    for request in requests:
        engine.submit(request)
    engine.run_until_idle()


def test_the_residencies():
    assert {name: (r.seconds, r.write_through) for name, r in RESIDENCIES.items()} == {
        "5m": (300.0, False), "1h": (3600.0, True), "24h": (86400.0, True)}
    assert idle_timeout(600.0, "5m") == 600.0  # the default soft timeout already keeps 5 minutes
    assert idle_timeout(600.0, "1h") == 3600.0
    assert idle_timeout(None, "1h") is None  # a named session without a timeout persists anyway
    assert idle_timeout(30.0, None) == 30.0


def test_a_retained_soft_session_outlives_its_idle_timeout_then_expires(tokenizer):
    engine, _ = engine_for(tokenizer)
    run(engine, soft("a", PROMPT, "claude-code:plain"), soft("b", PROMPT[::-1], "claude-code:kept", "1h"))
    plain, kept = engine.sessions.named["claude-code:plain"], engine.sessions.named["claude-code:kept"]
    assert kept.retention == "1h" and plain.retention is None
    now = max(plain.last_used, kept.last_used)
    assert engine.sessions.expire_idle(now=now + 31) == 1  # --soft-session-idle-timeout 30: the plain one
    assert list(engine.sessions.named) == ["claude-code:kept"]
    assert engine.sessions.expire_idle(now=now + 3599) == 0
    assert engine.sessions.expire_idle(now=now + 3601) == 1


def test_a_later_request_without_a_retention_keeps_the_sessions_own(tokenizer):
    engine, events = engine_for(tokenizer)
    run(engine, soft("a", PROMPT, "claude-code:k", "1h"))
    run(engine, soft("b", PROMPT + (7, 8, 9, 10) + tuple(range(200, 210)), "claude-code:k"))
    assert [e.id for e in events if isinstance(e, ev.Done)] == ["a", "b"]
    assert engine.sessions.named["claude-code:k"].retention == "1h"
    run(engine, soft("c", PROMPT + (7, 8, 9, 10) + tuple(range(200, 240)), "claude-code:k", "5m"))
    assert engine.sessions.named["claude-code:k"].retention == "5m"  # the latest ask sets it


def test_a_retained_idle_session_is_evicted_after_those_without_one(tokenizer):
    engine, _ = engine_for(tokenizer)
    run(engine, soft("a", PROMPT, "claude-code:kept", "1h"))
    run(engine, soft("b", PROMPT[::-1], "claude-code:plain"))  # used later: LRU alone would evict "kept"
    run(engine, soft("c", tuple(range(300, 330)), "claude-code:new"))  # needs a slot (2 slots)
    assert set(engine.sessions.named) == {"claude-code:kept", "claude-code:new"}


def test_once_the_retention_ran_out_lru_decides_again(tokenizer):
    engine, _ = engine_for(tokenizer)
    run(engine, soft("a", PROMPT, "claude-code:kept", "5m"))
    run(engine, soft("b", PROMPT[::-1], "claude-code:plain"))
    engine.sessions.named["claude-code:kept"].last_used -= 301  # its 5 minutes are over
    engine.sessions.named["claude-code:plain"].last_used -= 1
    run(engine, soft("c", tuple(range(300, 330)), "claude-code:new"))
    assert set(engine.sessions.named) == {"claude-code:plain", "claude-code:new"}


# -- the API values -------------------------------------------------------------------------

def test_openai_values_map_to_residencies_and_24h_needs_the_disk_tier():
    assert sr.openai_retention(None) is None
    assert sr.openai_retention("in_memory") == sr.openai_retention("in-memory") == "5m"
    assert sr.openai_retention("24h") == "24h"
    with pytest.raises(ApiError) as bad:
        sr.openai_retention("1h")
    assert bad.value.status == 400 and bad.value.param == "prompt_cache_retention"
    assert sr.granted("24h", disk_tier=True) == "24h"
    assert sr.granted("24h", disk_tier=False) == "5m"
    assert sr.openai_name(sr.granted("24h", disk_tier=False)) == "in_memory"
    assert sr.retention_header("5m") == {"X-Prompt-Cache-Retention": "in_memory"}
    assert sr.retention_header(None) == {}
    assert sr.retention_header("1h", words=str) == {"X-Prompt-Cache-Retention": "1h"}


def test_anthropic_ttls_the_longest_wins():
    assert sr.anthropic_ttl([]) is None
    assert sr.anthropic_ttl([(None, "system[0].cache_control")]) is None
    assert sr.anthropic_ttl([({"type": "ephemeral"}, "a")]) == "5m"
    assert sr.anthropic_ttl([({"type": "ephemeral", "ttl": "1h"}, "a"), ({"type": "ephemeral"}, "b")]) == "1h"
    assert sr.anthropic_ttl([({"type": "ephemeral", "scope": "global"}, "a")]) == "5m"  # Claude Code's
    for value, param in (({"type": "ephemeral", "ttl": "2h"}, "x.ttl"), ({"type": "persistent"}, "x.type"),
                         ({"type": "ephemeral", "scope": 1}, "x.scope"), ({"type": "ephemeral", "x": 1}, "x.x"),
                         ("5m", "x")):
        with pytest.raises(ApiError) as bad:
            sr.anthropic_ttl([(value, "x")])
        assert bad.value.status == 400 and bad.value.param == param

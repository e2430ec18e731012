"""Blocks on demand (docs/engine.md "KV memory"): idle sessions hold only the blocks
their positions fill, a running request reserves what it may still take to its end
(so it always finishes), and a request the pool cannot hold waits for running
requests or makes room from idle sessions, else fails naming the numbers."""

from __future__ import annotations

import attrs

from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.errors import NoSessionSlot
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.testing.example_executor import ExampleExecutor


def engine_for(tokenizer, **config):
    events: list = []
    settings = dict(max_context=64, max_sessions=64, max_inflight_requests=4, max_decode_sequences=4)
    executor = ExampleExecutor(tokenizer.vocab_size)
    engine = Engine(executor, tokenizer, EngineConfig(**{**settings, **config}), events.append)
    return engine, events


def request(rid: str, prompt: tuple[int, ...], session: str | None = None, max_tokens: int = 4) -> PreparedRequest:
    return PreparedRequest(id=rid, prompt_ids=prompt, max_tokens=max_tokens, ignore_eos=True, sampling=GREEDY,
                           session_id=session, stream=True)


def of(events, kind, rid=None):
    return [e for e in events if isinstance(e, kind) and (rid is None or e.id == rid)]


def prompt_of(i: int, length: int = 12) -> tuple[int, ...]:
    return tuple(1000 + 97 * i + j for j in range(length))


def test_idle_sessions_hold_only_what_they_filled_and_outnumber_max_context_slots(tokenizer):
    # 40 blocks of 4 positions hold two sessions of --max-context 64 (16 blocks each), but each of
    # these sessions fills 12 + 4 - 1 = 15 positions: 4 blocks, so nine of them stay resident.
    engine, events = engine_for(tokenizer, kv_blocks=40, prefix_caching=False)
    for i in range(9):
        engine.submit(request(f"r{i}", prompt_of(i), session=f"s{i}"))
        engine.run_until_idle()
    assert not of(events, ev.Failed)
    assert engine.pool.reserved_blocks == 0  # nothing runs: nothing is reserved
    assert engine.pool.used_blocks == 9 * 4
    assert all(len(s.slot.blocks) == 4 and s.slot.reserved == 0 for s in engine.sessions.named.values())
    # a session's next turn reuses its whole history (and grows by the blocks it fills: two here)
    for i in range(2):
        history = prompt_of(i) + tuple(of(events, ev.Done, f"r{i}")[0].generated_ids)
        engine.submit(request(f"t{i}", history + (5,), session=f"s{i}"))
        engine.run_until_idle()
        assert of(events, ev.Done, f"t{i}")[0].cached_tokens == len(history) - 1


def test_a_running_request_reserves_to_its_end_and_gives_the_rest_back(tokenizer):
    engine, events = engine_for(tokenizer, kv_blocks=40)
    engine.submit(request("r", prompt_of(0), max_tokens=20))
    seen: list = []
    engine.call(seen.append)
    engine._drain(block=False)
    # 12 + 20 positions: 8 blocks reserved or held (plus none to copy: nothing shared)
    assert seen[0]["kv_blocks_used"] + seen[0]["kv_blocks_reserved"] == 8
    engine.run_until_idle()
    assert engine.pool.reserved_blocks == 0 and engine.pool.used_blocks == 0  # anonymous: all back


def test_a_request_waits_for_blocks_a_running_one_gives_back(tokenizer):
    # 17 blocks: one --max-context request (16) and one block to copy; two 40-token requests do not fit
    # together (10 + 10 blocks), so the second waits for the first and both finish.
    engine, events = engine_for(tokenizer, kv_blocks=17, prefix_caching=False)
    engine.submit(request("a", prompt_of(1, 20), max_tokens=20))
    engine.submit(request("b", prompt_of(2, 20), max_tokens=20))
    seen: list = []
    engine.call(seen.append)
    engine._drain(block=False)
    assert (seen[0]["running"], seen[0]["waiting"]) == (1, 1)
    engine.run_until_idle()
    assert not of(events, ev.Failed) and len(of(events, ev.Done)) == 2


def test_a_full_pool_makes_room_from_idle_sessions_or_fails_naming_the_numbers(tokenizer):
    # Named sessions persist: once they fill the pool and nothing runs, a new request fails (503).
    engine, events = engine_for(tokenizer, kv_blocks=17, prefix_caching=False)
    for i in range(4):
        engine.submit(request(f"r{i}", prompt_of(i), session=f"s{i}"))
        engine.run_until_idle()
    assert engine.pool.used_blocks == 16 and not of(events, ev.Failed)
    engine.submit(request("new", prompt_of(9)))
    engine.run_until_idle()
    failed = of(events, ev.Failed, "new")
    assert failed and isinstance(failed[0].error, NoSessionSlot)
    reason = failed[0].error.reason
    assert "KV cache is full" in reason and "1 of 17 are free" in reason and "idle named sessions hold 16" in reason
    assert "--evict-idle-sessions" in reason
    # With --evict-idle-sessions the least recently used idle sessions give way, no more than needed.
    engine, events = engine_for(tokenizer, kv_blocks=17, prefix_caching=False, evict_idle_sessions=True)
    for i in range(4):
        engine.submit(request(f"r{i}", prompt_of(i), session=f"s{i}"))
        engine.run_until_idle()
    engine.submit(request("new", prompt_of(9)))  # 4 blocks: three more than the free one
    engine.run_until_idle()
    assert not of(events, ev.Failed) and of(events, ev.Done, "new")
    assert sorted(engine.sessions.named) == ["s1", "s2", "s3"] and engine.sessions.evictions == 1


def test_soft_sessions_and_snapshots_give_way_before_named_ones(tokenizer):
    engine, events = engine_for(tokenizer, kv_blocks=18, prefix_caching=False, prefix_cache_entries=1,
                                evict_idle_sessions=True)
    engine.submit(request("named", prompt_of(0), session="keep"))
    engine.run_until_idle()
    soft = attrs.evolve(request("soft", prompt_of(1), session="soft"), soft_session=True)
    engine.submit(soft)
    engine.run_until_idle()
    assert set(engine.sessions.named) == {"keep", "soft"} and len(engine.sessions.snapshots) == 1
    engine.submit(request("big", prompt_of(2, 40), max_tokens=10))  # 13 blocks (+1 for the snapshot's copy)
    engine.run_until_idle()
    assert not of(events, ev.Failed)
    assert set(engine.sessions.named) == {"keep"}  # the soft session and the snapshot made room

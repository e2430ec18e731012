"""The host tier (``--kv-offload-memory``, engine/kv_host.py) over the torch executor on the CPU:
named sessions under device-pool pressure move down to host pages and come back when they
return, and every answer is greedy-identical to the same requests on a server whose pool holds
everything, with the same positions reused (restored, never recomputed); with sliding pages too."""

from __future__ import annotations

import pytest

from engine_run_support import tier_engine
from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.errors import ConfigError
from musegl_core.testing.engine_runs import done, ids

BLOCK = 4


def engine_for(checkpoint, tokenizer, *, blocks: int, host: int | None, sliding: bool = False,
               snapshots: int = 0, **more) -> tuple[Engine, list]:
    return tier_engine(checkpoint, tokenizer, blocks=blocks, host=host, block_size=BLOCK, sliding_window_kv=sliding,
                       prefix_cache_entries=snapshots, **more)


def agents(engine: Engine, events: list) -> dict[str, tuple[list[int], int]]:
    """Three named sessions taking turns (each turn extends its session's history), a rewind of
    the first to its first turn, and two sessions running side by side: per request, the ids
    generated and the positions reused."""
    out: dict[str, tuple[list[int], int]] = {}
    histories = {name: ids(seed, 40) for seed, name in enumerate(("a", "b", "c"))}

    def run(*requests: tuple[str, str, list[int]]) -> None:
        for rid, session, prompt in requests:
            engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(prompt), max_tokens=8, ignore_eos=True,
                                          sampling=GREEDY, session_id=session, stream=True))
        engine.run_until_idle()
        for rid, session, _ in requests:
            result = done(events, rid)
            out[rid] = (list(result.generated_ids), result.cached_tokens)

    for turn in range(3):
        for name in ("a", "b", "c"):
            rid = f"{name}{turn}"
            run((rid, name, histories[name]))
            histories[name] = histories[name] + out[rid][0] + ids(100 + turn, 9)
    run(("rewind", "a", histories["a"][:44] + ids(7, 5)))  # back into a's first turn
    run(("b3", "b", histories["b"]), ("c3", "c", histories["c"]))
    return out


def test_sessions_moved_to_the_host_tier_answer_as_on_an_unconstrained_server(checkpoint, tokenizer):
    roomy, roomy_events = engine_for(checkpoint, tokenizer, blocks=400, host=0)
    tight, tight_events = engine_for(checkpoint, tokenizer, blocks=32, host=1 << 20)
    assert roomy.host is None and tight.host is not None
    expected = agents(roomy, roomy_events)
    got = agents(tight, tight_events)
    assert got == expected  # the same ids, and the same positions reused
    assert all(cached > 40 for rid, (_, cached) in expected.items() if rid[-1] in "123")
    assert expected["rewind"][1] == 44
    stats = tight.stats()
    assert stats["kv_host_offloads"] >= 8 and stats["kv_restores"] >= 8
    assert stats["kv_tier_hits_host"] >= 8 and stats["kv_tier_hit_tokens_host"] > 8 * 40
    assert roomy.stats()["kv_tier_hits_host"] == 0


def concurrent(engine: Engine, events: list, *, sessions: bool = False) -> dict[str, list[int]]:
    """Four requests at once sharing a 16-token system prefix, each reaching 48 positions (12
    blocks of 4): in a 24-block pool they start together (blocks on demand) and the last admitted
    are suspended to the host tier as they grow. Per request, the ids generated."""
    system = ids(31, 16)
    requests = [PreparedRequest(id=f"r{i}", prompt_ids=tuple(system + ids(40 + i, 12)), max_tokens=20,
                                ignore_eos=True, sampling=GREEDY, session_id=f"s{i}" if sessions else None,
                                stream=True) for i in range(4)]
    for request in requests:
        engine.submit(request)
    engine.run_until_idle()
    return {r.id: list(done(events, r.id).generated_ids) for r in requests}


def test_running_requests_suspended_to_the_host_tier_answer_as_on_an_unconstrained_server(checkpoint, tokenizer):
    roomy, roomy_events = engine_for(checkpoint, tokenizer, blocks=400, host=0)
    tight, tight_events = engine_for(checkpoint, tokenizer, blocks=24, host=1 << 20)
    assert roomy.on_demand is None and tight.on_demand is not None
    expected = concurrent(roomy, roomy_events)
    assert concurrent(tight, tight_events) == expected
    stats = tight.stats()
    assert stats["kv_suspended"] >= 1 and stats["kv_resumed"] == stats["kv_suspended"]
    assert stats["kv_requests_suspended"] == 0
    assert not [e for e in tight_events if isinstance(e, ev.Failed)]
    assert tight.pool.reserved_blocks == 0


@pytest.mark.slow
def test_running_requests_with_sliding_pages_suspended_and_resumed(checkpoint, tokenizer):
    roomy, roomy_events = engine_for(checkpoint, tokenizer, blocks=400, host=0, sliding=True)
    tight, tight_events = engine_for(checkpoint, tokenizer, blocks=20, host=1 << 20, sliding=True)
    assert tight.pool.companions == 2
    assert concurrent(tight, tight_events, sessions=True) == concurrent(roomy, roomy_events, sessions=True)
    assert tight.stats()["kv_suspended"] >= 1


@pytest.mark.slow
def test_without_a_host_tier_the_same_pressure_loses_sessions(checkpoint, tokenizer):
    """The control: the tight pool alone cannot keep the three sessions (a returning one
    re-prefills or is refused), so the host tier is what kept them above."""
    tight, events = engine_for(checkpoint, tokenizer, blocks=32, host=0, evict_idle_sessions=True)
    out = agents(tight, events)
    assert any(cached == 0 for rid, (_, cached) in out.items() if rid[-1] in "123")


@pytest.mark.slow
def test_sliding_pages_move_down_and_back_too(checkpoint, tokenizer):
    # (the roomy engine has a host tier too: its rewind past the window restores the sliding pages
    # from there, as the tight one's does, so both report the same cached positions)
    roomy, roomy_events = engine_for(checkpoint, tokenizer, blocks=400, host=1 << 20, sliding=True)
    # 26 blocks (78 pages): the longest request may reach 75; running requests take blocks on demand,
    # so idle sessions move down only when the pool is this tight
    tight, tight_events = engine_for(checkpoint, tokenizer, blocks=26, host=1 << 20, sliding=True)
    assert tight.pool.companions == 2
    assert agents(tight, tight_events) == agents(roomy, roomy_events)
    assert tight.stats()["kv_restores"] >= 2  # (a session's sliding pages are few: less pressure)


@pytest.mark.slow
def test_snapshots_and_the_prefix_cache_move_down_and_come_back(checkpoint, tokenizer):
    """Anonymous requests sharing a system prefix: the prefix cache's blocks and the snapshots
    the pool evicts go to the host tier, and a later request with the prefix reuses them."""
    system = ids(11, 48)

    def run(engine, events):
        out = {}
        for i in range(6):
            rid = f"q{i}"
            engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(system + ids(20 + i, 30)), max_tokens=6,
                                          ignore_eos=True, sampling=GREEDY))
            other = f"x{i}"  # an unrelated prompt that pushes the system prefix out of the pool
            engine.submit(PreparedRequest(id=other, prompt_ids=tuple(ids(40 + i, 90)), max_tokens=6,
                                          ignore_eos=True, sampling=GREEDY))
            engine.run_until_idle()
            out[rid] = (list(done(events, rid).generated_ids), done(events, rid).cached_tokens)
            out[other] = list(done(events, other).generated_ids)
        return out

    roomy, roomy_events = engine_for(checkpoint, tokenizer, blocks=400, host=0, snapshots=1)
    tight, tight_events = engine_for(checkpoint, tokenizer, blocks=30, host=1 << 20, snapshots=1)
    expected = run(roomy, roomy_events)
    assert run(tight, tight_events) == expected
    assert all(expected[f"q{i}"][1] >= 48 for i in range(1, 6))
    assert tight.stats()["kv_tier_hits_host"] >= 1


def test_a_host_tier_asked_of_an_executor_without_host_copies_is_refused(tokenizer):
    from musegl_core.testing.example_executor import ExampleExecutor

    with pytest.raises(ConfigError, match="--kv-offload-memory: .* cannot copy KV pages to host memory"):
        Engine(ExampleExecutor(512), tokenizer, EngineConfig(kv_offload_memory=1 << 20), lambda e: None)
    engine = Engine(ExampleExecutor(512), tokenizer, EngineConfig(), lambda e: None)  # default: off, said once
    assert engine.host is None

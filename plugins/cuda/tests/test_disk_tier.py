"""The disk tier (``--kv-offload-dir``, ``--kv-offload-disk``; engine/kv_disk.py) under the host tier,
over the torch executor on the CPU: blocks the host tier lets go of, and the blocks of requests that
asked for a long retention, go to files; after a restart of the worker (a new executor and engine on
the same directory) a returning conversation reads them back through the host tier to the device,
counted as cached tokens, and every answer is greedy-identical to the same requests on an
unconstrained server. Another KV format finds nothing; a damaged file is a miss."""

from __future__ import annotations

import logging

import pytest

from engine_run_support import tier_engine
from musegl_core.engine.engine import Engine
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.errors import ConfigError
from musegl_core.testing.engine_runs import done, ids
from musegl_cuda.executor import TorchExecutor

BLOCK = 4


def engine_for(checkpoint, tokenizer, *, blocks: int = 400, host: int | None = 0, disk=None,
               dtype: str = "float32", **more) -> tuple[Engine, list]:
    return tier_engine(checkpoint, tokenizer, blocks=blocks, host=host, disk=disk, dtype=dtype, block_size=BLOCK,
                       **more)


def run(engine: Engine, events: list, rid: str, prompt: list[int], session: str | None = None,
        retention: str | None = None) -> tuple[list[int], int]:
    engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(prompt), max_tokens=8, ignore_eos=True, sampling=GREEDY,
                                  session_id=session, stream=True, retention=retention))
    engine.run_until_idle()
    found = done(events, rid)
    return list(found.generated_ids), found.cached_tokens


def conversation(engine: Engine, events: list, retention: str | None, turns: range, history: dict) -> dict:
    """Turns of the sessions named in ``history``, which carries their prompts over (across engines)."""
    out = {}
    for turn in turns:
        for name in history:
            rid = f"{name}{turn}"
            out[rid] = run(engine, events, rid, history[name], session=name, retention=retention)
            history[name] = history[name] + out[rid][0] + ids(100 + turn, 9)
    return out


def reference(checkpoint, tokenizer, turns: int, names: str = "ab") -> dict:
    roomy, events = engine_for(checkpoint, tokenizer)
    history = {name: ids(seed, 40) for seed, name in enumerate(names)}
    return conversation(roomy, events, None, range(turns), history)


def test_a_conversation_asking_24h_survives_a_restart_of_the_worker(checkpoint, tokenizer, tmp_path):
    expected = reference(checkpoint, tokenizer, 4)
    history = {name: ids(seed, 40) for seed, name in enumerate(("a", "b"))}
    first, events = engine_for(checkpoint, tokenizer, host=None, disk=tmp_path)
    before = conversation(first, events, "24h", range(2), history)
    written = first.stats()["kv_disk_blocks"]
    assert written > 0  # written through at the end of every request
    del first
    second, events = engine_for(checkpoint, tokenizer, host=None, disk=tmp_path)  # a new worker
    assert second.stats()["kv_disk_blocks"] == written
    after = conversation(second, events, "24h", range(2, 4), history)
    got = {**before, **after}
    assert {rid: g for rid, (g, _) in got.items()} == {rid: g for rid, (g, _) in expected.items()}
    for rid in ("a2", "b2"):  # the new worker's first turns: their history came back from disk
        assert got[rid][1] >= expected[rid][1] - BLOCK and got[rid][1] > 40
    stats = second.stats()
    assert stats["kv_tier_hits_disk"] >= 2 and stats["kv_tier_hit_tokens_disk"] > 80


def test_without_a_retention_blocks_reach_the_disk_when_the_host_tier_lets_go(checkpoint, tokenizer, tmp_path):
    expected = reference(checkpoint, tokenizer, 3, "abc")
    history = {name: ids(seed, 40) for seed, name in enumerate("abc")}
    # a device pool of about one session and a host tier of 4 blocks: an idle session that the host tier
    # cannot take is evicted, its cached blocks pass through the host tier to the disk, and come back
    block = TorchExecutor(checkpoint, device="cpu", dtype="float32", block_size=BLOCK).kv_bytes_per_block()
    tight, events = engine_for(checkpoint, tokenizer, blocks=40, host=4 * block, disk=tmp_path,
                               evict_idle_sessions=True)
    got = conversation(tight, events, None, range(3), history)
    assert {rid: g for rid, (g, _) in got.items()} == {rid: g for rid, (g, _) in expected.items()}
    stats = tight.stats()
    assert stats["kv_disk_blocks"] > 0 and stats["kv_tier_hit_tokens_disk"] > 0


def test_another_kv_format_finds_nothing_and_says_so(checkpoint, tokenizer, tmp_path, caplog):
    history = {name: ids(seed, 40) for seed, name in enumerate(("a", "b"))}
    first, events = engine_for(checkpoint, tokenizer, host=None, disk=tmp_path)
    conversation(first, events, "24h", range(1), history)
    with caplog.at_level(logging.INFO, logger="musegl.kv_disk"):
        other, events = engine_for(checkpoint, tokenizer, host=None, disk=tmp_path, dtype="bfloat16")
    assert "found 0 blocks of this model and KV format" in caplog.text
    assert "of another model or KV format" in caplog.text and "float32" in caplog.text
    _, cached = run(other, events, "x", history["a"], session="a")
    assert cached == 0 and other.stats()["kv_tier_hit_tokens_disk"] == 0


def test_a_damaged_block_file_is_recomputed_never_misread(checkpoint, tokenizer, tmp_path):
    expected = reference(checkpoint, tokenizer, 2)
    history = {name: ids(seed, 40) for seed, name in enumerate(("a", "b"))}
    first, events = engine_for(checkpoint, tokenizer, host=None, disk=tmp_path)
    before = conversation(first, events, "24h", range(1), history)
    for path in sorted(tmp_path.rglob("*.kv"))[::2]:  # every other block file loses its tail
        path.write_bytes(path.read_bytes()[:-7])
    second, events = engine_for(checkpoint, tokenizer, host=None, disk=tmp_path)
    after = conversation(second, events, "24h", range(1, 2), history)
    got = {**before, **after}
    assert {rid: g for rid, (g, _) in got.items()} == {rid: g for rid, (g, _) in expected.items()}
    assert second.stats()["kv_disk_corrupt_blocks"] >= 1


def test_the_disk_tier_needs_the_host_tier(checkpoint, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="--kv-offload-dir"):
        engine_for(checkpoint, tokenizer, host=0, disk=tmp_path)


def test_an_idle_soft_session_moves_down_the_tiers_instead_of_closing(checkpoint, tokenizer, tmp_path):
    expected = reference(checkpoint, tokenizer, 2, "a")
    history = {"a": ids(0, 40)}
    engine, events = engine_for(checkpoint, tokenizer, host=None, disk=tmp_path, soft_session_idle_timeout=30.0)

    def soft(rid: str) -> tuple[list[int], int]:
        engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(history["a"]), max_tokens=8, ignore_eos=True,
                                      sampling=GREEDY, session_id="claude-code:a", soft_session=True, stream=True))
        engine.run_until_idle()
        found = done(events, rid)
        return list(found.generated_ids), found.cached_tokens

    first = soft("a0")
    history["a"] = history["a"] + first[0] + ids(100, 9)
    session = engine.sessions.named["claude-code:a"]
    assert engine.sessions.expire_idle(now=session.last_used + 31) == 0  # not closed:
    assert session.host and not session.slot.blocks  # its blocks went down to the host tier
    assert engine.sessions.expire_idle(now=session.last_used + 62) == 0  # and stay there
    second = soft("a1")
    assert [first[0], second[0]] == [expected["a0"][0], expected["a1"][0]]
    assert second[1] == expected["a1"][1] > 40  # restored, not recomputed
    stats = engine.stats()
    assert stats["sessions_moved_down"] == 1 and stats["kv_tier_hit_tokens_host"] >= 40
    engine.sessions.drop(engine.sessions.named["claude-code:a"])  # closed at last (a slot was needed, say):
    assert engine.sessions.host_cached  # its keyed blocks stay in the host tier's cache, then go to disk


def test_only_a_retention_that_asks_for_it_writes_through(checkpoint, tokenizer, tmp_path):
    engine, events = engine_for(checkpoint, tokenizer, host=None, disk=tmp_path)
    run(engine, events, "plain", ids(1, 40))  # anonymous, no retention, no pressure: nothing reaches the disk
    run(engine, events, "5m", ids(2, 40), retention="5m")
    assert engine.stats()["kv_disk_blocks"] == 0
    run(engine, events, "1h", ids(3, 40), retention="1h")  # anonymous: its blocks are written through
    stats = engine.stats()
    assert stats["kv_disk_blocks"] == 40 // BLOCK + 1 and stats["kv_disk_retained_blocks"] == stats["kv_disk_blocks"]

"""The host tier (``--kv-offload-memory``, engine/kv_host.py, docs/engine.md "The host tier"):
the engine's bookkeeping over an executor that copies pages to host memory. The example
executor's "model" reads its cache cells (a context hash per position), so a block restored
wrong, or a position recomputed where it should have been restored, changes the output or the
cached count. The torch executor's copies are proven in plugins/cuda/tests/test_host_tier.py."""

from __future__ import annotations

import numpy as np
import pytest

from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.errors import NoSessionSlot
from musegl_core.engine.executor import GREEDY, contract_problems
from musegl_core.engine.kv_host import HostTier, default_host_bytes, host_kv
from musegl_core.engine.kv_memory import room_line
from musegl_core.engine.request import PreparedRequest
from musegl_core.http.metrics import tier_families
from musegl_core.testing.example_executor import ExampleExecutor


class HostExampleExecutor(ExampleExecutor):
    """The example executor with host pages: one numpy row of cells per page."""

    host: np.ndarray | None = None
    copies = 0

    def allocate_host_kv(self, num_pages: int) -> None:
        self.host = np.full((num_pages, self.block_size), -1, dtype=np.int64)

    def offload_pages(self, pairs) -> None:
        b = self.block_size
        for src, dst in pairs:
            self.host[dst] = self.cells[src * b:(src + 1) * b]
            self.cells[src * b:(src + 1) * b] = -7  # the device page is free now: reading it again is wrong
            self.copies += 1

    def restore_pages(self, pairs) -> None:
        b = self.block_size
        for src, dst in pairs:
            self.cells[dst * b:(dst + 1) * b] = self.host[src]
            self.copies += 1

    def read_host_pages(self, pages) -> bytes:
        return self.host[list(pages)].tobytes()

    def write_host_pages(self, pages, data: bytes) -> None:
        self.host[list(pages)] = np.frombuffer(data, dtype=np.int64).reshape(len(pages), self.block_size)


def engine_for(tokenizer, executor=None, **config):
    events: list = []
    settings = dict(max_context=64, max_sessions=64, max_inflight_requests=4, max_decode_sequences=4)
    executor = executor or HostExampleExecutor(tokenizer.vocab_size)
    engine = Engine(executor, tokenizer, EngineConfig(**{**settings, **config}), events.append)
    return engine, events


def request(rid: str, prompt, session: str | None = None, max_tokens: int = 4) -> PreparedRequest:
    return PreparedRequest(id=rid, prompt_ids=tuple(prompt), max_tokens=max_tokens, ignore_eos=True,
                           sampling=GREEDY, session_id=session, stream=True)


def of(events, kind, rid=None):
    return [e for e in events if isinstance(e, kind) and (rid is None or e.id == rid)]


def prompt_of(i: int, length: int = 12) -> list[int]:
    return [1000 + 97 * i + j for j in range(length)]


def turns(engine, events, sessions: int, rounds: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """Named sessions taking turns, each turn extending its history; then a rewind of the first
    to inside its first turn. Per request: the ids generated and the positions reused."""
    out = {}
    history = {i: prompt_of(i) for i in range(sessions)}

    def run(rid, prompt, session):
        engine.submit(request(rid, prompt, session=session))
        engine.run_until_idle()
        done = of(events, ev.Done, rid)
        assert done, of(events, ev.Failed, rid)
        out[rid] = (tuple(done[0].generated_ids), done[0].cached_tokens)
        return list(done[0].generated_ids)

    for r in range(rounds):
        for i in range(sessions):
            history[i] = history[i] + run(f"s{i}t{r}", history[i], f"s{i}") + [7 + r, 8 + r, 9 + r]
    run("rewind", history[0][:10] + [5, 6], "s0")
    return out


def test_sessions_under_pressure_move_to_the_host_tier_and_come_back_as_if_never_gone(tokenizer):
    roomy, roomy_events = engine_for(tokenizer, kv_blocks=200, kv_offload_memory=0, prefix_caching=False)
    tight, tight_events = engine_for(tokenizer, kv_blocks=14, kv_offload_memory=1 << 20, prefix_caching=False)
    assert roomy.host is None and tight.host is not None
    expected = turns(roomy, roomy_events, sessions=4, rounds=3)
    assert turns(tight, tight_events, sessions=4, rounds=3) == expected  # same ids, same positions reused
    assert expected["s0t2"][1] > 20 and expected["rewind"][1] == 10
    stats = tight.stats()
    assert stats["kv_host_offloads"] >= 8 and stats["kv_restores"] >= 8
    assert stats["kv_tier_hits_host"] >= 8 and stats["kv_tier_hit_tokens_host"] >= 8 * 15
    assert stats["kv_tier_bytes_host"] > 0 and stats["kv_tier_capacity_bytes_host"] >= stats["kv_tier_bytes_host"]
    assert tight.pool.reserved_blocks == 0 and tight.sessions.evictions == 0  # nobody lost


def test_without_the_host_tier_the_same_pool_refuses_or_recomputes(tokenizer):
    engine, events = engine_for(tokenizer, kv_blocks=14, kv_offload_memory=0, prefix_caching=False)
    engine.submit(request("a", prompt_of(0), session="s0"))
    engine.submit(request("b", prompt_of(1), session="s1"))
    engine.submit(request("c", prompt_of(2), session="s2"))
    engine.submit(request("d", prompt_of(3), session="s3"))
    engine.run_until_idle()
    failed = of(events, ev.Failed)
    assert failed and "no host tier" in failed[0].error.reason


def test_a_full_host_tier_refuses_a_new_request_naming_both_tiers(tokenizer):
    # named sessions may not be lost (no --evict-idle-sessions): once the device pool and the
    # host tier both hold them, a request that needs more gets 503 with the numbers
    page = HostExampleExecutor(tokenizer.vocab_size).kv_bytes_per_block()
    engine, events = engine_for(tokenizer, kv_blocks=10, kv_offload_memory=8 * page, prefix_caching=False)
    for i in range(4):  # 4 blocks each: 8 host pages take two sessions
        engine.submit(request(f"r{i}", prompt_of(i), session=f"s{i}"))
        engine.run_until_idle()
    assert not of(events, ev.Failed)
    engine.submit(request("new", prompt_of(9)))
    engine.run_until_idle()
    failed = of(events, ev.Failed, "new")
    assert failed and isinstance(failed[0].error, NoSessionSlot)
    reason = failed[0].error.reason
    assert "KV cache is full" in reason and "the host tier (--kv-offload-memory) has 0 of 8 pages free" in reason
    # nothing was lost: once a client closes the two sessions on the device, the two in the host
    # tier come back warm
    assert sorted(engine.sessions.named) == ["s0", "s1", "s2", "s3"]
    assert [len(engine.sessions.named[f"s{i}"].host) for i in range(4)] == [4, 4, 0, 0]
    engine.sessions.close("s2")
    engine.sessions.close("s3")
    for i in range(2):
        engine.submit(request(f"again{i}", prompt_of(i) + [1, 2, 3, 4, 5], session=f"s{i}"))
        engine.run_until_idle()
        assert of(events, ev.Done, f"again{i}"), of(events, ev.Failed, f"again{i}")
        assert of(events, ev.Done, f"again{i}")[0].cached_tokens == 12


def test_the_prefix_cache_s_evicted_blocks_go_down_and_come_back(tokenizer):
    system = prompt_of(5, 24)
    roomy, roomy_events = engine_for(tokenizer, kv_blocks=200, kv_offload_memory=0)
    tight, tight_events = engine_for(tokenizer, kv_blocks=16, kv_offload_memory=1 << 20)
    results = []
    for engine, events in ((roomy, roomy_events), (tight, tight_events)):
        out = {}
        for i in range(4):
            for rid, prompt in ((f"q{i}", system + prompt_of(20 + i, 6)), (f"x{i}", prompt_of(40 + i, 40))):
                engine.submit(request(rid, prompt, max_tokens=3))
                engine.run_until_idle()
                done = of(events, ev.Done, rid)[0]
                out[rid] = (tuple(done.generated_ids), done.cached_tokens)
        results.append(out)
    assert results[0] == results[1]
    assert all(results[0][f"q{i}"][1] == 24 for i in range(1, 4))
    assert tight.stats()["kv_tier_hit_tokens_host"] > 0 and tight.stats()["kv_host_cached_blocks"] > 0


def test_an_executor_without_host_copies_runs_without_the_tier_and_refuses_the_flag(tokenizer, caplog):
    from musegl_core.errors import ConfigError

    with caplog.at_level("INFO", logger="musegl.engine"):
        engine, _ = engine_for(tokenizer, executor=ExampleExecutor(tokenizer.vocab_size))
    assert engine.host is None
    assert any("KV host tier: off: the 'example' executor cannot copy KV pages" in r.message for r in caplog.records)
    with pytest.raises(ConfigError, match="--kv-offload-memory: the 'example' executor cannot copy KV pages"):
        engine_for(tokenizer, executor=ExampleExecutor(tokenizer.vocab_size), kv_offload_memory=1 << 20)


def test_half_of_the_host_capability_breaks_the_contract():
    class Half(ExampleExecutor):
        def offload_pages(self, pairs) -> None:
            pass

    assert host_kv(HostExampleExecutor(64)) is not None and host_kv(Half(64)) is None
    assert any("HostKV" in p for p in contract_problems(Half(64)))
    assert not contract_problems(HostExampleExecutor(64))


def test_the_host_tier_hands_keyed_blocks_down_and_fetches_them_back():
    class Dict:  # a lower tier keeping blocks in a dict: the KVTier interface's smallest implementation
        name = "disk"

        def __init__(self):
            self.blocks = {}

        def contains(self, key):
            return key in self.blocks

        def put(self, key, data):
            self.blocks[key] = data

        def get(self, key):
            return self.blocks.get(key)

    executor = HostExampleExecutor(64)
    executor.allocate_kv(4)
    executor.allocate_host_kv(3)
    executor.cells[:] = np.arange(16)
    tier = HostTier(3, executor.block_size * 8, executor, lower=Dict())
    (moved,) = tier.offload([([2], b"k2")])
    assert tier.holds(b"k2") and tier.free_pages == 2
    tier.free([moved], hand_down=True)
    assert tier.lower.contains(b"k2") and not tier.holds(b"k2") and tier.free_pages == 3
    back = tier.fetch(b"k2", 1)
    tier.restore([(back.pages[0], 0)], 1)
    assert list(executor.cells[:4]) == [8, 9, 10, 11]


def test_the_default_size_and_the_start_up_line():
    gib = 1 << 30
    assert default_host_bytes(slot_bytes=100 * gib, available_ram=64 * gib) == 8 * gib
    assert default_host_bytes(slot_bytes=100 * gib, available_ram=16 * gib) == 4 * gib
    assert default_host_bytes(slot_bytes=1 * gib, available_ram=None) == 1 * gib
    line = room_line(device_blocks=64, block_size=16, block_bytes=4096, max_context=256, host_bytes=4096 * 160)
    assert "host tier 640.00 KiB = 2,560 positions = 10 sessions of --max-context 256" in line
    # with sliding pages a host page holds one layer group's block, as on the device: 640 pages, 22 a session
    paged = room_line(device_blocks=64, block_size=16, block_bytes=4096, max_context=256, host_bytes=4096 * 160,
                      companions=3, window=8)
    assert "host tier 640.00 KiB" in paged and "= 29 sessions of --max-context 256" in paged.split("host tier")[1]


def test_tier_metrics_carry_a_cache_source_label():
    families = {f.name: f for f in tier_families({"kv_tier_bytes_device": 10, "kv_tier_bytes_host": 20,
                                                  "kv_tier_hits_host": 3, "kv_tier_hit_tokens_device": 5})}
    assert {s.labels["cache_source"]: s.value for s in families["musegl_kv_tier_bytes"].samples} == \
        {"device": 10.0, "host": 20.0}
    assert [s.labels["cache_source"] for s in families["musegl_kv_tier_hits"].samples] == ["host"]
    assert "musegl_kv_tier_capacity_bytes" not in families


def test_the_flag_takes_a_size_or_0():
    from musegl_core.cli.serve import build_parser, config_from_args
    from musegl_core.engine.engine import EngineConfig

    parser = build_parser()

    def offload(*flags):
        config = config_from_args(parser.parse_args(list(flags)), parser).validate()
        return EngineConfig.from_serve(config).kv_offload_memory

    assert offload() is None  # the default (kv_host.default_host_bytes)
    assert offload("--kv-offload-memory", "16GiB") == 16 << 30
    assert offload("--kv-offload-memory", "0") == 0
    with pytest.raises(SystemExit):
        offload("--kv-offload-memory", "lots")

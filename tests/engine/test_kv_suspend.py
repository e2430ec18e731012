"""Blocks on demand for running requests and suspension to the host tier (engine/kv_suspend.py,
docs/engine.md "Running requests: blocks on demand, suspended to the host tier"), over the
example executor with host pages: its "model" reads every cache cell of a sequence's context, so
a block suspended or resumed wrong, or a position recomputed, changes the output. The torch
executor's copies are proven in plugins/cuda/tests/test_host_tier.py."""

from __future__ import annotations

import pytest

from musegl_core.engine import events as ev
from musegl_core.engine.errors import NoSessionSlot
from tests.engine.test_kv_host import HostExampleExecutor, engine_for, of, prompt_of, request


def run_together(engine, events, requests) -> dict[str, tuple[int, ...]]:
    """Submit every request at once, run until idle; per request the ids it generated (and the
    stream of token events, which must carry the same ids in order)."""
    for req in requests:
        engine.submit(req)
    engine.run_until_idle()
    out = {}
    for req in requests:
        done = of(events, ev.Done, req.id)
        assert done, of(events, ev.Failed, req.id)
        out[req.id] = tuple(done[0].generated_ids)
    return out


def batch(n: int, *, prompt: int = 12, max_tokens: int = 40, sessions: bool = False):
    return [request(f"r{i}", prompt_of(i, prompt), session=f"s{i}" if sessions else None, max_tokens=max_tokens)
            for i in range(n)]


def test_running_requests_suspended_and_resumed_answer_as_on_an_unconstrained_engine(tokenizer):
    # four requests of 12 + 40 positions (13 blocks of 4 each at their ends) in a pool of 24 blocks:
    # they all start (blocks on demand), and as they grow the last admitted go down to the host tier
    roomy, roomy_events = engine_for(tokenizer, kv_blocks=400, kv_offload_memory=0, prefix_caching=False)
    tight, tight_events = engine_for(tokenizer, kv_blocks=24, kv_offload_memory=1 << 20, prefix_caching=False)
    assert roomy.on_demand is None and tight.on_demand is not None
    expected = run_together(roomy, roomy_events, batch(4))
    got = run_together(tight, tight_events, batch(4))
    assert got == expected
    assert not of(tight_events, ev.Failed)
    stats = tight.stats()
    assert stats["kv_suspended"] >= 1 and stats["kv_resumed"] == stats["kv_suspended"]
    assert stats["kv_suspended_blocks"] >= 1 and stats["kv_resumed_blocks"] == stats["kv_suspended_blocks"]
    assert stats["kv_requests_suspended"] == 0 and stats["kv_pages_committed"] == 0
    # every request was admitted at once (nothing waited for a reservation), and nothing is left
    assert all(e.cached_tokens == 0 for e in of(tight_events, ev.Admitted))
    assert tight.pool.reserved_blocks == 0 and tight.pool.used_blocks == 0
    assert tight.host.used_pages == 0
    # the streams paused, never broke: each request's token events carry its ids in order
    for rid, ids in got.items():
        streamed = [t for e in of(tight_events, ev.Tokens, rid) for t in e.ids]
        assert tuple(streamed) == ids[: len(streamed)] and len(streamed) >= len(ids) - 4


def test_the_last_admitted_is_suspended_first_and_resumed_last(tokenizer):
    engine, events = engine_for(tokenizer, kv_blocks=24, kv_offload_memory=1 << 20, prefix_caching=False,
                                max_inflight_requests=3, max_decode_sequences=3, max_context=128)
    suspended: list[str] = []
    original = engine.on_demand._suspend

    def watch(seq, short):
        suspended.append(seq.id)
        original(seq, short)

    engine.on_demand._suspend = watch
    done_order = []
    for req in batch(3, max_tokens=60):
        engine.submit(req)

    def check() -> None:
        for seq in engine.scheduler.running:  # the first admitted is never the one suspended
            assert seq.id != "r0" or not engine.on_demand.is_suspended(seq)
        done_order.extend(e.id for e in events if isinstance(e, ev.Done) and e.id not in done_order)

    engine.run_until_idle(after_step=check)
    assert suspended and "r0" not in suspended and suspended[0] == "r2"
    assert done_order[0] == "r0" and not of(events, ev.Failed)


def test_many_requests_beyond_the_device_all_finish_when_device_plus_host_holds_them(tokenizer):
    # twelve requests that reach 10 blocks each (120) in 20 device blocks and 120 host pages:
    # the guarantee counts device plus host, so each is admitted and each finishes
    roomy, roomy_events = engine_for(tokenizer, kv_blocks=400, kv_offload_memory=0, prefix_caching=False,
                                     max_inflight_requests=12, max_decode_sequences=12)
    page = HostExampleExecutor(tokenizer.vocab_size).kv_bytes_per_block()
    tight, tight_events = engine_for(tokenizer, kv_blocks=20, kv_offload_memory=120 * page, prefix_caching=False,
                                     max_inflight_requests=12, max_decode_sequences=12)
    expected = run_together(roomy, roomy_events, batch(12, max_tokens=28))
    assert run_together(tight, tight_events, batch(12, max_tokens=28)) == expected
    assert not of(tight_events, ev.Failed)
    assert tight.stats()["kv_suspended"] >= 1
    assert tight.pool.reserved_blocks == 0 and tight.host.used_pages == 0


def test_requests_beyond_device_plus_host_wait_and_then_finish(tokenizer):
    # room for only about two such requests in device plus host: the others wait (they are
    # neither failed nor started), and all finish in turn, greedy-identical
    roomy, roomy_events = engine_for(tokenizer, kv_blocks=400, kv_offload_memory=0, prefix_caching=False,
                                     max_inflight_requests=6, max_decode_sequences=6)
    page = HostExampleExecutor(tokenizer.vocab_size).kv_bytes_per_block()
    tight, tight_events = engine_for(tokenizer, kv_blocks=16, kv_offload_memory=14 * page, prefix_caching=False,
                                     max_inflight_requests=6, max_decode_sequences=6)
    expected = run_together(roomy, roomy_events, batch(6))
    peak = []
    for req in batch(6):
        tight.submit(req)

    def check() -> None:
        peak.append(len(tight.scheduler.running))
        assert tight.on_demand.committed <= tight.on_demand.capacity

    tight.run_until_idle(after_step=check)
    got = {rid: tuple(of(tight_events, ev.Done, rid)[0].generated_ids) for rid in expected}
    assert got == expected and not of(tight_events, ev.Failed)
    assert max(peak) == 2  # 2 x 13 blocks fit 30 pages; 3 would not


def test_a_request_device_plus_host_cannot_hold_is_refused_naming_both_tiers(tokenizer):
    page = HostExampleExecutor(tokenizer.vocab_size).kv_bytes_per_block()
    engine, events = engine_for(tokenizer, kv_blocks=10, kv_offload_memory=8 * page, prefix_caching=False,
                                max_context=128)
    engine.submit(request("big", prompt_of(0), max_tokens=80))  # 92 positions: 23 blocks > 10 + 8
    engine.run_until_idle()
    failed = of(events, ev.Failed, "big")
    assert failed and isinstance(failed[0].error, NoSessionSlot)
    reason = failed[0].error.reason
    assert "a request may reach 23 KV blocks" in reason
    assert "the device pool has 10 and the host tier 8" in reason
    assert "the host tier (--kv-offload-memory) has 8 of 8 pages free" in reason
    engine.submit(request("small", prompt_of(1), max_tokens=4))  # the refusal left nothing behind
    engine.run_until_idle()
    assert of(events, ev.Done, "small") and engine.pool.used_blocks == 0


def test_a_request_larger_than_the_device_pool_is_refused_whatever_the_host_tier(tokenizer):
    # a sequence runs with every block on the device: 17 blocks never fit 16, however large the host tier
    engine, events = engine_for(tokenizer, kv_blocks=16, kv_offload_memory=1 << 20, prefix_caching=False,
                                max_context=128)
    engine.submit(request("first", prompt_of(1), max_tokens=40))
    engine.submit(request("big", prompt_of(0), max_tokens=56))  # 68 positions: 17 blocks
    engine._drain(block=False)
    failed = of(events, ev.Failed, "big")  # at once: it never could run, whatever ends
    assert failed and len(engine.scheduler.running) == 1
    engine.run_until_idle()
    assert of(events, ev.Done, "first")
    assert failed and "a request may reach 17 KV blocks" in failed[0].error.reason
    assert "the device pool has 16" in failed[0].error.reason
    engine.submit(request("fits", prompt_of(0), max_tokens=52))  # 64 positions: 16 blocks
    engine.run_until_idle()
    assert of(events, ev.Done, "fits")


def test_named_sessions_that_may_not_be_lost_count_against_the_guarantee(tokenizer):
    # two named sessions hold 4 blocks each (device or host); a request that would need more than
    # what is left of device plus host is refused, and the sessions stay whole
    page = HostExampleExecutor(tokenizer.vocab_size).kv_bytes_per_block()
    engine, events = engine_for(tokenizer, kv_blocks=10, kv_offload_memory=8 * page, prefix_caching=False)
    for i in range(2):
        engine.submit(request(f"r{i}", prompt_of(i), session=f"s{i}"))
        engine.run_until_idle()
    assert engine.on_demand.pinned() == 8
    engine.submit(request("new", prompt_of(5), max_tokens=32))  # 44 positions: 11 blocks; 8 + 11 > 18
    engine.run_until_idle()
    assert of(events, ev.Failed, "new")
    engine.submit(request("fits", prompt_of(6), max_tokens=28))  # 40 positions: 10 blocks; 8 + 10 <= 18
    engine.run_until_idle()
    assert of(events, ev.Done, "fits"), of(events, ev.Failed, "fits")
    for i in range(2):  # both sessions come back warm
        engine.submit(request(f"again{i}", prompt_of(i) + [1, 2, 3, 4, 5], session=f"s{i}"))
        engine.run_until_idle()
        assert of(events, ev.Done, f"again{i}")[0].cached_tokens == 12


def test_a_request_cancelled_while_suspended_leaves_nothing_behind(tokenizer):
    engine, events = engine_for(tokenizer, kv_blocks=24, kv_offload_memory=1 << 20, prefix_caching=False,
                                max_context=128)
    for req in batch(4, max_tokens=60):
        engine.submit(req)
    for _ in range(200):
        engine._drain(block=False)
        if engine._dispatch_due:
            engine._dispatch()
        engine.step()
        if engine.on_demand.parked:
            break
    (handle,) = list(engine.on_demand.parked)[:1]
    seq = next(s for s in engine.scheduler.running if s.handle == handle)
    engine.cancel(seq.id)
    engine.run_until_idle()
    assert of(events, ev.Done, seq.id)[0].finish_reason == "cancelled"
    assert all(of(events, ev.Done, f"r{i}") for i in range(4))
    assert engine.pool.reserved_blocks == 0 and engine.pool.used_blocks == 0
    assert engine.host.used_pages == 0 and not engine.on_demand.parked and not engine.on_demand.ceilings


def test_without_a_host_tier_running_requests_reserve_to_their_end(tokenizer):
    engine, events = engine_for(tokenizer, kv_blocks=24, kv_offload_memory=0, prefix_caching=False)
    assert engine.on_demand is None and engine.scheduler.on_demand is None
    for req in batch(4):
        engine.submit(req)
    engine._drain(block=False)
    assert len(engine.scheduler.running) == 1  # 13 blocks reserved: a second does not fit in 24
    assert engine.pool.reserved_blocks == 13
    engine.run_until_idle()
    assert len(of(events, ev.Done)) == 4 and "kv_suspended" not in engine.stats()


class CachingHostExecutor(HostExampleExecutor):
    """The example executor with host pages, for runs with the prefix cache on: a device page
    moved down is wiped once the pool holds it free and unkeyed (before the next copy or step),
    not at once, since a keyed block released to the prefix cache keeps its K/V on the device
    (docs/engine.md "The host tier": "keyed ones stay cached in the pool until it reuses them")."""

    pool = None  # the engine's KVPool, set after the engine is built
    moved: set

    def offload_pages(self, pairs) -> None:
        b = self.block_size
        moved = self.__dict__.setdefault("moved", set())
        for src, dst in pairs:
            self.host[dst] = self.cells[src * b:(src + 1) * b]
            moved.add(src)
            self.copies += 1

    def _wipe(self) -> None:
        b = self.block_size
        for page in self.__dict__.pop("moved", ()):
            if self.pool.refcount(page) == 0 and self.pool.key(page) is None:
                self.cells[page * b:(page + 1) * b] = -7  # free now: reading it again is wrong

    def copy_blocks(self, pairs) -> None:
        self._wipe()
        super().copy_blocks(pairs)

    def restore_pages(self, pairs) -> None:
        self._wipe()
        super().restore_pages(pairs)

    def step(self, step):
        self._wipe()
        return super().step(step)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mixed_requests_in_tight_tiers_all_finish_greedy_identical(tokenizer, seed):
    # requests of mixed lengths, some sharing a prefix (the prefix cache on), some on named
    # sessions, arriving in two waves into a device pool and a host tier both tight: every one
    # finishes (no deadlock, none failed) with the ids of an unconstrained engine
    import random

    rng = random.Random(seed)
    shared = prompt_of(50, 16)
    specs = []
    for i in range(10):
        prompt = (shared if rng.random() < 0.5 else []) + prompt_of(i, rng.randint(3, 20))
        specs.append((f"m{i}", prompt, rng.randint(4, 36), f"n{i % 3}" if rng.random() < 0.3 else None))
    page = HostExampleExecutor(tokenizer.vocab_size).kv_bytes_per_block()
    settings = dict(max_context=96, max_inflight_requests=6, max_decode_sequences=6)
    roomy, roomy_events = engine_for(tokenizer, kv_blocks=600, kv_offload_memory=0, **settings)
    tight, tight_events = engine_for(tokenizer, executor=CachingHostExecutor(tokenizer.vocab_size), kv_blocks=18,
                                     kv_offload_memory=40 * page, evict_idle_sessions=True, **settings)
    tight.executor.pool = tight.pool
    results = []
    for engine, events in ((roomy, roomy_events), (tight, tight_events)):
        for wave in (specs[:5], specs[5:]):
            for rid, prompt, max_tokens, session in wave:
                engine.submit(request(rid, prompt, session=session, max_tokens=max_tokens))
            engine.run_until_idle(max_steps=5000)  # (a deadlock fails instead of hanging)
        assert not of(events, ev.Failed)
        results.append({rid: tuple(of(events, ev.Done, rid)[0].generated_ids) for rid, *_ in specs})
    assert results[0] == results[1]
    assert tight.pool.reserved_blocks == 0 and not tight.on_demand.parked and not tight.on_demand.ceilings

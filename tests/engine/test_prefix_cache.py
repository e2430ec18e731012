"""Automatic prefix caching in the KV bookkeeping: keys, reuse, LRU eviction,
copy-on-write of keyed blocks, exact reservations."""

import pytest

from musegl_core.engine.kv_pool import KVPool, PoolExhausted
from musegl_core.engine.prefix_cache import ROOT, block_key
from musegl_core.engine.request import Phase, PreparedRequest, SequenceState
from musegl_core.engine.scheduler import Scheduler, SchedulerLimits
from musegl_core.engine.sessions import SessionTable

SIZE = 4


def setup(sessions=2, context=32, caching=True, snapshots=0):
    pool = KVPool(SessionTable.pool_blocks(SIZE, max_sessions=sessions, max_context=context, snapshots=snapshots), SIZE)
    table = SessionTable(pool, max_sessions=sessions, max_context=context, snapshots=snapshots, evict_idle=False,
                         prefix_caching=caching)
    return pool, table, Scheduler(pool, SchedulerLimits(4, 64, 68))


def run(table, sched, prompt, name=None, generate=2, handle=0):
    """What the engine does for one request: attach, prefill, decode, publish, release."""
    session, _ = table.open(name)
    reused = table.attach(session, prompt)
    assert table.reserve_run(session, table.run_blocks(session, reused, len(prompt) + generate))
    request = PreparedRequest(id=f"r{handle}", prompt_ids=tuple(prompt), max_tokens=generate)
    seq = SequenceState(request=request, handle=handle, max_new=generate, tokens=list(prompt), session=session,
                        computed=reused, cached=reused)
    sched.add(seq)
    all_copies = []
    while len(seq.tokens) - len(prompt) < generate:
        step, plan, copies = sched.schedule()
        all_copies += copies
        for s, rows in plan:
            s.computed += rows
        if seq.computed == len(seq.tokens):
            if seq.phase is Phase.PREFILL:
                seq.phase = Phase.DECODE
                session.tokens = seq.tokens[: seq.computed]
                table.publish(session)
            seq.tokens.append(100 + len(seq.tokens))
    sched.remove(seq)
    session.tokens = seq.tokens[: seq.computed]
    table.end_run(session, seq.computed)
    table.publish(session)
    if name is None:
        table.drop(session)
    return reused, all_copies, session


def test_identical_anonymous_requests_reuse_full_blocks_and_nothing_leaks():
    pool, table, sched = setup()
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks of 4
    reused, _, _ = run(table, sched, prompt)
    assert reused == 0
    # Released but kept: the finished request's full blocks (prompt + computed output).
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0
    assert pool.cached_blocks == 3
    assert pool.available_blocks == pool.num_blocks  # cached blocks are free blocks
    reused, _, _ = run(table, sched, prompt, handle=1)
    assert reused == 12
    assert table.cache.hits == 1 and table.cache.hit_tokens == 12
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0


def test_a_prompt_of_whole_blocks_reruns_its_last_position_without_touching_the_cached_block():
    pool, table, sched = setup()
    prompt = list(range(1, 9))  # exactly 2 blocks
    run(table, sched, prompt)
    keyed = pool.lookup(block_key(block_key(ROOT, prompt[:4]), prompt[4:8]))
    assert keyed is not None
    reused, copies, _ = run(table, sched, prompt, handle=1)
    assert reused == 7  # at least one fresh prompt position
    assert copies and copies[0][0] == keyed  # the keyed block was copied, not overwritten
    assert pool.lookup(block_key(block_key(ROOT, prompt[:4]), prompt[4:8])) == keyed


def test_a_different_prefix_misses_and_keys_chain_the_whole_prefix():
    pool, table, sched = setup()
    run(table, sched, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Same second block, different first block: the chained key does not match.
    reused, _, _ = run(table, sched, [9, 2, 3, 4, 5, 6, 7, 8, 9], handle=1)
    assert reused == 0
    reused, _, _ = run(table, sched, [1, 2, 3, 4, 0, 0, 0, 0, 0], handle=2)
    assert reused == 4


def test_cached_blocks_are_evicted_lru_only_when_allocation_needs_them():
    pool, table, sched = setup(sessions=1, context=16)  # 4 blocks in all
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    run(table, sched, first, generate=1)
    assert pool.cached_blocks == 2
    # A request needing all 4 blocks is admitted at once: cached blocks count as free.
    other = list(range(20, 34))
    reused, _, _ = run(table, sched, other, generate=2, handle=1)
    assert reused == 0
    assert pool.evicted >= 1
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0
    # The first prompt's tail block went before its head block (tails are released first).
    head = pool.lookup(block_key(ROOT, first[:4]))
    tail = pool.lookup(block_key(block_key(ROOT, first[:4]), first[4:8]))
    assert tail is None or head is not None


def test_reservations_stay_exact_with_cached_blocks():
    pool, table, sched = setup(sessions=2, context=16)  # 2 x 4 blocks + 1 to copy on write
    run(table, sched, list(range(1, 15)), generate=1)
    cached = pool.cached_blocks
    assert cached == 3
    a, _ = table.open("a")
    b, _ = table.open("b")
    assert pool.reserved_blocks == 0  # blocks on demand: an open session reserves nothing
    a.slot.grow(4)
    b.slot.grow(4)
    assert pool.reserved_blocks == 8 and pool.available_blocks == 1
    with pytest.raises(PoolExhausted):
        pool.reserve(2)
    # Both slots can still fill their whole budget: cached blocks make way.
    for session in (a, b):
        for _ in range(4):
            session.slot.blocks.append(session.slot.take_block())
    assert pool.cached_blocks == 1 and pool.evicted == cached - 1  # the spare block kept the oldest one
    table.drop(a)
    table.drop(b)
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0


def test_named_sessions_share_cached_blocks_with_each_other():
    pool, table, sched = setup(sessions=3)
    system = list(range(1, 13))
    _, _, first = run(table, sched, system + [50, 51], name="one")
    reused, _, second = run(table, sched, system + [60, 61], name="two", handle=1)
    assert reused == 12
    assert first.slot.blocks[:3] == second.slot.blocks[:3]  # shared, not copied
    assert all(pool.refcount(b) == 2 for b in first.slot.blocks[:3])
    table.drop(first)
    table.drop(second)
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0


def test_without_prefix_caching_nothing_is_kept():
    pool, table, sched = setup(caching=False)
    run(table, sched, list(range(1, 15)))
    assert pool.cached_blocks == 0
    reused, _, _ = run(table, sched, list(range(1, 15)), handle=1)
    assert reused == 0


def test_snapshot_blocks_are_found_by_content_and_become_cached_when_dropped():
    pool, table, sched = setup(sessions=2, snapshots=1)
    prompt = list(range(1, 11))
    run(table, sched, prompt, name="a")
    table.snapshot(table.named["a"])
    table.drop(table.named["a"])
    assert pool.cached_blocks == 0  # the snapshot still holds the keyed blocks
    reused, _, _ = run(table, sched, prompt, handle=1)  # the snapshot offers 9, the cache 8: snapshot wins
    assert reused == 9
    snapshot = table.snapshots.pop()
    snapshot.slot.close()
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0 and pool.cached_blocks == 2
    reused, _, _ = run(table, sched, prompt + [77], handle=2)
    assert reused == 8


def test_random_traffic_keeps_kv_contents_and_books_exact():
    """A model of the executor's cells (the token written at each block position):
    every reused position must read back the prompt's token, whatever mix of sessions,
    snapshots, rewinds, cache hits, copies and evictions led there."""
    import random

    for seed in range(4):
        rng = random.Random(seed)
        pool, table, sched = setup(sessions=3, context=40, snapshots=1)
        cells: dict[int, int] = {}
        prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
        suffixes = [[rng.randrange(1, 50) for _ in range(10)] for _ in range(3)]  # few: prompts recur
        for handle in range(150):
            name = rng.choice([None, None, "x", "y"])
            prompt = rng.choice(prefixes) + rng.choice(suffixes)[: rng.randrange(1, 10)]
            session, _ = table.open(name)
            reused = table.attach(session, prompt)
            assert table.reserve_run(session, table.run_blocks(session, reused, len(prompt) + 3))
            for p in range(reused):
                block = session.slot.blocks[p // SIZE]
                assert cells.get(block * SIZE + p % SIZE) == prompt[p], (seed, handle, p)
            request = PreparedRequest(id=f"r{handle}", prompt_ids=tuple(prompt), max_tokens=3)
            seq = SequenceState(request=request, handle=handle, max_new=3, tokens=list(prompt), session=session,
                                computed=reused, cached=reused)
            sched.add(seq)
            stop_at = rng.choice([None, rng.randrange(1, 4)])  # a cancellation after some steps
            steps = 0
            while len(seq.tokens) - len(prompt) < 3 and steps != stop_at:
                step, plan, copies = sched.schedule()
                for src, dst in copies:
                    for offset in range(SIZE):
                        if src * SIZE + offset in cells:
                            cells[dst * SIZE + offset] = cells[src * SIZE + offset]
                for chunk in step.chunks:
                    for position, token in zip(chunk.positions, chunk.tokens):
                        cells[chunk.blocks[position // SIZE] * SIZE + position % SIZE] = token
                for s, rows in plan:
                    s.computed += rows
                if seq.computed == len(seq.tokens):
                    if seq.phase is Phase.PREFILL:
                        seq.phase = Phase.DECODE
                        session.tokens = seq.tokens[: seq.computed]
                        table.publish(session)
                        table.snapshot(session)
                    seq.tokens.append(rng.randrange(1, 50))
                steps += 1
            sched.remove(seq)
            session.tokens = seq.tokens[: seq.computed]
            table.end_run(session, seq.computed)
            table.publish(session)
            if steps == stop_at:
                session.clean = False
            if name is None:
                table.drop(session)
            # The books: every slot is exactly at budget; every hold is counted.
            holders = [s.slot for s in table.named.values()] + [s.slot for s in table.snapshots]
            assert all(len(slot.blocks) + slot.reserved == slot.budget for slot in holders)
            assert pool.reserved_blocks == sum(slot.reserved for slot in holders)
            counts: dict[int, int] = {}
            for slot in holders:
                for block in slot.blocks:
                    counts[block] = counts.get(block, 0) + 1
            assert all(pool.refcount(b) == counts.get(b, 0) for b in range(pool.num_blocks))
            assert pool.used_blocks == len(counts)
        assert table.cache.hits > 0 and pool.evicted > 0, "the traffic must exercise hits and evictions"


def run_salted(table, sched, prompt, salt, name=None, handle=0):
    """:func:`run` on a session opened with ``salt`` (``cache_salt``)."""
    session, _ = table.open(name, salt=salt)
    reused = table.attach(session, prompt)
    assert table.reserve_run(session, table.run_blocks(session, reused, len(prompt) + 1))
    request = PreparedRequest(id=f"r{handle}", prompt_ids=tuple(prompt), max_tokens=1, cache_salt=salt)
    seq = SequenceState(request=request, handle=handle, max_new=1, tokens=list(prompt), session=session,
                        computed=reused, cached=reused)
    sched.add(seq)
    while seq.computed < len(seq.tokens):
        _, plan, _ = sched.schedule()
        for s, rows in plan:
            s.computed += rows
    sched.remove(seq)
    session.tokens = seq.tokens[: seq.computed]
    table.end_run(session, seq.computed)
    table.publish(session)
    table.snapshot(session)
    if name is None:
        table.drop(session)
    return reused


def test_the_salt_enters_the_key_chain_at_the_first_block():
    from musegl_core.engine.prefix_cache import chain_root

    tokens = [1, 2, 3, 4]
    assert chain_root(None) == ROOT
    keys = {block_key(chain_root(salt), tokens) for salt in (None, "alice", "bob", "alice ")}
    assert len(keys) == 4  # every salt is its own space, unsalted included


@pytest.mark.parametrize("snapshots", [0, 3])  # 3: one snapshot per salt
def test_cached_blocks_are_shared_only_between_requests_of_the_same_salt(snapshots):
    pool, table, sched = setup(sessions=2, snapshots=snapshots)
    prompt = list(range(1, 15))  # 3 full blocks
    assert run_salted(table, sched, prompt, "alice") == 0
    assert run_salted(table, sched, prompt, "bob", handle=1) == 0  # another user's exact prompt: no hit
    assert run_salted(table, sched, prompt, None, handle=2) == 0  # nor for an unsalted request
    best = 13 if snapshots else 12  # a snapshot offers every computed position but the last
    assert run_salted(table, sched, prompt, "alice", handle=3) == best
    assert run_salted(table, sched, prompt, None, handle=4) == best  # the unsalted space shares with itself
    assert run_salted(table, sched, prompt, "bob", handle=5) == best
    for snapshot in table.snapshots:
        snapshot.slot.close()
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0


def test_a_named_session_keeps_the_salt_it_was_created_with():
    from musegl_core.engine.sessions import SaltMismatch

    pool, table, sched = setup(sessions=2)
    prompt = list(range(1, 15))
    run_salted(table, sched, prompt, "alice", name="chat")
    for other in ("bob", None):
        with pytest.raises(SaltMismatch):
            table.open("chat", salt=other)
    assert run_salted(table, sched, prompt + [20], "alice", name="chat", handle=1) == 14  # its own history
    table.drop(table.named["chat"])
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0


def test_common_prefix_matches_a_plain_scan():
    import random

    from musegl_core.engine.sessions import common_prefix

    rng = random.Random(5)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 300))]
        b = list(a[: rng.randrange(0, len(a) + 1)]) + [rng.randrange(3) for _ in range(rng.randrange(0, 50))]
        plain = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == common_prefix(tuple(b), a) == plain


def test_a_session_s_own_keyed_blocks_are_not_hashed_again(monkeypatch):
    """attach() hands the session's own blocks to the lookup: it finds what hashing the whole
    prompt finds, hashing only the blocks after them."""
    from musegl_core.engine import prefix_cache

    pool, table, sched = setup(sessions=2, context=64)
    history = list(range(1, 30))
    _, _, session = run(table, sched, history, name="s")
    prompt = session.tokens + [70, 71, 72, 73, 74, 75]
    own = session.slot.blocks[: len(session.tokens) // SIZE]
    hashed = []
    real = prefix_cache.block_key
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: hashed.append(1) or real(parent, tokens))
    plain = table.cache.lookup(prompt, len(prompt) - 1)
    whole = len(hashed)
    hashed.clear()
    assert table.cache.lookup(prompt, len(prompt) - 1, held=own) == plain
    assert plain[0] >= len(own) * SIZE and len(hashed) < whole and len(hashed) <= whole - len(own) + 1

"""Step planning: decode cadence, chunked prefill, fair rotation, KV accounting."""

from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.request import Phase, PreparedRequest, SequenceState
from musegl_core.engine.scheduler import Scheduler, SchedulerLimits
from musegl_core.engine.sessions import SessionTable


def make_table(pool, sessions=8, context=256):
    return SessionTable(pool, max_sessions=sessions, max_context=context, snapshots=0, evict_idle=False)


def make_seq(table, handle, prompt_len, max_new=8):
    request = PreparedRequest(id=f"r{handle}", prompt_ids=tuple(range(1, prompt_len + 1)), max_tokens=max_new)
    session, _ = table.open(None)
    return SequenceState(request=request, handle=handle, max_new=max_new, tokens=list(request.prompt_ids),
                         session=session)


def advance(plan, step):
    """What the engine does after a step: count rows, move finished prefills to decode."""
    for seq, rows in plan:
        seq.computed += rows
        chunk = next(c for c in step.chunks if c.seq == seq.handle)
        if chunk.sample:
            seq.phase = Phase.DECODE
            seq.tokens.append(7)


def test_long_prompt_is_chunked_while_decoders_keep_their_cadence():
    pool = KVPool(256, 16)
    table = make_table(pool)
    sched = Scheduler(pool, SchedulerLimits(max_decode_sequences=4, max_prefill_chunk=32, max_step_tokens=36))
    short = make_seq(table, 0, 5, max_new=100)
    sched.add(short)
    step, plan, _ = sched.schedule()
    advance(plan, step)
    assert short.phase is Phase.DECODE
    long = make_seq(table, 1, 200)
    sched.add(long)
    steps = 0
    while long.phase is Phase.PREFILL:
        step, plan, _ = sched.schedule()
        rows = {c.seq: len(c.tokens) for c in step.chunks}
        assert rows[0] == 1, "the decoder advances every step"
        assert rows[1] <= 32, "prefill never exceeds --max-prefill-chunk per forward"
        advance(plan, step)
        steps += 1
    assert steps == -(-200 // 32)
    assert long.computed == 200


def test_decode_width_is_bounded_and_rotates_fairly():
    pool = KVPool(512, 16)
    table = make_table(pool)
    sched = Scheduler(pool, SchedulerLimits(max_decode_sequences=2, max_prefill_chunk=64, max_step_tokens=66))
    seqs = [make_seq(table, i, 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    step, plan, _ = sched.schedule()  # all five prompts fit one prefill chunk
    advance(plan, step)
    assert all(s.phase is Phase.DECODE for s in seqs)
    counts = {s.handle: 0 for s in seqs}
    for _ in range(10):
        step, plan, _ = sched.schedule()
        assert len(step.chunks) == 2
        for c in step.chunks:
            counts[c.seq] += 1
        advance(plan, step)
    assert set(counts.values()) == {4}


def test_block_tables_cover_written_positions_and_return_to_the_pool():
    pool = KVPool(64, 4)
    table = make_table(pool, sessions=2, context=32)
    sched = Scheduler(pool, SchedulerLimits(4, 8, 12))
    seq = make_seq(table, 0, 10, max_new=6)
    sched.add(seq)
    step, plan, _ = sched.schedule()
    chunk = step.chunks[0]
    assert list(chunk.positions) == list(range(8))
    assert len(chunk.blocks) == 2
    advance(plan, step)
    step, plan, _ = sched.schedule()
    assert list(step.chunks[0].positions) == [8, 9] and len(step.chunks[0].blocks) == 3
    advance(plan, step)
    sched.remove(seq)
    table.drop(seq.session)
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0


def test_writing_into_a_shared_block_copies_it_first():
    pool = KVPool(64, 4)
    table = SessionTable(pool, max_sessions=2, max_context=32, snapshots=1, evict_idle=False)
    sched = Scheduler(pool, SchedulerLimits(4, 16, 20))
    first = make_seq(table, 0, 6)
    sched.add(first)
    step, plan, copies = sched.schedule()
    advance(plan, step)
    assert copies == []
    first.session.tokens = first.tokens[: first.computed]
    table.snapshot(first.session)  # shares blocks 0 and 1 (positions 0..5)
    shared_boundary = first.session.slot.blocks[1]
    assert pool.refcount(shared_boundary) == 2
    step, plan, copies = sched.schedule()  # decode writes position 6, inside the shared block
    assert len(copies) == 1 and copies[0][0] == shared_boundary
    assert first.session.slot.blocks[1] == copies[0][1] != shared_boundary
    assert pool.refcount(shared_boundary) == 1  # only the snapshot holds it now
    sched.remove(first)
    table.drop(first.session)
    table.snapshots[0].slot.close()
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0

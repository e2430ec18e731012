"""Step planning: decode cadence, chunked prefill, fair rotation, KV accounting."""

from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.request import Phase, PreparedRequest, SequenceState
from musegl_core.engine.scheduler import Scheduler, SchedulerLimits


def make_seq(pool, handle, prompt_len, max_new=8):
    request = PreparedRequest(id=f"r{handle}", prompt_ids=tuple(range(1, prompt_len + 1)), max_tokens=max_new)
    blocks = pool.blocks_for(prompt_len + max_new)
    pool.reserve(blocks)
    return SequenceState(request=request, handle=handle, max_new=max_new, tokens=list(request.prompt_ids), reserved=blocks)


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
    sched = Scheduler(pool, SchedulerLimits(max_decode_sequences=4, max_prefill_chunk=32, max_step_tokens=36))
    short = make_seq(pool, 0, 5, max_new=100)
    sched.add(short)
    step, plan = sched.schedule()
    advance(plan, step)
    assert short.phase is Phase.DECODE
    long = make_seq(pool, 1, 200)
    sched.add(long)
    steps = 0
    while long.phase is Phase.PREFILL:
        step, plan = sched.schedule()
        rows = {c.seq: len(c.tokens) for c in step.chunks}
        assert rows[0] == 1, "the decoder advances every step"
        assert rows[1] <= 32, "prefill never exceeds --max-prefill-chunk per forward"
        advance(plan, step)
        steps += 1
    assert steps == -(-200 // 32)
    assert long.computed == 200


def test_decode_width_is_bounded_and_rotates_fairly():
    pool = KVPool(512, 16)
    sched = Scheduler(pool, SchedulerLimits(max_decode_sequences=2, max_prefill_chunk=64, max_step_tokens=66))
    seqs = [make_seq(pool, i, 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    step, plan = sched.schedule()  # all five prompts fit one prefill chunk
    advance(plan, step)
    assert all(s.phase is Phase.DECODE for s in seqs)
    counts = {s.handle: 0 for s in seqs}
    for _ in range(10):
        step, plan = sched.schedule()
        assert len(step.chunks) == 2
        for c in step.chunks:
            counts[c.seq] += 1
        advance(plan, step)
    assert set(counts.values()) == {4}


def test_block_tables_cover_written_positions_and_return_to_the_pool():
    pool = KVPool(64, 4)
    sched = Scheduler(pool, SchedulerLimits(4, 8, 12))
    seq = make_seq(pool, 0, 10, max_new=6)
    sched.add(seq)
    baseline_available = pool.num_blocks - seq.reserved
    step, plan = sched.schedule()
    chunk = step.chunks[0]
    assert list(chunk.positions) == list(range(8))
    assert len(chunk.blocks) == 2
    advance(plan, step)
    step, plan = sched.schedule()
    assert list(step.chunks[0].positions) == [8, 9] and len(step.chunks[0].blocks) == 3
    advance(plan, step)
    sched.remove(seq)
    assert pool.used_blocks == 0 and pool.reserved_blocks == 0
    assert pool.available_blocks == pool.num_blocks >= baseline_available

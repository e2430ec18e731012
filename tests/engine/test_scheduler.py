"""Step planning: decode cadence, chunked prefill, fair rotation, KV accounting."""

from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.request import Phase, PreparedRequest, SequenceState
from musegl_core.engine.scheduler import Scheduler, SchedulerLimits
from musegl_core.engine.sessions import SessionTable
from tests.support.scheduling import advance, make_seq, make_table


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


def test_masks_computed_beside_the_forward_equal_the_inline_ones():
    """--grammar-threads: the masks a step carries (PendingMasks, computed by
    worker threads) are the inline ones, verify blocks with drafts included."""
    import numpy as np

    from musegl_core.constrain.grammar import answer_grammar
    from musegl_core.constrain.matcher import compile_grammar
    from musegl_core.engine.masks import PendingMasks
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    tokenizer = MuseTokenizer.load(default_model_path())
    grammar = answer_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}, 0)
    output = tokenizer.encode(' to=user<|message|>{"a": 12345}<|eot|>', special=True)
    steps = []
    for threads in (0, 2):
        pool = KVPool(64, 16)
        table = make_table(pool)
        sched = Scheduler(pool, SchedulerLimits(4, 64, 68), mask_threads=threads)
        request = PreparedRequest(id="r", prompt_ids=(1, 2, 3, 4, 5), max_tokens=64,
                                  processors=(compile_grammar(grammar, tokenizer, tokenizer.vocab_size),))
        session = table.open(None)[0]
        assert table.reserve_run(session, table.run_blocks(session, 0, 5 + 64))
        seq = SequenceState(request=request, handle=0, max_new=64, tokens=list(request.prompt_ids),
                            session=session)
        sched.add(seq)
        masks = []
        for i in range(len(output) - 2):
            seq.drafts = list(output[i + 1:i + 3]) if seq.phase is Phase.DECODE and i % 3 == 0 else []
            step, plan, _ = sched.schedule()
            chunk = step.chunks[0]
            assert isinstance(chunk.masks, PendingMasks) == (threads > 0)
            masks.append([np.array(m) for m in chunk.masks])
            for s, rows in plan:  # commit one id of the output (drafts: only the first row)
                s.computed += 1 if s.phase is Phase.DECODE else rows
                s.phase = Phase.DECODE
                s.tokens.append(output[i])
                s.generated.append(output[i])
        steps.append(masks)
    inline, overlapped = steps
    assert len(inline) == len(overlapped) and any(len(m) > 1 for m in inline)
    for a, b in zip(inline, overlapped):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_mask_threads_default_to_none_for_an_executor_on_the_host_cpu():
    from musegl_core.engine.engine import grammar_threads
    from musegl_core.engine.executor import ExecutorLimits

    assert grammar_threads(None, ExecutorLimits(host_compute=True)) == 0
    assert grammar_threads(None, ExecutorLimits()) == 2
    assert grammar_threads(3, ExecutorLimits(host_compute=True)) == 3


def test_update_commits_prefill_then_the_ids_the_drafts_agree_with():
    """Scheduler.update: a finished prefill reports the prompt and its first id; a verify
    block commits the sampled ids while the drafts agree, one by one, gives back the
    block that held only rejected drafts, and counts drafted and accepted tokens; a
    sequence that ends inside the block takes nothing after its last id."""
    from musegl_core.engine.executor import StepOutput

    pool = KVPool(64, 4)
    table = make_table(pool, context=64)
    sched = Scheduler(pool, SchedulerLimits(4, 16, 20))
    seq = make_seq(table, 0, 6, max_new=20)
    sched.add(seq)
    assert sched.by_id == {"r0": seq}
    seen = []

    def on_token(s, token, logprobs):
        seen.append(("token", token, s.computed))
        s.tokens.append(token)
        s.generated.append(token)

    scheduled = sched.schedule()
    update = sched.update(scheduled, StepOutput(tokens={0: [40]}), lambda s: seen.append(("prefilled", s.computed)),
                          on_token)
    assert seen == [("prefilled", 6), ("token", 40, 6)]
    assert (seq.phase, seq.computed, update.committed_rows, update.prompt_rows) == (Phase.DECODE, 6, {0: 6}, 6)

    seq.drafts = [41, 42, 43, 44, 45, 46, 47, 48]  # rows 6..14: four blocks of 4
    scheduled = sched.schedule()
    assert len(seq.blocks) == 4
    seen.clear()
    update = sched.update(scheduled, StepOutput(tokens={0: [41, 42, 9, 9, 9, 9, 9, 9, 9]}), None, on_token)
    assert seen == [("token", 41, 7), ("token", 42, 8), ("token", 9, 9)]
    assert (seq.computed, update.committed_rows, update.prompt_rows, seq.drafts) == (9, {0: 3}, 0, [])
    assert len(seq.blocks) == pool.blocks_for(seq.computed + 1) == 3  # the fourth held only rejected rows
    assert (sched.drafted_tokens, sched.accepted_tokens, sched.verify_blocks) == (8, 2, 1)
    assert (seq.drafted, seq.accepted) == (8, 2)

    seq.drafts = [50, 51]

    def ends_at_first(s, token, logprobs):
        on_token(s, token, logprobs)
        s.phase = Phase.FINISHED

    seen.clear()
    update = sched.update(sched.schedule(), StepOutput(tokens={0: [50, 51, 52]}), None, ends_at_first)
    assert seen == [("token", 50, 10)] and update.committed_rows == {0: 1}
    sched.remove(seq)
    assert sched.by_id == {} and sched.idle

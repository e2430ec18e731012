"""Building sequences and replaying steps for scheduler tests, without an engine."""

from musegl_core.engine.request import Phase, PreparedRequest, SequenceState
from musegl_core.engine.sessions import SessionTable


def make_table(pool, sessions=8, context=256):
    return SessionTable(pool, max_sessions=sessions, max_context=context, snapshots=0, evict_idle=False)


def make_seq(table, handle, prompt_len, max_new=8):
    request = PreparedRequest(id=f"r{handle}", prompt_ids=tuple(range(1, prompt_len + 1)), max_tokens=max_new)
    session, _ = table.open(None)
    assert table.reserve_run(session, table.run_blocks(session, 0, prompt_len + max_new))  # as the engine's start
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

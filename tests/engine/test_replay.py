"""Generated-token replay (musegl_core/engine/replay.py): a resubmitted conversation gets each
earlier answer's generated ids back while the history before it is the session's executed one,
and the check reads each stretch of history once."""

from __future__ import annotations

import pytest

from musegl_core.engine.replay import ReplayLog, Replayer


@pytest.fixture(scope="module")
def replayer():
    from musegl_core.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    return Replayer(tokenizer, frozenset(tokenizer.end_of_generation_ids))


def conversation(replayer, turns: int, *, history: int = 40):
    """(executed prompt ids, turns) of a session that answered ``turns`` times: the text ids of
    each turn's history, then the answer's ids closed with <|eot|>."""
    eot = replayer.eot
    executed: list[int] = []
    answered = []
    for number in range(turns):
        executed += [300 + 7 * number + k for k in range(history)]
        answer = tuple(500 + 11 * number + k for k in range(5)) + (eot,)
        answered.append((len(executed), answer))
        executed += answer
    return tuple(executed), tuple(answered)


def test_every_answer_after_the_executed_history_is_replayed(replayer):
    executed, turns = conversation(replayer, 4)
    prompt = list(executed) + [900, 901]  # the next user message
    keys, kept = replayer.apply(ReplayLog(executed, turns), prompt)
    assert kept == turns and keys == prompt


def test_an_edited_message_stops_the_replay_there(replayer):
    executed, turns = conversation(replayer, 4)
    prompt = list(executed)
    prompt[turns[2][0] - 3] = 999  # a message before the third answer changed
    keys, kept = replayer.apply(ReplayLog(executed, turns), prompt)
    assert kept == turns[:2] and keys == prompt
    prompt[5] = 998  # and one before the first
    assert replayer.apply(ReplayLog(executed, turns), prompt)[1] == ()


def test_a_different_answer_stops_the_replay(replayer):
    executed, turns = conversation(replayer, 3)
    prompt = list(executed)
    start = turns[1][0]
    prompt[start] = 777  # the client sent another second answer
    assert replayer.apply(ReplayLog(executed, turns), prompt)[1] == turns[:1]


def test_the_parsed_turns_kept_stay_within_their_turn_and_id_bounds():
    """Issue 47 (the soak's RSS): the replayer's memory of parsed turns is bounded in ids, not
    only in turns, least recently used first out; a turn longer than the whole bound is parsed
    and not kept; a kept turn is parsed once."""
    from musegl_core.engine.replay import MeaningCache

    parsed: list[tuple[int, ...]] = []
    cache = MeaningCache(lambda ids: parsed.append(ids) or len(ids), turns=8, ids=100)
    for n in range(200):  # 200 turns of 30 ids: 6,000 ids asked for
        turn = tuple(range(n, n + 30))
        assert cache(turn) == 30
        assert len(cache) <= 8 and cache.ids <= 100
    assert len(cache) == 3 and cache.ids == 90  # the three most recent
    assert cache(tuple(range(199, 229))) == 30 and len(parsed) == 200  # kept: not parsed again
    assert cache(tuple(range(197, 227))) == 30 and len(parsed) == 200
    assert cache(tuple(range(101))) == 101 and len(cache) == 3  # too long to keep
    for n in range(20):  # short turns: the turn bound applies
        cache((n,))
    assert len(cache) == 8 and cache.ids == 8


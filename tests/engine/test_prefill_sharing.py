"""Shared prefill (musegl_core/engine/prefill_sharing.py): prompts that arrive together and share a
prefix compute it once, and every answer is the one the prompt gets alone.

The example executor's "model" hashes every cache cell a position attends to, so a follower that
adopted a wrong block, or a block before it was written, answers differently."""

from __future__ import annotations

import pytest

from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.prefill_sharing import prompt_chain
from musegl_core.engine.request import PreparedRequest
from musegl_core.testing.example_executor import ExampleExecutor

SHARED = tuple(range(100, 100 + 203))  # not a whole number of blocks (4 positions each)
CHUNK = 32


@pytest.fixture(scope="module")
def tokenizer():
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(str(default_model_path()))


def prompt(index: int, unique: int = 9) -> tuple[int, ...]:
    return SHARED + tuple(400 + 50 * index + k for k in range(unique))


def request(index: int, salt: str | None = None, max_tokens: int = 5) -> PreparedRequest:
    return PreparedRequest(id=f"r{index}", prompt_ids=prompt(index), max_tokens=max_tokens, ignore_eos=True,
                           sampling=GREEDY, cache_salt=salt)


def engine(tokenizer, *, caching: bool = True) -> tuple[Engine, ExampleExecutor, list]:
    executor = ExampleExecutor(tokenizer.vocab_size)
    events: list = []
    config = EngineConfig(max_context=512, max_sessions=8, max_prefill_chunk=CHUNK, max_decode_sequences=8,
                          prefix_caching=caching)
    return Engine(executor, tokenizer, config, events.append), executor, events


def prompt_rows(executor: ExampleExecutor) -> int:
    """Prompt positions the executor computed (every prompt here is 212 long; decode rows come after)."""
    return sum(p < len(prompt(0)) for step in executor.steps for chunk in step.chunks for p in chunk.positions)


def done(events: list) -> dict[str, ev.Done]:
    return {e.id: e for e in events if isinstance(e, ev.Done)}


def alone(tokenizer, requests: list[PreparedRequest]) -> dict[str, tuple[int, ...]]:
    """Each request's answer on a fresh engine without a prefix cache."""
    answers = {}
    for req in requests:
        eng, _, events = engine(tokenizer, caching=False)
        eng.submit(req)
        eng.run_until_idle()
        answers[req.id] = done(events)[req.id].generated_ids
    return answers


def test_prompts_that_arrive_together_compute_their_shared_prefix_once(tokenizer):
    requests = [request(i) for i in range(4)]
    eng, executor, events = engine(tokenizer)
    for req in requests:
        eng.submit(req)
    eng.run_until_idle()
    finished = done(events)
    assert {k: v.generated_ids for k, v in finished.items()} == alone(tokenizer, requests)
    # The leader computes all 212 positions; each follower adopts the 200 of the shared prefix's whole
    # blocks (203 // 4 * 4) and computes its own 12.
    assert finished["r0"].cached_tokens == 0
    assert [finished[f"r{i}"].cached_tokens for i in (1, 2, 3)] == [200] * 3
    stats = eng.stats()
    assert stats["prefill_shared_tokens"] == 600 and stats["prefill_shared_requests"] == 3
    assert stats["prefill_follow_steps"] > 0
    assert prompt_rows(executor) == 212 + 3 * 12
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0  # nothing leaked


def test_a_follower_gets_no_rows_until_its_leader_computed_the_blocks_it_needs(tokenizer):
    eng, executor, _ = engine(tokenizer)
    eng.submit(request(0))
    eng.submit(request(1))
    eng.run_until_idle()
    handles = {}
    for n, step in enumerate(executor.steps):
        for chunk in step.chunks:
            handles.setdefault(chunk.seq, []).append((n, chunk.positions[0], len(chunk.tokens)))
    leader, follower = sorted(handles)
    first_step, first_position, _ = handles[follower][0]
    assert first_position == 200  # its first chunk starts past the adopted prefix
    led = sum(rows for n, _, rows in handles[leader] if n < first_step)
    assert led >= 200  # the leader had computed those blocks by then


def test_without_a_prefix_cache_or_across_salts_nothing_is_shared(tokenizer):
    requests = [request(0), request(1)]
    eng, executor, events = engine(tokenizer, caching=False)
    for req in requests:
        eng.submit(req)
    eng.run_until_idle()
    assert prompt_rows(executor) == 2 * 212
    assert "prefill_shared_tokens" not in eng.stats()

    salted = [request(0, salt="a"), request(1, salt="b")]
    eng, executor, events = engine(tokenizer)
    for req in salted:
        eng.submit(req)
    eng.run_until_idle()
    assert prompt_rows(executor) == 2 * 212
    assert eng.stats()["prefill_shared_tokens"] == 0
    assert all(d.cached_tokens == 0 for d in done(events).values())
    same = [request(0, salt="a"), request(1, salt="a")]
    eng, executor, events = engine(tokenizer)
    for req in same:
        eng.submit(req)
    eng.run_until_idle()
    assert done(events)["r1"].cached_tokens == 200


def test_a_cancelled_leader_leaves_its_followers_to_prefill_the_rest(tokenizer):
    requests = [request(i) for i in range(3)]
    eng, executor, events = engine(tokenizer)
    for req in requests:
        eng.submit(req)
    for _ in range(3):  # the leader is three chunks in; the others follow
        eng._drain(block=False)
        if eng._dispatch_due:
            eng._dispatch()
        eng.step()
    assert eng.stats()["prefill_follow_steps"] > 0
    eng.cancel("r0")
    eng.run_until_idle()
    finished = done(events)
    assert finished["r0"].finish_reason == "cancelled"
    expected = alone(tokenizer, requests[1:])
    assert {k: finished[k].generated_ids for k in ("r1", "r2")} == expected
    # r1 adopted the leader's three published chunks (96 positions) and computed the rest; r2 followed r1.
    assert finished["r1"].cached_tokens == 96 and finished["r2"].cached_tokens == 200
    stats = eng.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0


def test_a_session_turn_arriving_mid_prefill_reuses_the_progress_so_far(tokenizer):
    """Published as it goes: a request admitted while another is halfway through the same
    prompt attaches the computed half at once (a prefix-cache hit), then follows for the rest."""
    eng, executor, events = engine(tokenizer)
    eng.submit(request(0))
    for _ in range(2):
        eng._drain(block=False)
        if eng._dispatch_due:
            eng._dispatch()
        eng.step()
    eng.submit(request(1))
    eng.run_until_idle()
    finished = done(events)
    assert finished["r1"].cached_tokens == 200
    assert eng.stats()["prefix_cache_hit_tokens"] >= 2 * CHUNK
    assert finished["r1"].generated_ids == alone(tokenizer, [request(1)])["r1"]


def test_the_chain_covers_the_whole_blocks_before_the_last_prompt_position():
    keys = list(range(10))
    assert len(prompt_chain(keys, 10, 4, None)) == 2  # positions 0-7; position 9 is always computed
    assert len(prompt_chain(keys, 9, 4, None)) == 2
    assert len(prompt_chain(keys, 8, 4, None)) == 1  # position 7 is the last: block 1 is not reusable
    assert prompt_chain(keys, 10, 4, "s") != prompt_chain(keys, 10, 4, None)


def test_a_prompt_follows_only_a_leader_working_on_the_block_it_needs():
    """A leader behind the follower would first recompute blocks the follower already holds (and
    it goes first): the follower prefills on. One working on the very block is followed."""
    from musegl_core.engine.kv_pool import KVPool
    from musegl_core.engine.prefill_sharing import PrefillSharing
    from musegl_core.engine.request import SequenceState
    from musegl_core.engine.sessions import SessionTable

    pool = KVPool(64, 4)
    table = SessionTable(pool, max_sessions=2, max_context=64, snapshots=0, evict_idle=False)
    sharing = PrefillSharing(pool, table.cache)
    keys = list(range(100, 140))

    def seq(handle, computed):
        session, _ = table.open(None)
        return SequenceState(request=PreparedRequest(id=f"s{handle}", prompt_ids=tuple(keys), max_tokens=1),
                             handle=handle, max_new=1, tokens=list(keys), session=session, prompt_len=len(keys),
                             computed=computed, cached=computed)

    leader, follower = seq(0, 0), seq(1, 8)
    assert sharing.ready([leader, follower]) == [leader, follower]  # the leader is behind: no one waits
    leader.computed = 9  # now inside block 2, the follower's next
    assert sharing.ready([leader, follower]) == [leader]
    assert sharing.follow_steps == 1

"""A rewind past the sliding window restored from the host tier (docs/engine.md "Rewinds past the
window"), over the torch executor on the CPU and the converter-written tiny model with a window of
8 (4 layers, 3 of them sliding): a named session's sliding pages that leave the window are copied
to the host tier before they leave the device, and a rewind to an earlier turn brings them back
instead of recomputing, greedy-identical to a server that keeps every position of every layer.
When the host tier let go of them, the rewind recomputes the window, exact as before."""

from __future__ import annotations

import attrs
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.tiny import PRESETS, make_tiny
from musegl_core.tokenizer import MuseTokenizer
from musegl_cuda.executor import TorchExecutor

BLOCK = 4  # the window of 8 is two blocks
WINDOW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    preset = attrs.evolve(PRESETS["tiny"], name="window8", sliding_window=WINDOW)
    path = make_tiny(tmp_path_factory.mktemp("window8"), preset=preset, seed=0)
    return load_checkpoint(path), MuseTokenizer.load(str(path))


def engine_for(model, *, sliding: bool, host: int | None = 0, blocks: int = 400) -> tuple[Engine, list]:
    checkpoint, tokenizer = model
    executor = TorchExecutor(checkpoint, device="cpu", dtype="float32", block_size=BLOCK)
    events: list = []
    config = EngineConfig(max_context=256, max_sessions=4, max_inflight_requests=4, max_decode_sequences=4,
                          max_prefill_chunk=16, kv_blocks=blocks, kv_offload_memory=host, sliding_window_kv=sliding)
    return Engine(executor, tokenizer, config, events.append), events


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def done(events, rid: str) -> ev.Done:
    found = [e for e in events if isinstance(e, ev.Done) and e.id == rid]
    assert found, [e for e in events if getattr(e, "id", None) == rid]
    return found[0]


def conversation(engine: Engine, events: list) -> dict[str, tuple[list[int], int]]:
    """Three turns of a named session (each extends the last, its history many windows long), then
    rewinds to earlier turns, the last two with their own continuation; per request, the ids
    generated and the positions reused."""
    out: dict[str, tuple[list[int], int]] = {}

    def run(rid: str, prompt: list[int], n: int = 10) -> list[int]:
        engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(prompt), max_tokens=n, ignore_eos=True,
                                      sampling=GREEDY, session_id="chat", stream=True))
        engine.run_until_idle()
        result = done(events, rid)
        out[rid] = (list(result.generated_ids), result.cached_tokens)
        return out[rid][0]

    history = ids(1, 37)
    history += run("t1", history) + ids(2, 23)
    history += run("t2", history) + ids(3, 19)
    history += run("t3", history)
    run("rewind_late", history[:85] + ids(8, 6))  # back into the third turn
    run("rewind", history[:30] + ids(4, 5))  # back into the first turn
    early = history[:30] + ids(4, 5) + out["rewind"][0] + ids(9, 4)
    run("after", early)  # the rewound branch goes on
    run("rewind_again", history[:21] + ids(5, 7))  # and back again, before that
    return out


def test_a_rewind_past_the_window_restores_the_sliding_pages_from_the_host_tier(model):
    full, full_events = engine_for(model, sliding=False)
    paged, paged_events = engine_for(model, sliding=True, host=1 << 20)
    assert paged.pool.companions == 3 and paged.host is not None  # 3 sliding layers: 3 groups of one
    expected = conversation(full, full_events)
    got = conversation(paged, paged_events)
    assert got == expected  # the same ids, and every rewind reuses every position it shares
    assert [got[rid][1] for rid in ("rewind_late", "rewind", "rewind_again")] == [85, 30, 21]
    stats = paged.stats()
    # nothing recomputed: each rewind's window came back from the host tier
    assert paged.scheduler.window_rows == 0 and stats["kv_window_recomputed_rows"] == 0
    assert stats["kv_window_restores"] == 3
    # to 85: the blocks of 77..84 (19 to 21); to 30: of 22..29 (5 to 7); to 21: of 13..20 (3 to 5)
    assert stats["kv_window_restored_blocks"] == 3 + 3 + 3
    assert stats["kv_window_offloaded_blocks"] > 20 and stats["kv_host_window_blocks"] > 0
    assert stats["kv_host_offloaded_blocks"] == 0  # no whole block went down: no pressure
    # the device still keeps only the window's sliding pages of the idle session
    session = paged.sessions.named["chat"]
    kept = [b for b in session.slot.blocks if paged.pool.companion_pages(b) is not None]
    assert len(session.slot.blocks) >= 9 and len(kept) <= 3
    # and the host tier holds the rest, one host page per sliding group and block
    assert paged.host.used_pages == 3 * len(session.window_host) == 3 * stats["kv_host_window_blocks"]
    paged.sessions.close("chat")
    assert paged.host.used_pages == 0 and not paged.sessions.window_lru


def test_when_the_host_tier_let_go_of_them_the_rewind_recomputes_the_window_exactly(model):
    full, full_events = engine_for(model, sliding=False)
    expected = conversation(full, full_events)
    probe, _ = engine_for(model, sliding=True, host=1 << 20)
    # room for the sliding pages of 3 blocks: the newest copies push the older ones out
    paged, paged_events = engine_for(model, sliding=True, host=9 * probe.host.page_bytes)
    assert paged.host.num_pages == 9
    got = conversation(paged, paged_events)
    assert {rid: generated for rid, (generated, _) in got.items()} == {
        rid: generated for rid, (generated, _) in expected.items()}
    stats = paged.stats()
    assert paged.sessions.window_dropped_blocks > 0 and stats["kv_window_restores"] == 0
    # every rewind found its window gone and recomputed it from (sliding layers x window) positions
    # before the window's block: to 85, from 76 - 2 x 8 = 60; to 30, from 20 - 16 = 4; to 21, from 0
    assert [got[rid][1] for rid in ("rewind_late", "rewind", "rewind_again")] == [60, 4, 0]
    assert stats["kv_window_recomputed_rows"] == paged.scheduler.window_rows == (85 - 60) + (30 - 4) + 21


def test_without_a_host_tier_the_sliding_pages_are_dropped_as_before(model):
    paged, _ = engine_for(model, sliding=True, host=0)
    assert paged.host is None and paged.scheduler.window_down is None


def test_a_session_moved_down_whole_then_rewound_gets_its_blocks_and_window_back(model):
    """Two sessions taking turns in a device pool that holds about one: each moves down to the host
    tier whole while the other runs, comes back, and then rewinds past its window, its sliding
    pages restored too; greedy-identical to a pool that holds everything, nothing recomputed."""

    def agents(engine: Engine, events: list) -> dict[str, tuple[list[int], int]]:
        out: dict[str, tuple[list[int], int]] = {}
        histories = {"x": ids(11, 40), "y": ids(12, 40)}

        def run(rid: str, name: str, prompt: list[int]) -> None:
            engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(prompt), max_tokens=8, ignore_eos=True,
                                          sampling=GREEDY, session_id=name, stream=True))
            engine.run_until_idle()
            result = done(events, rid)
            out[rid] = (list(result.generated_ids), result.cached_tokens)

        for turn in range(2):
            for name in ("x", "y"):
                run(f"{name}{turn}", name, histories[name])
                histories[name] += out[f"{name}{turn}"][0] + ids(20 + turn, 9)
        run("x_rewind", "x", histories["x"][:45] + ids(13, 5))  # back into x's first turn
        run("y_rewind", "y", histories["y"][:30] + ids(14, 5))
        return out

    roomy, roomy_events = engine_for(model, sliding=False)
    tight, tight_events = engine_for(model, sliding=True, host=1 << 20, blocks=12)  # 48 pages
    expected = agents(roomy, roomy_events)
    assert agents(tight, tight_events) == expected
    stats = tight.stats()
    assert stats["kv_host_offloads"] >= 2 and stats["kv_restores"] >= 2  # the sessions went down and came back
    assert stats["kv_window_restores"] == 2 and tight.scheduler.window_rows == 0

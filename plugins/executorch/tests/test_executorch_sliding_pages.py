"""Sliding layers keep their window on ExecuTorch (docs/engine.md "Sliding layers keep their
window", docs/executorch.md): a program exported with ``--sliding-pages`` (pools of layer groups'
places, one set of window cells per sliding group) follows the engine's sliding pages. A named
session of several turns, rewinds past the window (which recompute only the sliding layers' K/V)
and side-by-side requests answer exactly as the same program keeping every position of every
layer, and as the eager torch executor. Slow tier: the export takes a minute or more."""

from __future__ import annotations

import attrs
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.cli.main import main
from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.tiny import PRESETS, make_tiny
from musegl_core.tokenizer import MuseTokenizer

WINDOW = 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The converter-written tiny model with a window of 8 (4 layers, 3 of them sliding: one full
    group and three sliding groups of one layer), exported with --sliding-pages."""
    preset = attrs.evolve(PRESETS["tiny"], name="window8", sliding_window=WINDOW)
    checkpoint = make_tiny(tmp_path_factory.mktemp("window8"), preset=preset, seed=0, file_type="f32")
    out = tmp_path_factory.mktemp("window8_export")
    status = main(["export", str(checkpoint), "-o", str(out), "--forward-sizes", "4", "--max-prefill-chunk", "16",
                   "--max-cells", "8192", "--sliding-pages", "--overwrite"])
    assert status == 0
    return checkpoint, out


def engine_for(executor, tokenizer, sliding: bool) -> tuple[Engine, list]:
    events: list = []
    config = EngineConfig(max_context=256, max_sessions=4, max_inflight_requests=4, max_decode_sequences=4,
                          max_prefill_chunk=16, kv_blocks=100, sliding_window_kv=sliding, kv_offload_memory=0)
    return Engine(executor, tokenizer, config, events.append), events


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def done(events, rid: str) -> ev.Done:
    return next(e for e in events if isinstance(e, ev.Done) and e.id == rid)


def conversation(engine: Engine, events: list) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}

    def run(rid: str, prompt: list[int], n: int = 10) -> list[int]:
        engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(prompt), max_tokens=n, ignore_eos=True,
                                      sampling=GREEDY, session_id="chat", stream=True))
        engine.run_until_idle()
        out[rid] = list(done(events, rid).generated_ids)
        return out[rid]

    history = ids(1, 37)
    history += run("t1", history) + ids(2, 23)
    history += run("t2", history) + ids(3, 19)
    history += run("t3", history)
    run("rewind_late", history[:85] + ids(8, 6))  # back into the third turn
    run("rewind", history[:30] + ids(4, 5))  # back into the first turn
    engine.submit(PreparedRequest(id="a", prompt_ids=tuple(ids(5, 50)), max_tokens=12, ignore_eos=True,
                                  sampling=GREEDY))
    engine.submit(PreparedRequest(id="b", prompt_ids=tuple(ids(6, 21)), max_tokens=30, ignore_eos=True,
                                  sampling=GREEDY))
    engine.run_until_idle()
    out["a"], out["b"] = list(done(events, "a").generated_ids), list(done(events, "b").generated_ids)
    return out


@pytest.mark.slow
def test_a_program_exported_with_sliding_pages_follows_them(exported):
    from musegl_cuda.executor import TorchExecutor
    from musegl_executorch.executor import ExecuTorchExecutor

    checkpoint, out = exported
    assert ExecuTorchExecutor(str(out)).manifest.abi == "musegl-offgraph-kv/1-sliding-pages"
    tokenizer = MuseTokenizer.load(str(checkpoint))
    paged_executor = ExecuTorchExecutor(str(out))
    full_executor = ExecuTorchExecutor(str(out))
    try:
        paged, paged_events = engine_for(paged_executor, tokenizer, sliding=True)
        full, full_events = engine_for(full_executor, tokenizer, sliding=False)
        assert paged.pool.companions == 3 and full.pool.companions == 0
        assert paged_executor.k_pool.shape[0] == 1  # one place: every group's pages in one row
        got = conversation(paged, paged_events)
        assert got == conversation(full, full_events)
        # blocks of 16, window 8, 3 sliding layers: to 85 the window's block starts at 64, 64 - 2 x 8 = 48;
        # to 30 it starts at 16, so from 0
        assert done(paged_events, "rewind_late").cached_tokens == 48 < done(full_events, "rewind_late").cached_tokens
        assert paged.scheduler.window_rows == (85 - 48) + 30 and full.scheduler.window_rows == 0
        blocks = paged.sessions.named["chat"].slot.blocks
        kept = [b for b in blocks if paged.pool.companion_pages(b) is not None]
        assert len(blocks) >= 3 and len(kept) <= 2
        # and as the eager torch executor keeping every position (float32, blocks of 16)
        eager = TorchExecutor(load_checkpoint(checkpoint), device="cpu", dtype="float32", block_size=16)
        reference, reference_events = engine_for(eager, tokenizer, sliding=False)
        assert got == conversation(reference, reference_events)
    finally:
        paged_executor.close()
        full_executor.close()

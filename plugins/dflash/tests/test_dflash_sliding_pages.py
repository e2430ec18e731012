"""DFlash's context store follows the engine's sliding pages (``--sliding-window-kv``): with
the draft proposing and the torch executor on the CPU keeping only its sliding layers'
window, a named session of several turns, rewinds past the window (recomputing only the
sliding layers' K/V, which the store does not take again) and side-by-side requests answer
exactly as the plain engine keeping every position, and the draft's store holds the context
it holds with every position kept."""

from __future__ import annotations

import pytest
import torch

from dflash_support import build_reference_draft, save_draft
from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.plugins.specs import ExecutorOptions
from musegl_core.testing.engine_runs import Script, done
from musegl_core.testing.engine_runs import conversation as run_script
from musegl_cuda.executor import TorchExecutor


@pytest.fixture(scope="module")
def demo():
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    path = str(default_model_path())
    return path, MuseTokenizer.load(path)


def engine_for(demo, draft: str | None, sliding: bool, executor=None) -> tuple[Engine, list]:
    from musegl_dflash.plugin import create

    path, tokenizer = demo
    if executor is None:
        executor = TorchExecutor(load_checkpoint(path), device="cpu", dtype="float32", block_size=16)
    speculator = None if draft is None else create(executor, ExecutorOptions(model=path, extra={"dflash": draft}))
    events: list = []
    config = EngineConfig(max_context=512, max_sessions=4, max_inflight_requests=4, max_decode_sequences=4,
                          max_prefill_chunk=32, kv_blocks=120, sliding_window_kv=sliding)
    return Engine(executor, tokenizer, config, events.append, speculator=speculator), events


#: turns of 12 ids, a rewind to 150 (the window (32) of 150 left the device), "b" generating 20
SCRIPT = Script(turns=(70, 41, 37), reply=12, rewinds=(("rewind_late", 150, 8, 6),), side_tokens=20)


def conversation(engine: Engine, events: list) -> dict[str, list[int]]:
    return run_script(engine, events, SCRIPT)


def test_dflash_with_sliding_pages_answers_as_the_plain_engine(demo, tmp_path):
    draft = str(save_draft(build_reference_draft(), tmp_path / "draft"))
    plain, plain_events = engine_for(demo, None, sliding=False)
    paged, paged_events = engine_for(demo, draft, sliding=True)
    assert paged.pool.companions == 3 and paged.speculator.max_draft > 0  # 3 sliding layers, 1 full
    assert conversation(paged, paged_events) == conversation(plain, plain_events)
    assert paged.scheduler.verify_blocks > 0  # the draft's blocks were verified
    # 150 - 32 = 118 is in the block from 112; 3 sliding layers reach 96 positions: from 112 - 64 = 48
    assert done(paged_events, "rewind_late").cached_tokens == 48 and paged.scheduler.window_rows == 150 - 48
    # the store holds the session's context as with every position kept (the recomputed rows were
    # not stored again: their target features past the first sliding layer are not exact)
    kept, kept_events = engine_for(demo, draft, sliding=False)
    conversation(kept, kept_events)
    assert store_rows(paged).shape[2] == len(paged.sessions.named["chat"].tokens) > 150
    torch.testing.assert_close(store_rows(paged), store_rows(kept), atol=1e-5, rtol=1e-4)


def store_rows(engine: Engine) -> torch.Tensor:
    """The draft's context K/V of every position the "chat" session holds, in position order."""
    session = engine.sessions.named["chat"]
    size = engine.pool.block_size
    slots = [session.slot.blocks[p // size] * size + p % size for p in range(len(session.tokens))]
    return engine.speculator.kv[:, :, slots]


@pytest.mark.slow  # spawns two rank processes (gloo on the CPU)
def test_dflash_on_tensor_parallel_ranks_follows_the_sliding_pages(demo, tmp_path):
    """The draft hosted on two ranks (``RankSpeculator``) keeps its store in the pages' block ids
    too (each rank's DFlashSpeculator, whose store the test above compares): the engine accepts
    it with --sliding-window-kv and the conversation answers as the plain engine."""
    from musegl_cuda.parallel.executor import TensorParallelExecutor
    from musegl_cuda.parallel.rank import RankSpec

    draft = str(save_draft(build_reference_draft(), tmp_path / "draft"))
    plain, plain_events = engine_for(demo, None, sliding=False)
    parallel = TensorParallelExecutor(RankSpec(demo[0], "cpu", 2, dtype="float32"))
    try:
        paged, paged_events = engine_for(demo, draft, sliding=True, executor=parallel)
        assert paged.pool.companions == 3 and paged.speculator.follows_sliding_pages
        assert conversation(paged, paged_events) == conversation(plain, plain_events)
        assert done(paged_events, "rewind_late").cached_tokens == 48 and paged.scheduler.window_rows == 150 - 48
        assert paged.scheduler.verify_blocks > 0
    finally:
        parallel.close()

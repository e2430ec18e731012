"""Sliding layers keep their window on MLX (the engine's sliding pages, docs/engine.md): a
named session of several turns, rewinds past the window (which recompute only the sliding
layers' K/V of (sliding layers x window) positions) and side-by-side requests answer exactly
as the MLX executor keeping every position of every layer, on the tiny reference model."""

from __future__ import annotations

import pytest

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.testing.engine_runs import conversation, done
from musegl_mlx.executor import MLXExecutor
from musegl_mlx.loader import checkpoint_weights

BLOCK = 4  # the tiny reference model's window is 8: two blocks


@pytest.fixture(scope="module")
def tokenizer():
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(str(default_model_path()))


def engine_for(path, tokenizer, sliding: bool, kv_cache_dtype: str = "auto", host: int = 0) -> tuple[Engine, list]:
    checkpoint = load_checkpoint(path)
    executor = MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype="float32",
                           block_size=BLOCK, kv_cache_dtype=kv_cache_dtype)
    checkpoint.close()
    events: list = []
    config = EngineConfig(max_context=256, max_sessions=4, max_inflight_requests=4, max_decode_sequences=4,
                          max_prefill_chunk=16, kv_blocks=200, sliding_window_kv=sliding,
                          kv_offload_memory=host)  # 0, no host tier: rewinds past the window recompute it
    return Engine(executor, tokenizer, config, events.append), events


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_mlx_sliding_pages_answer_as_every_position_kept(tiny_hf, tokenizer, kv_cache_dtype):
    full, full_events = engine_for(tiny_hf.path, tokenizer, sliding=False, kv_cache_dtype=kv_cache_dtype)
    paged, paged_events = engine_for(tiny_hf.path, tokenizer, sliding=True, kv_cache_dtype=kv_cache_dtype)
    assert paged.pool.companions == 2  # 4 sliding layers: 2 groups of 2
    assert conversation(paged, paged_events) == conversation(full, full_events)
    # to 85: the window's block starts at 76, 76 - 3 x 8 = 52; to 30: from 0 (blocks of 4, window 8)
    assert done(paged_events, "rewind_late").cached_tokens == 52 < done(full_events, "rewind_late").cached_tokens
    assert paged.scheduler.window_rows == (85 - 52) + 30
    blocks = paged.sessions.named["chat"].slot.blocks
    kept = [b for b in blocks if paged.pool.companion_pages(b) is not None]
    assert len(blocks) >= 10 and len(kept) <= 3


def test_mlx_rewinds_past_the_window_restore_the_sliding_pages_from_the_host_tier(tiny_hf, tokenizer):
    """With a host tier, the sliding pages that leave the window go down to it, and the same
    rewinds bring them back: every position reused, nothing recomputed, the same answers."""
    full, full_events = engine_for(tiny_hf.path, tokenizer, sliding=False)
    paged, paged_events = engine_for(tiny_hf.path, tokenizer, sliding=True, host=1 << 20)
    assert paged.host is not None
    assert conversation(paged, paged_events) == conversation(full, full_events)
    for rid in ("rewind_late", "rewind"):
        assert done(paged_events, rid).cached_tokens == done(full_events, rid).cached_tokens
    stats = paged.stats()
    assert paged.scheduler.window_rows == 0 and stats["kv_window_restores"] == 2

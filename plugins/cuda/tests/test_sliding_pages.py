"""Sliding layers keep their window (the engine's sliding pages, docs/engine.md) over the
torch executor on the CPU: sessions whose histories run many windows long answer exactly
as with every position of every layer kept, and as transformers' greedy generate; their
sliding pages out of the window go back to the pool; a rewind whose window left the
device recomputes the sliding layers' K/V of (sliding layers x window) positions, never
the whole history, and answers exactly as with every position kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_core.testing.engine_runs import conversation, done, ids
from musegl_cuda.executor import TorchExecutor

BLOCK = 4  # the tiny reference model's window is 8: two blocks


@pytest.fixture(scope="module", params=["hf", "gguf"])
def checkpoint(request, tiny_hf, tiny_gguf):
    return load_checkpoint(tiny_hf.path if request.param == "hf" else tiny_gguf)


def engine_for(checkpoint, tokenizer, sliding: bool, kv_cache_dtype: str = "auto", executor=None,
               block_size: int = BLOCK) -> tuple[Engine, list]:
    if executor is None:
        executor = TorchExecutor(checkpoint, device="cpu", dtype="float32", block_size=block_size,
                                 kv_cache_dtype=kv_cache_dtype)
    events: list = []
    config = EngineConfig(max_context=256, max_sessions=4, max_inflight_requests=4, max_decode_sequences=4,
                          max_prefill_chunk=16, kv_blocks=200, sliding_window_kv=sliding,
                          kv_offload_memory=0)  # no host tier: rewinds recompute (test_window_restore.py: restore)
    return Engine(executor, tokenizer, config, events.append), events


def cached(events, rid: str) -> int:
    return done(events, rid).cached_tokens


def test_sliding_pages_answer_as_every_position_kept_and_free_the_window(checkpoint, tokenizer):
    full, full_events = engine_for(checkpoint, tokenizer, sliding=False)
    paged, paged_events = engine_for(checkpoint, tokenizer, sliding=True)
    assert full.pool.companions == 0 and paged.pool.companions == 2  # 4 sliding layers: 2 groups of 2
    expected = conversation(full, full_events)
    assert conversation(paged, paged_events) == expected
    for turn in ("t2", "t3"):  # each turn extends the last: its whole history is reused
        assert cached(paged_events, turn) == cached(full_events, turn) > 40
    # Rewinds whose window left the device recompute only the sliding layers' K/V, from the block
    # (sliding layers x window) positions before the block of the window: to 85, from 52 (window 8,
    # blocks of 4, 4 sliding layers: the window's block starts at 76, 76 - 3 x 8 = 52); to 30, from 0.
    assert cached(full_events, "rewind_late") == 85 and cached(paged_events, "rewind_late") == 52
    assert cached(paged_events, "rewind") == 0 < cached(full_events, "rewind")
    assert paged.scheduler.window_rows == (85 - 52) + 30 and full.scheduler.window_rows == 0
    # The idle session keeps every block of its full layers and, of its sliding layers, only the
    # blocks the window reaches.
    session = paged.sessions.named["chat"]
    blocks = session.slot.blocks
    kept = [b for b in blocks if paged.pool.companion_pages(b) is not None]
    assert len(blocks) >= 10 and len(kept) <= 3
    assert len(full.sessions.named["chat"].slot.blocks) == len(blocks) == full.pool.used_blocks
    assert paged.pool.used_blocks == len(blocks) + 2 * len(kept)  # pages: every block, 2 sliding pages of few


def test_a_long_prompt_matches_transformers_with_sliding_pages(tiny_hf, tokenizer):
    from test_parity import reference_greedy

    engine, events = engine_for(load_checkpoint(tiny_hf.path), tokenizer, sliding=True)
    prompt = ids(7, 61)
    engine.submit(PreparedRequest(id="r", prompt_ids=tuple(prompt), max_tokens=24, ignore_eos=True,
                                  sampling=GREEDY))
    engine.run_until_idle()
    assert list(done(events, "r").generated_ids) == reference_greedy(tiny_hf.model, prompt, 24)


def test_fp8_kv_with_sliding_pages_answers_as_fp8_kv_with_every_position_kept(tiny_gguf, tokenizer):
    """The two KV savings together: FP8 pages of sliding layers keep their window and read
    exactly what FP8 KV with every position kept reads (the same quantized bytes)."""
    checkpoint = load_checkpoint(tiny_gguf)
    full, full_events = engine_for(checkpoint, tokenizer, sliding=False, kv_cache_dtype="fp8")
    paged, paged_events = engine_for(checkpoint, tokenizer, sliding=True, kv_cache_dtype="fp8")
    assert paged.pool.companions == 2
    assert conversation(paged, paged_events) == conversation(full, full_events)


def test_the_forward_reads_each_group_s_pages_and_a_rewind_recomputes_only_the_sliding_layers(tiny_hf):
    """The CPU path's forward (the same check runs the CUDA path's in Triton's interpreter below)."""
    from sliding_page_checks import check_sliding_pages

    found = check_sliding_pages(str(tiny_hf.path), paged=False)
    assert found["worst"] < 1e-5 and found["recomputed"] == 60 - 28  # window 8, 4 sliding layers, blocks of 4


@pytest.mark.slow  # Triton's interpreter over the tiny model's 6 layers (~1-2 min on two shared cores)
def test_the_triton_kernels_read_each_group_s_pages_in_the_interpreter(tiny_hf):
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); from sliding_page_checks import check_sliding_pages; "
            f"found = check_sliding_pages({str(tiny_hf.path)!r}, paged=True); "
            "assert found['worst'] < 1e-4 and found['recomputed'] == 32, found; print(found)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow  # spawns two rank processes (gloo on the CPU)
def test_tensor_parallel_ranks_follow_the_sliding_pages(tiny_hf, tokenizer):
    """Two ranks (one KV head each) keep their sliding layers' window in pages of layer groups:
    the conversation, rewinds past the window included, answers as one executor keeping every
    position (blocks of 16, the ranks' size)."""
    from musegl_cuda.parallel.executor import TensorParallelExecutor
    from musegl_cuda.parallel.rank import RankSpec

    checkpoint = load_checkpoint(tiny_hf.path)
    full, full_events = engine_for(checkpoint, tokenizer, sliding=False, block_size=16)
    expected = conversation(full, full_events)
    parallel = TensorParallelExecutor(RankSpec(str(tiny_hf.path), "cpu", 2, dtype="float32"))
    try:
        paged, paged_events = engine_for(checkpoint, tokenizer, sliding=True, executor=parallel)
        assert paged.pool.companions == 2
        assert conversation(paged, paged_events) == expected
        # to 85: the window's block starts at 64, 64 - 3 x 8 = 40, in the block from 32; to 30: from 0
        assert cached(paged_events, "rewind_late") == 32 and paged.scheduler.window_rows == (85 - 32) + 30
    finally:
        parallel.close()


def test_a_model_whose_layers_form_no_groups_refuses_the_flag_in_one_line(tmp_path, tokenizer):
    """Two full layers and three sliding ones: no groups of as many layers (docs/engine.md), so
    --sliding-window-kv is refused at start-up in one line rather than accepted and ignored."""
    from musegl_core.errors import ConfigError
    from musegl_core.testing.reference_models import build_tiny_model

    kinds = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    build_tiny_model(seed=6, num_hidden_layers=5, layer_types=kinds).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as refused:
        engine_for(load_checkpoint(tmp_path), tokenizer, sliding=True)
    message = str(refused.value)
    assert "--sliding-window-kv" in message and "TorchExecutor" in message and "\n" not in message
    assert engine_for(load_checkpoint(tmp_path), tokenizer, sliding=False)[0].pool.companions == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_forward_and_engine_follow_the_sliding_pages_on_a_gpu(tiny_hf, tokenizer):
    """On a GPU: the forward check through the Triton kernels compiled for the card, and the
    conversation (turns, rewinds past the window, side-by-side requests) through the engine
    with sliding pages answering as without them (the CUDA path both times, float32)."""
    from sliding_page_checks import check_sliding_pages

    found = check_sliding_pages(str(tiny_hf.path), paged=True, device="cuda")
    assert found["worst"] < 1e-3 and found["recomputed"] == 32

    def cuda_engine(sliding: bool):
        executor = TorchExecutor(load_checkpoint(tiny_hf.path), device="cuda", dtype="float32", block_size=BLOCK)
        return engine_for(None, tokenizer, sliding=sliding, executor=executor)

    full, full_events = cuda_engine(False)
    paged, paged_events = cuda_engine(True)
    assert paged.pool.companions == 2
    assert conversation(paged, paged_events) == conversation(full, full_events)
    assert cached(paged_events, "rewind_late") == 52 and paged.scheduler.window_rows == (85 - 52) + 30

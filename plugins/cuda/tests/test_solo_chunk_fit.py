"""The CUDA executor's lone-prompt chunk: the bytes a prompt row holds at the 30B shape, and
``_fit_solo_chunk`` lowering the chunk (and the widest step) to the device memory left beside
the KV pool. The device's memory query is replaced by given figures, so this runs on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import MuseGlimmerTextConfig

from musegl_core.checkpoint.hf_reader import text_config_dict, text_config_from_dict
from musegl_core.engine.executor import ExecutorLimits
from musegl_cuda.executor import CUDA_PREFILL_CHUNK, CUDA_SOLO_PREFILL_CHUNK, TorchExecutor, prefill_row_bytes

CONFIG_30B = text_config_from_dict(text_config_dict(MuseGlimmerTextConfig().to_dict(), "MuseGlimmerTextConfig()"))
GIB = 1 << 30


def test_a_prompt_row_at_the_30b_shape():
    # the figures docs/engine.md and the executor's docstrings give: ~269 KB, ~436 KB with DFlash's 5 taps
    assert prefill_row_bytes(CONFIG_30B, torch.bfloat16) == 268_800
    assert prefill_row_bytes(CONFIG_30B, torch.bfloat16, taps=5) == 435_200
    assert prefill_row_bytes(CONFIG_30B, torch.float32) == 2 * 268_800


def fitted(monkeypatch, free: int, reserved_unused: int = 0, taps: tuple[int, ...] = ()) -> ExecutorLimits:
    """The limits ``_fit_solo_chunk`` leaves on an executor built as the CUDA one starts."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * GIB + reserved_unused)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * GIB)
    executor = object.__new__(TorchExecutor)  # only what the fit reads
    executor.config, executor.dtype, executor.taps = CONFIG_30B, torch.bfloat16, taps
    executor.device = torch.device("cpu")
    executor._step_floor = 4096
    executor.limits = ExecutorLimits(max_step_tokens=CUDA_SOLO_PREFILL_CHUNK, prefill_chunk=CUDA_PREFILL_CHUNK,
                                     solo_prefill_chunk=CUDA_SOLO_PREFILL_CHUNK)
    executor._fit_solo_chunk()
    return executor.limits


def test_room_for_the_whole_chunk_keeps_it(monkeypatch):
    limits = fitted(monkeypatch, free=20 * GIB)  # 32,768 rows need ~8.2 GiB
    assert (limits.solo_prefill_chunk, limits.max_step_tokens) == (CUDA_SOLO_PREFILL_CHUNK, CUDA_SOLO_PREFILL_CHUNK)


@pytest.mark.parametrize("taps", [(), (1, 13, 26, 39, 50)])
def test_less_room_lowers_the_chunk_and_the_widest_step_in_steps_of_1024(monkeypatch, taps):
    free = 3 * GIB
    limits = fitted(monkeypatch, free=free - GIB, reserved_unused=GIB, taps=taps)  # the allocator's cache counts
    rows = free // prefill_row_bytes(CONFIG_30B, torch.bfloat16, len(taps)) // 1024 * 1024
    assert rows < CUDA_SOLO_PREFILL_CHUNK and rows % 1024 == 0
    assert (limits.solo_prefill_chunk, limits.max_step_tokens) == (rows, max(4096, rows))
    assert rows == (11264 if not taps else 7168)  # the taps' rows cost more


def test_never_below_the_prefill_chunk_nor_the_decode_steps(monkeypatch):
    limits = fitted(monkeypatch, free=64 << 20)
    assert limits.solo_prefill_chunk == CUDA_PREFILL_CHUNK
    assert limits.max_step_tokens == 4096  # the widest step the executor took before the lone-prompt chunk

"""The KV-bytes arithmetic (engine/kv_memory.py): the start-up room line, the 30B
capacity table docs/engine.md prints (the same code computes it), and the ratio
sliding-aware KV gives the tiny converter-written model."""

from __future__ import annotations

import logging
import pathlib

import pytest

from musegl_core.engine import kv_memory as km

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def test_the_docs_table_is_what_the_code_computes():
    assert km.capacity_table() in DOCS.read_text()


def test_the_30b_figures():
    shape = km.GLIMMER_30B
    assert km.position_bytes(shape, 2) == 52 * 1024  # 52 KiB a position in bf16
    assert round(km.glimmer_30b_weight_bytes() / 1e9, 1) == 55.7  # the bf16 checkpoint's 55.7 GB
    today = km.session_bytes(shape, km.CONTEXT, 2)
    aware = km.session_bytes(shape, km.CONTEXT, 2, sliding_aware=True)
    # 13 full layers keep every position, 39 sliding ones 129 blocks of 16 (2,064 positions)
    assert aware == 1024 * (13 * km.CONTEXT + 39 * 2064)
    assert today == 52 * 1024 * km.CONTEXT and 3.8 < today / aware < 3.9
    assert km.session_bytes(shape, km.CONTEXT, 1, sliding_aware=True) * 2 == aware  # FP8 halves it
    assert km.element_bytes("auto", 2) == 2 and km.element_bytes("fp8", 2) == 1
    with pytest.raises(ValueError):
        km.element_bytes("int4", 2)


def test_sliding_aware_sessions_of_the_tiny_model():
    # 4 layers, 3 sliding with window 8, blocks of 4 (musegl_core/tiny.py): histories of 40 windows
    shape = km.KVShape(num_layers=4, sliding_layers=3, num_kv_heads=2, head_dim=16, window=8, block_size=4)
    memory = 200 * km.session_bytes(shape, 320, 4)
    today = km.sessions_held(memory, shape, 320, 4)
    aware = km.sessions_held(memory, shape, 320, 4, sliding_aware=True)
    # one full layer keeps 320 positions, three sliding ones 12 each (3 blocks): 320 x 4 / (320 + 36)
    assert today == 200 and aware == 719 and 2.5 * today <= aware < 4 * today


def test_the_room_line_states_positions_and_sessions(caplog):
    line = km.room_line(device_blocks=13233, block_size=16, block_bytes=16 * 53248, max_context=131072)
    assert "211,728 positions" in line and "1 session of --max-context 131,072" in line and "host tier: none" in line
    host = km.room_line(device_blocks=100, block_size=16, block_bytes=1024, max_context=64, host_bytes=64 * 1024)
    assert "host tier 64.00 KiB = 1,024 positions = 16 sessions of --max-context 64" in host


def test_the_engine_logs_its_room_at_start_up(caplog):
    from musegl_core.engine.engine import Engine, EngineConfig
    from musegl_core.testing.example_executor import ExampleExecutor

    class Tok:
        end_of_generation_ids = ()
        eot_id = 1

    with caplog.at_level(logging.INFO, logger="musegl.engine"):
        Engine(ExampleExecutor(64), Tok(), EngineConfig(max_context=64, kv_blocks=40), lambda e: None)
    assert any("KV room: device 1.25 KiB = 160 positions (40 blocks of 4) = 2 sessions of --max-context 64"
               in r.message for r in caplog.records)

"""The start-up fit arithmetic (musegl_core.engine.fit): weights + KV at the limits against
the device's memory, its one line, and the flags a refusal names."""

from __future__ import annotations

import pytest

from musegl_core.checkpoint.hf_reader import TEXT_CONFIG_DEFAULTS, text_config_from_dict
from musegl_core.engine.fit import Fit, MemoryPlan, matrix_bytes, q4_k_m_bytes, q4_k_m_types, use_more_bits
from musegl_core.engine.kv_sizing import GIB, kv_block_bytes

#: the released 30B shape (transformers' defaults: 52 layers, hidden 6656, vocab 202048)
SHAPE_30B = text_config_from_dict(dict(TEXT_CONFIG_DEFAULTS))
CUDA_RESERVE = 1 << 30  # musegl_cuda.memory_plan.CUDA_RESERVE (the core test does not import the plugin)


def test_llama_cpp_gives_more_bits_to_an_eighth_at_each_end_and_every_third_layer_between():
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def test_the_30b_q4_k_m_file_is_about_17_gb():
    by_type = q4_k_m_bytes(SHAPE_30B)
    assert set(by_type) == {"q4_k", "q6_k"}
    total = sum(by_type.values())
    assert 16.5e9 < total < 17.5e9, total
    # the head, and attn_v and ffn_down of 26 of the 52 layers (6 first, 7 last, 13 between), are Q6_K
    types = q4_k_m_types(SHAPE_30B)
    assert types["output.weight"] == "q6_k" and types["token_embd.weight"] == "q4_k"
    assert sum(t == "q6_k" for n, t in types.items() if n.endswith("ffn_down.weight")) == 26


def test_the_30b_shape_at_q4_k_m_with_a_32k_context_fits_24_gib():
    """Weights 15.75 GiB + bfloat16 KV for one 32K conversation (1.62 GiB) + a 1 GiB
    reserve fit a 24 GiB card with room to spare; four such sessions fit too."""
    per_token = kv_block_bytes(SHAPE_30B, 16, 2) / 16
    plan = MemoryPlan("cuda:0", 24 * GIB, q4_k_m_bytes(SHAPE_30B), reserve=CUDA_RESERVE)
    one = Fit(plan, per_token, max_sessions=1, max_context=32768)
    assert one.fits and one.room - one.kv_needed > 5 * GIB
    line = one.line()
    assert "weights 15.75 GiB on cuda:0" in line and "q4_k 12.05 GiB" in line and "q6_k 3.70 GiB" in line
    assert "one 32768-token request" in line and "KV room 7.25 GiB of 24.00 GiB" in line
    # blocks on demand: the room is counted in positions and in sessions of --max-context (4.5 here)
    assert one.kv_positions == int(one.room // per_token) and "4.5 sessions of --max-context" in line
    assert Fit(plan, per_token, max_sessions=4, max_context=32768).fits


def test_a_model_that_does_not_fit_says_so_with_the_numbers_and_the_flags_that_help():
    """bfloat16 weights of the 30B shape (55.6 GiB) on a 24 GiB card: nothing of the KV
    side helps, the lighter weight form does; a Q4_K_M file with a context longer than its
    KV room: the line names the --max-context that fits and the lighter KV dtype."""
    per_token = kv_block_bytes(SHAPE_30B, 16, 2) / 16
    bf16 = sum(matrix_bytes("bf16", r, c) for r, c in _shapes().values())
    plan = MemoryPlan("cuda:0", 24 * GIB, {"bfloat16": bf16}, reserve=CUDA_RESERVE,
                      alternatives=(("--weights stored", sum(q4_k_m_bytes(SHAPE_30B).values())),))
    fit = Fit(plan, per_token, max_sessions=1, max_context=32768)
    assert not fit.fits
    line = fit.refusal()
    assert "\n" not in line and line.startswith("the model does not fit cuda:0: weights 51.")
    assert "--weights stored (weights 15.75 GiB: fits)" in line and "--max-context" not in line

    crowded = Fit(MemoryPlan("cuda:0", 24 * GIB, q4_k_m_bytes(SHAPE_30B), reserve=CUDA_RESERVE), per_token,
                  max_sessions=8, max_context=8 * 32768, kv_flags=(("--kv-cache-dtype fp8", 0.5),))
    assert not crowded.fits  # one 262,144-position request: 13.0 GiB of bfloat16 KV, 7.25 GiB of room
    flags = crowded.helpful_flags()
    assert flags[0].startswith("--max-context ") and int(flags[0].split()[1]) * per_token <= crowded.room
    assert flags[1] == "--kv-cache-dtype fp8"  # 13.0 GiB of bfloat16 KV halved: 6.5 of the 7.25 GiB room


def test_unknown_device_memory_always_fits_and_says_so():
    fit = Fit(MemoryPlan("cpu", None, {"f16": 10 * GIB}), 1024, max_sessions=4, max_context=8192)
    assert fit.fits and fit.line().endswith("device memory unknown")


@pytest.mark.parametrize("cap, fits", [(2 * GIB, True), (8 * GIB, False)])
def test_a_kv_cache_memory_cap_is_the_kv_side(cap, fits):
    fit = Fit(MemoryPlan("cuda:0", 24 * GIB, q4_k_m_bytes(SHAPE_30B), reserve=CUDA_RESERVE), 53248,
              max_sessions=1, max_context=32768, kv_cap=cap)
    assert fit.fits is fits and "(--kv-cache-memory)" in fit.line()
    if not fits:
        assert fit.helpful_flags()[0] == "--kv-cache-memory 7.25 GiB"


def _shapes():
    from musegl_core.engine.fit import decoder_matrix_shapes

    return decoder_matrix_shapes(SHAPE_30B)

"""The tensor-parallel sharding plan and the shared-memory step channel (no rank processes: fast).

The plan: which heads, KV heads, MLP columns and vocabulary rows each rank holds, the
sizes it refuses, and that the stored-form slices (rows, and columns on quantization
block boundaries, or decoded where a rank's columns cut a block) hold exactly the
values of the same slice of the whole weight. The channel: messages reach every
reader in order, inline or through a segment of their own, and a dead peer ends a
wait with PeerGone.
"""

from __future__ import annotations

import copy
import multiprocessing
import threading
import time

import gguf
import numpy as np
import pytest
import torch

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.stored import StoredTensor
from musegl_cuda.parallel.channel import PeerGone, StepChannel
from musegl_cuda.parallel.shard import ShardPlan, Span, check_size

LAYERS = 4


def config(heads=8, kv=2, ffn=256, vocab=1000, hd=32) -> TextConfig:
    layout = TextConfig.default_layout(LAYERS)
    return TextConfig(vocab_size=vocab, hidden_size=128, intermediate_size=ffn, num_layers=LAYERS, num_heads=heads,
                      num_kv_heads=kv, head_dim=hd, sliding_window=16, sliding=layout, rope=layout)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_every_head_and_column_is_held_once_and_kv_heads_follow_their_queries(size):
    c = config()
    plans = [ShardPlan.of(c, size, r) for r in range(size)]
    assert [p.heads for p in plans] == [Span(r * 8 // size, (r + 1) * 8 // size) for r in range(size)]
    assert sum(p.ffn.size for p in plans) == 256 and plans[-1].ffn.stop == 256
    assert sum(p.vocab.size for p in plans) == 1000 and all(p.vocab_per_rank == -(-1000 // size) for p in plans)
    group = c.num_heads // c.num_kv_heads
    for p in plans:
        # every query head of the rank reads a KV head the rank holds
        assert all(p.kv_heads.start <= h // group < p.kv_heads.stop for h in range(p.heads.start, p.heads.stop))
        local = p.local_config(c)
        assert local.num_heads == 8 // size and local.num_kv_heads == max(1, 2 // size)
        assert (local.vocab_size, local.hidden_size, local.num_layers) == (1000, 128, LAYERS)
    if size > 2:  # fewer KV heads than ranks: each replicated on size // 2 ranks
        assert [p.kv_heads.start for p in plans] == [r * 2 // size for r in range(size)]


def test_sizes_that_do_not_split_the_model_are_refused():
    check_size(config(), 8)
    with pytest.raises(ValueError, match="must divide the 8 attention heads"):
        check_size(config(), 3)
    with pytest.raises(ValueError, match="one must divide the other"):
        check_size(config(heads=12, kv=4), 6)
    with pytest.raises(ValueError, match="MLP width"):
        check_size(config(ffn=250), 4)
    with pytest.raises(ValueError, match="at least 1"):
        check_size(config(), 0)


def test_a_single_rank_plan_slices_nothing():
    plan = ShardPlan.of(config())
    w = torch.zeros(3, 4)
    assert plan.split("layers.0.self_attn.o_proj.weight") == (None, None) and plan.dense("lm_head.weight", w) is w
    assert plan.local_config(config()) == config()


def dense_cases(plan: ShardPlan, c: TextConfig):
    hd = c.head_dim
    return {
        "embed_tokens.weight": ((c.vocab_size, 128), plan.vocab.slice, None),
        "layers.1.self_attn.q_proj.weight": ((8 * hd, 128), plan.heads.scaled(hd).slice, None),
        "layers.1.self_attn.gate_proj.weight": ((8 * hd, 128), plan.heads.scaled(hd).slice, None),
        "layers.1.self_attn.k_proj.weight": ((2 * hd, 128), plan.kv_heads.scaled(hd).slice, None),
        "layers.1.self_attn.o_proj.weight": ((128, 8 * hd), None, plan.heads.scaled(hd).slice),
        "layers.1.mlp.up_proj.weight": ((256, 128), plan.ffn.slice, None),
        "layers.1.mlp.down_proj.weight": ((128, 256), None, plan.ffn.slice),
    }


def test_dense_weights_keep_their_rows_or_columns():
    c = config()
    plan = ShardPlan.of(c, 4, 3)
    for name, (shape, rows, cols) in dense_cases(plan, c).items():
        w = torch.randn(shape)
        part = plan.dense(name, w)
        want = w[rows if rows is not None else slice(None)][:, cols if cols is not None else slice(None)]
        assert torch.equal(part, want), name
    norm = torch.randn(128)
    assert plan.dense("layers.0.input_layernorm.weight", norm) is norm


def quantized(name: str, values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> StoredTensor:
    data = gguf.quants.quantize(values, qtype)
    return StoredTensor(name, qtype.name.lower(), values.shape, np.asarray(data, dtype=np.uint8))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0,
                                   gguf.GGMLQuantizationType.Q4_0])
@pytest.mark.parametrize("size", [2, 4])
def test_stored_slices_hold_the_values_of_the_whole_weights_slice(qtype, size):
    c = config()
    rng = np.random.default_rng(0)
    for rank in range(size):
        plan = ShardPlan.of(c, size, rank)
        for name, (shape, rows, cols) in dense_cases(plan, c).items():
            values = rng.standard_normal(shape).astype(np.float32)
            if qtype == gguf.GGMLQuantizationType.F16:
                whole = StoredTensor(name, "f16", shape, values.astype(np.float16))
            else:
                whole = quantized(name, values, qtype)
            part = plan.stored(whole)
            expected = whole.to_float32()[rows if rows is not None else slice(None)][
                :, cols if cols is not None else slice(None)]
            assert part.shape == expected.shape, name
            assert np.array_equal(part.to_float32(), expected), (name, rank)
            assert part.dtype == whole.dtype  # every split here lies on 32-value block boundaries


def test_columns_that_cut_a_block_are_decoded_to_float32():
    c = config(heads=8, kv=8, hd=16)  # o_proj (128, 128): 32 columns a rank at 4 ranks, 16 at 8
    values = np.random.default_rng(1).standard_normal((128, 128)).astype(np.float32)
    whole = quantized("layers.0.self_attn.o_proj.weight", values, gguf.GGMLQuantizationType.Q8_0)
    part = ShardPlan.of(c, 8, 1).stored(whole)  # half a 32-value Q8_0 block
    assert part.dtype == "f32" and part.shape == (128, 16)
    assert np.array_equal(part.to_float32(), whole.to_float32()[:, 16:32])
    assert ShardPlan.of(c, 4, 1).stored(whole).dtype == "q8_0"  # whole blocks stay quantized


def test_messages_reach_every_reader_in_order_inline_or_in_their_own_segment():
    ctx = multiprocessing.get_context("spawn")
    channel = StepChannel.create(ctx, readers=2, slots=2, slot_bytes=256)
    big = np.arange(10_000, dtype=np.int64)  # larger than a slot
    messages = [("step", i) for i in range(5)] + [("big", big)] + [("after", 1)]
    got: dict[int, list] = {0: [], 1: []}
    deadline = time.monotonic() + 20
    in_time = lambda: time.monotonic() < deadline  # noqa: E731

    def reader(r: int) -> None:
        mine = copy.copy(channel)  # each reader's own count, as each rank process has
        for _ in messages:
            got[r].append(mine.read(r, in_time))

    threads = [threading.Thread(target=reader, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for m in messages:  # two slots: the writer waits for both readers to free one
        channel.write(m, in_time)
    for t in threads:
        t.join(10)
    for r in (0, 1):
        assert [m[0] for m in got[r]] == [m[0] for m in messages]
        assert np.array_equal(got[r][5][1], big)
    channel.close()


def test_a_dead_peer_ends_the_wait():
    ctx = multiprocessing.get_context("spawn")
    channel = StepChannel.create(ctx, readers=1, slots=1, slot_bytes=64)
    assert channel.read(0, lambda: True, timeout=0.1) is None  # nothing written: a timeout, not an error
    with pytest.raises(PeerGone):
        channel.read(0, lambda: False)
    channel.write("one", lambda: True)
    with pytest.raises(PeerGone):  # the only slot is taken and nobody reads it
        channel.write("two", lambda: False)
    assert channel.read(0, lambda: True) == "one"
    channel.close()


def test_serve_refuses_a_size_that_does_not_split_the_model_before_spawning(tiny_hf):
    from musegl_core.errors import ConfigError
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_cuda.plugin import create_torch_cpu

    with pytest.raises(ConfigError, match="--tensor-parallel-size 3 must divide the 4 attention heads"):
        create_torch_cpu(ExecutorOptions(model=str(tiny_hf.path), extra={"tensor_parallel_size": 3}))
    with pytest.raises(ConfigError, match="names one device"):
        create_torch_cpu(ExecutorOptions(model=str(tiny_hf.path), device="cuda:1",
                                         extra={"tensor_parallel_size": 2}))
    with pytest.raises(ConfigError, match="positive integer"):
        create_torch_cpu(ExecutorOptions(model=str(tiny_hf.path), extra={"tensor_parallel_size": 0}))
    with pytest.raises(ConfigError, match="runs on cuda or cpu devices, not meta"):
        create_torch_cpu(ExecutorOptions(model=str(tiny_hf.path), device="meta",
                                         extra={"tensor_parallel_size": 2}))


def test_executors_without_tensor_parallelism_refuse_the_flag(tiny_hf, tmp_path):
    """--tensor-parallel-size is the cuda plugin's flag, but every executor sees it: the
    ones that run one process refuse it in the front instead of serving on one device."""
    from musegl_core.errors import ConfigError
    from musegl_core.plugins.specs import ExecutorOptions

    options = ExecutorOptions(model=str(tiny_hf.path), extra={"tensor_parallel_size": 2})
    checks = []
    try:
        from musegl_mlx.plugin import check as mlx_check
        checks.append(("mlx", mlx_check))
    except ImportError:
        pass
    try:
        from musegl_executorch.plugin import check as executorch_check
        checks.append(("executorch", executorch_check))
    except ImportError:
        pass
    assert checks, "neither the mlx nor the executorch plugin is installed"
    for name, check in checks:
        with pytest.raises(ConfigError, match=f"--tensor-parallel-size: the {name} executor"):
            check(options)
    if checks[0][0] == "mlx":  # at size 1 the core's check applies as before (this fixture has no tokenizer)
        with pytest.raises(ConfigError, match="no tokenizer.json"):
            checks[0][1](ExecutorOptions(model=str(tiny_hf.path), extra={"tensor_parallel_size": 1}))


def test_the_kv_layout_before_loading_is_what_the_ranks_report(tiny_hf):
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_cuda.plugin import kv_layout

    one = kv_layout(ExecutorOptions(model=str(tiny_hf.path)), "cpu")[0]  # 2 KV heads
    two = ExecutorOptions(model=str(tiny_hf.path), extra={"tensor_parallel_size": 2})
    four = ExecutorOptions(model=str(tiny_hf.path), extra={"tensor_parallel_size": 4})
    # each rank one KV head: on the CPU the ranks' shares add up (4 ranks: each KV head twice)
    assert kv_layout(two, "cpu")[0] == one and kv_layout(four, "cpu")[0] == 2 * one
    # on CUDA each device holds its own share, in bfloat16 (the CUDA default): a quarter
    assert kv_layout(two, "cuda")[0] == kv_layout(four, "cuda")[0] == one // 4


def test_a_token_tail_is_the_last_ids_and_the_count_and_refuses_the_rest():
    import pickle

    from musegl_cuda.parallel.messages import TokenTail

    tail = pickle.loads(pickle.dumps(TokenTail(40, (7, 9))))
    assert len(tail) == 40 and bool(tail)
    assert (tail[-1], tail[-2], tail[39], tail[38], tail[-2:]) == (9, 7, 9, 7, [7, 9])
    for index in (0, 37, -3, 40):
        with pytest.raises(IndexError):
            tail[index]
    with pytest.raises(TypeError):
        list(tail)  # never an empty list where the ids did not cross


def test_hosted_drafts_take_a_row_per_request_with_room_in_order():
    from musegl_core.engine.speculator import DraftRequest
    from musegl_cuda.parallel.rank import hosted_rows

    requests = [DraftRequest(5, (1, 2), (0,), 3), DraftRequest(6, (1,), (0,), 0), DraftRequest(7, (), (0,), 2),
                DraftRequest(8, (4, 4, 4), (0,), 9)]
    assert hosted_rows(requests, 7) == ({5: 0, 8: 1}, {5: 3, 8: 7})

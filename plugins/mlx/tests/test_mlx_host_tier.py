"""The host tier over the MLX executor (``--kv-offload-memory``, musegl_mlx/host_kv.py): named
sessions under device-pool pressure move to host pages and come back, greedy-identical to the
same requests on a pool that holds them all, with the same positions reused (restored, never
recomputed); a page's bytes go to a lower tier and back unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine import events as ev
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import GREEDY
from musegl_core.engine.request import PreparedRequest
from musegl_mlx.executor import MLXExecutor
from musegl_mlx.loader import checkpoint_weights

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tiny_hf):
    return load_checkpoint(tiny_hf.path)


@pytest.fixture(scope="module")
def tokenizer():
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(str(default_model_path()))


def executor_for(checkpoint, dtype="float32") -> MLXExecutor:
    return MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype=dtype,
                       block_size=BLOCK)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def agents(engine: Engine, events: list) -> dict:
    out = {}
    histories = {name: ids(seed, 30) for seed, name in enumerate("abc")}
    for turn in range(2):
        for name in "abc":
            rid = f"{name}{turn}"
            engine.submit(PreparedRequest(id=rid, prompt_ids=tuple(histories[name]), max_tokens=6, ignore_eos=True,
                                          sampling=GREEDY, session_id=name, stream=True))
            engine.run_until_idle()
            done = next(e for e in events if isinstance(e, ev.Done) and e.id == rid)
            out[rid] = (tuple(done.generated_ids), done.cached_tokens)
            histories[name] = histories[name] + list(done.generated_ids) + ids(50 + turn, 5)
    engine.submit(PreparedRequest(id="rewind", prompt_ids=tuple(histories["a"][:33] + ids(9, 3)), max_tokens=6,
                                  ignore_eos=True, sampling=GREEDY, session_id="a", stream=True))
    engine.run_until_idle()
    done = next(e for e in events if isinstance(e, ev.Done) and e.id == "rewind")
    out["rewind"] = (tuple(done.generated_ids), done.cached_tokens)
    return out


def test_mlx_sessions_in_the_host_tier_answer_as_on_an_unconstrained_server(checkpoint, tokenizer):
    results, engines = [], []
    for blocks, host in ((200, 0), (24, 1 << 20)):
        events: list = []
        config = EngineConfig(max_context=128, max_sessions=4, max_inflight_requests=2, max_decode_sequences=2,
                              max_prefill_chunk=32, kv_blocks=blocks, kv_offload_memory=host)
        engine = Engine(executor_for(checkpoint), tokenizer, config, events.append)
        results.append(agents(engine, events))
        engines.append(engine)
    assert engines[0].host is None and engines[1].host is not None
    assert results[1] == results[0]
    assert results[0]["a1"][1] > 30 and results[0]["rewind"][1] == 33
    stats = engines[1].stats()
    assert stats["kv_restores"] >= 3 and stats["kv_tier_hit_tokens_host"] > 3 * 30


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_host_pages_bytes_round_trip(checkpoint, dtype):
    ex = executor_for(checkpoint, dtype)
    ex.allocate_kv(4)
    ex.allocate_host_kv(3)
    import mlx.core as mx

    for cache in ex.kv:
        for i, layer in enumerate(cache):
            layer[:] = mx.array(np.random.default_rng(i).standard_normal(layer.shape).astype(np.float32)).astype(
                layer.dtype)
    before = [np.asarray(layer.astype(mx.float32)) for cache in ex.kv for layer in cache]
    ex.offload_pages([(1, 2), (3, 0)])
    data = ex.read_host_pages([2, 0])
    ex.write_host_pages([1, 2], data)  # host page 1 now holds device block 1, host page 2 device block 3
    ex.restore_pages([(1, 0), (2, 1)])
    after = [np.asarray(layer.astype(mx.float32)) for cache in ex.kv for layer in cache]
    for old, new in zip(before, after):
        assert np.array_equal(new[0:4], old[4:8]) and np.array_equal(new[4:8], old[12:16])
        assert np.array_equal(new[8:], old[8:])

"""``--kv-cache-dtype fp8`` on the torch executor's CPU reference path, and (slow) the CUDA
path's FP8 kernels in Triton's interpreter (``kv_fp8_checks.py``; the GPU runs the same
checks in ``test_kv_fp8_gpu.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from step_support import chunk

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_core.engine.kv_dtype import kv_position_bytes
from musegl_core.plugins.specs import ExecutorOptions
from musegl_cuda import kv_fp8
from musegl_cuda.executor import TorchExecutor
from musegl_cuda.plugin import kv_layout

BLOCK = 4


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def executor(path, kv: str = "fp8", blocks: int = 64, **kw) -> TorchExecutor:
    ex = TorchExecutor(load_checkpoint(path), device="cpu", block_size=BLOCK, kv_cache_dtype=kv, **kw)
    ex.allocate_kv(blocks)
    return ex


def prefill_and_decode(ex: TorchExecutor, prompt: list[int], cut: int, blocks: list[int]) -> list[torch.Tensor]:
    """Prefill ``prompt[:cut]`` in one chunk, then one row a step; every row's logits after the prefill."""
    out = ex.step(Step([chunk(1, prompt[:cut], 0, blocks, want_logits=True)]))
    logits = [out.logits[1].clone()]
    for p in range(cut, len(prompt)):
        out = ex.step(Step([chunk(1, [prompt[p]], p, blocks, want_logits=True)]))
        logits.append(out.logits[1].clone())
    return logits


def test_an_fp8_pool_holds_twice_bf16_and_four_times_float32_positions(tiny_hf):
    config = load_checkpoint(tiny_hf.path).config
    assert kv_position_bytes(config, "fp8", 2) * 2 == kv_position_bytes(config, "auto", 2)
    assert kv_position_bytes(config, "fp8", 4) * 4 == kv_position_bytes(config, "auto", 4)
    assert kv_position_bytes(config, "fp8", 4) == 6 * 2 * 2 * 16  # layers x K,V x KV heads x head_dim, 1 byte
    for dtype, ratio in (("bfloat16", 2), ("float32", 4)):
        auto = kv_layout(ExecutorOptions(model=str(tiny_hf.path), dtype=dtype), "cpu")
        fp8 = kv_layout(ExecutorOptions(model=str(tiny_hf.path), dtype=dtype, kv_cache_dtype="fp8"), "cpu")
        assert auto[0] == ratio * fp8[0] and auto[1] == fp8[1]
    ex = executor(tiny_hf.path, blocks=8)
    assert ex.kv.dtype == torch.float8_e4m3fn and ex.kv.element_size() == 1
    assert ex.kv_bytes_per_block() == kv_position_bytes(config, "fp8", 4) * BLOCK
    assert ex.kv.numel() == 8 * ex.kv_bytes_per_block()  # the bytes the pool accounts are the bytes allocated


def test_the_same_kv_cache_memory_holds_four_times_the_sessions_on_the_cpu(tiny_hf):
    """The engine's pool sizing (plan_pool) over the real executors: a --kv-cache-memory that
    holds N float32 blocks holds 4N FP8 blocks, so 4x the sessions of --max-context."""
    from musegl_core.engine.engine import EngineConfig
    from musegl_core.engine.kv_sizing import plan_pool
    from musegl_core.engine.speculator import NoSpeculator

    auto, fp8 = (TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", block_size=16, kv_cache_dtype=kv)
                 for kv in ("auto", "fp8"))
    memory = 128 * auto.kv_bytes_per_block()
    config = EngineConfig(max_context=256, max_sessions=1, kv_cache_memory=memory)
    blocks = {name: plan_pool(config, ex, NoSpeculator()) for name, ex in (("auto", auto), ("fp8", fp8))}
    assert blocks == {"auto": 128, "fp8": 512}
    assert blocks["fp8"] // 16 == 4 * (blocks["auto"] // 16)  # sessions of --max-context 256


def test_the_scales_bound_every_value_and_layer_zero_stores_torch_s_e4m3(tiny_hf):
    """The scales are bounds (no K/V the model writes reaches 448 after scaling), and the first
    layer (whose input does not depend on the cache) stores exactly the e4m3 bytes of the float
    cache's values over the scales."""
    prompt = ids(5, 37)
    blocks = list(range(10))
    auto, fp8 = executor(tiny_hf.path, "auto", 16), executor(tiny_hf.path, "fp8", 16)
    auto.step(Step([chunk(1, prompt, 0, blocks)]))
    fp8.step(Step([chunk(1, prompt, 0, blocks)]))
    scales = fp8.kv_scales
    assert scales.shape == (6, 2, 2) and torch.all(scales[:, 0] == kv_fp8.k_scale(16))
    slots = torch.arange(37)
    for layer in range(6):
        for j in range(2):
            written = auto.kv[layer, j].reshape(-1, 2, 16)[slots]
            assert float((written.abs() / scales[layer, j][:, None]).max()) < 448, (layer, j)
    for j in range(2):
        want = kv_fp8.quantize(auto.kv[0, j].reshape(-1, 2, 16)[slots], scales[0, j])
        got = fp8.kv[0, j].reshape(-1, 2, 16)[slots]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not fp8.kv[:, :, 10:].view(torch.uint8).any()  # blocks nobody wrote stay zero


def test_the_cpu_attention_paths_read_fp8_alike(tiny_hf):
    """Stored mode (the native kernels over dequantized gathers), the per-sequence torch path
    and the batched decode path read the same bytes: their logits agree to float rounding
    (their products round differently, which can move a few K/V elements one e4m3 step)."""
    prompt = ids(6, 30)
    blocks = [9, 2, 14, 5, 11, 0, 7, 3]
    upcast = prefill_and_decode(executor(tiny_hf.path, weights="upcast"), prompt, 20, blocks)
    stored = prefill_and_decode(executor(tiny_hf.path, weights="stored"), prompt, 20, blocks)
    auto = prefill_and_decode(executor(tiny_hf.path, "auto", weights="upcast"), prompt, 20, blocks)
    fp8_error = max(float((a - b).abs().max()) for a, b in zip(upcast, auto))
    paths = max(float((a - b).abs().max()) for a, b in zip(upcast, stored))
    assert fp8_error > 1e-4  # the FP8 cache is in use
    assert paths <= fp8_error / 10, (paths, fp8_error)


def test_copy_blocks_copies_fp8_bytes_and_scales_do_not_depend_on_blocks(tiny_hf):
    ex = executor(tiny_hf.path)
    prompt = ids(7, 8)
    ex.step(Step([chunk(2, prompt, 0, [30, 31])]))
    ex.copy_blocks([(30, 50), (31, 51)])
    assert torch.equal(ex.kv[:, :, 50:52].view(torch.uint8), ex.kv[:, :, 30:32].view(torch.uint8))
    nxt = ids(8, 1)
    a = ex.step(Step([chunk(2, nxt, 8, [30, 31, 32], want_logits=True)]))
    b = ex.step(Step([chunk(4, nxt, 8, [50, 51, 52], want_logits=True)]))  # reads the copies
    assert torch.equal(a.logits[2], b.logits[4])


def test_fp8_logits_stay_near_float_kv(tiny_hf):
    """Teacher-forced rows at 512+ positions: top-1 agreement and the logits' relative error
    against float32 KV, within the bounds measured on this kind of random model
    (benchmarks/results/kv_fp8_accuracy_2026-12-07, rows after 8,192 positions: relative error
    0.16-0.17, top-1 0.61-0.66 on the near-flat logits of random weights, where bf16
    activations alone give 0.045 and 0.84-0.89).
    A wrong scale or a misread byte lands far outside (relative error ~1, top-1 ~0)."""
    prompt = ids(9, 576)
    blocks = list(range(-(-576 // 16)))
    results = {}
    for kv in ("auto", "fp8"):
        ex = TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", block_size=16, kv_cache_dtype=kv)
        ex.allocate_kv(len(blocks))
        ex.step(Step([SeqChunk(1, prompt[:512], list(range(512)), blocks)]))
        out = ex.step(Step([SeqChunk(1, prompt[512:], list(range(512, 576)), blocks, logit_rows=True)]))
        results[kv] = out.logits[1].float()
    ref, got = results["auto"], results["fp8"]
    relative = float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).mean())
    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert 1e-3 < relative < 0.35, relative
    assert top1 >= 0.35, top1


def test_the_kv_cache_dtype_reaches_the_executor_and_bad_values_are_refused(tiny_hf):
    from musegl_cuda.plugin import create_torch_cpu

    ex = create_torch_cpu(ExecutorOptions(model=str(tiny_hf.path), kv_cache_dtype="fp8"))
    assert ex.kv_cache_dtype == "fp8" and ex.kv_scales is not None
    assert all(layer.self_attn.kv_scales is not None for layer in ex.model.layers)
    ex.close()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", kv_cache_dtype="fp16")


def _interpreted(call: str) -> None:
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import torch; from kv_fp8_checks import *; {call}"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow  # Triton's interpreter (~20 s on two shared cores)
def test_the_store_kernel_writes_torch_s_e4m3_bytes_in_the_interpreter():
    pytest.importorskip("triton")
    _interpreted("check_fp8_store('cpu', torch.float32)")


@pytest.mark.slow  # Triton's interpreter, 2 tile sizes x sliding/global x 1 and 3 splits (~60 s)
def test_paged_attention_reads_e4m3_in_the_interpreter():
    pytest.importorskip("triton")
    _interpreted("check_fp8_attention('cpu', torch.float32)")


@pytest.mark.slow  # spawns two rank processes (gloo on the CPU)
def test_tensor_parallel_ranks_store_fp8_like_one_executor(tiny_hf):
    """Two ranks (one KV head each) with --kv-cache-dtype fp8: each rank's scales are the
    single executor's for its heads, the pool's block bytes are FP8's, and the logits match
    the single FP8 executor's to float rounding (far inside FP8's own distance from float KV)."""
    from musegl_cuda.parallel.executor import TensorParallelExecutor
    from musegl_cuda.parallel.rank import RankSpec

    prompt = ids(11, 40)
    blocks = [3, 0, 2]  # blocks of 16, the ranks' size
    single, auto = (TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", kv_cache_dtype=kv) for kv in ("fp8", "auto"))
    single.allocate_kv(16)
    auto.allocate_kv(16)
    parallel = TensorParallelExecutor(RankSpec(str(tiny_hf.path), "cpu", 2, kv_cache_dtype="fp8"))
    try:
        parallel.allocate_kv(16)
        assert parallel.kv_bytes_per_block() == single.kv_bytes_per_block()  # two halves on the CPU
        got = prefill_and_decode(parallel, prompt, 30, blocks)
    finally:
        parallel.close()
    want = prefill_and_decode(single, prompt, 30, blocks)
    exact = prefill_and_decode(auto, prompt, 30, blocks)
    fp8_error = max(float((a - b).abs().max()) for a, b in zip(want, exact))
    ranks = max(float((torch.as_tensor(a) - b).abs().max()) for a, b in zip(got, want))
    assert fp8_error > 1e-4 and ranks <= fp8_error / 10, (ranks, fp8_error)

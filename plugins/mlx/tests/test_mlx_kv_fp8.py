"""``--kv-cache-dtype fp8`` on MLX: e4m3 bytes and scales the torch executor's (the CPU reference)."""

from __future__ import annotations

import numpy as np
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import GREEDY, SeqChunk, Step
from musegl_core.plugins.specs import ExecutorOptions
from musegl_cuda.executor import TorchExecutor
from musegl_mlx.executor import MLXExecutor
from musegl_mlx.loader import checkpoint_weights
from musegl_mlx.plugin import kv_layout, musegl_executors

BLOCK = 4


def run(ex, prompt: list[int], cut: int, blocks: list[int]) -> list[np.ndarray]:
    """Prefill ``prompt[:cut]``, then one row a step: the logits after each."""
    def step(tokens, start):
        chunk = SeqChunk(seq=1, tokens=tokens, positions=list(range(start, start + len(tokens))), blocks=blocks,
                         sampling=GREEDY, want_logits=True)
        return np.asarray(ex.step(Step([chunk])).logits[1], dtype=np.float32)

    out = [step(prompt[:cut], 0)]
    for p in range(cut, len(prompt)):
        out.append(step([prompt[p]], p))
    return out


def test_mlx_fp8_kv_matches_the_torch_reference(tiny_hf):
    prompt = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    blocks = [5, 1, 7, 3, 0, 2, 6, 4]
    checkpoint = load_checkpoint(tiny_hf.path)
    mlx = MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype="float32",
                      block_size=BLOCK, kv_cache_dtype="fp8")
    mlx.allocate_kv(8)
    ref = TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", block_size=BLOCK, kv_cache_dtype="fp8")
    ref.allocate_kv(8)
    auto = TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", block_size=BLOCK)
    auto.allocate_kv(8)
    got, want, exact = run(mlx, prompt, 20, blocks), run(ref, prompt, 20, blocks), run(auto, prompt, 20, blocks)
    for layer in range(6):
        assert np.array_equal(np.array(mlx.model.layers[layer].kv_scales), ref.kv_scales[layer].numpy())
    k0 = np.array(mlx.kv[0][0]).reshape(8, BLOCK, 2, 16)
    assert np.array_equal(k0, ref.kv[0, 0].view(torch.uint8).numpy())  # layer 0: the same bytes
    fp8_error = max(float(np.abs(a - b).max()) for a, b in zip(want, exact))
    backends = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
    assert fp8_error > 1e-4 and backends <= fp8_error / 10, (backends, fp8_error)


def test_mlx_accounts_and_offers_fp8(tiny_hf):
    auto, _ = kv_layout(ExecutorOptions(model=str(tiny_hf.path), dtype="float32"))
    fp8, _ = kv_layout(ExecutorOptions(model=str(tiny_hf.path), dtype="float32", kv_cache_dtype="fp8"))
    assert auto == 4 * fp8
    assert musegl_executors()[0].kv_cache_dtypes == ("auto", "fp8")

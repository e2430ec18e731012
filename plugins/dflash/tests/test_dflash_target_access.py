"""DFlash borrows the target's embedding and head through the contract's TargetAccess:
the torch executor lends its own tensors (the draft runs on its device and dtype), the
MLX executor lends MLX arrays (converted), and an executor without the interface makes
the draft read them from the checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import target_access
from musegl_core.plugins.specs import ExecutorOptions
from musegl_core.testing.example_executor import ExampleExecutor
from musegl_dflash.loader import target_head


@pytest.fixture(scope="module")
def weights(tiny_hf):
    checkpoint = load_checkpoint(tiny_hf.path)
    try:
        return checkpoint.read("embed_tokens.weight"), checkpoint.read("lm_head.weight")
    finally:
        checkpoint.close()


def check_head(head, weights, atol):
    embed, lm_head = weights
    ids = torch.tensor([[3, 17, 500], [0, 1, 2]])
    rows = head.rows(ids)
    assert tuple(rows.shape) == (2, 3, embed.shape[1])
    np.testing.assert_allclose(rows.float().numpy(), embed[ids.numpy()], atol=atol, rtol=0)
    hidden = torch.from_numpy(np.random.default_rng(0).standard_normal((5, embed.shape[1])).astype(np.float32))
    logits = head.logits(hidden.to(rows.dtype))
    np.testing.assert_allclose(logits.float().numpy(), hidden.numpy() @ lm_head.T, atol=atol, rtol=0)


@pytest.mark.parametrize("weights_mode", ["upcast", "stored"])
def test_the_torch_executor_lends_its_own_embedding_and_head(tiny_hf, weights, weights_mode):
    from musegl_cuda.executor import TorchExecutor

    executor = TorchExecutor(load_checkpoint(tiny_hf.path), device="cpu", weights=weights_mode)
    assert target_access(executor) is executor
    head, device, dtype = target_head(executor, ExecutorOptions(model=str(tiny_hf.path), dtype="bfloat16"))
    assert (device, dtype) == (executor.device, executor.dtype)  # the executor's placement, not the options'
    assert head.rows.__self__ is executor and head.logits.__self__ is executor
    check_head(head, weights, atol=1e-5)


@pytest.mark.parametrize("mlx_dtype, atol", [("float32", 1e-5), ("bfloat16", 5e-2)])
def test_the_mlx_executor_lends_its_tables(tiny_hf, weights, mlx_dtype, atol):
    pytest.importorskip("mlx.core")
    from musegl_mlx.executor import MLXExecutor
    from musegl_mlx.loader import checkpoint_weights

    checkpoint = load_checkpoint(tiny_hf.path)
    executor = MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype=mlx_dtype)
    checkpoint.close()
    assert target_access(executor) is executor
    head, device, dtype = target_head(executor, ExecutorOptions(model=str(tiny_hf.path)))
    assert (device.type, dtype) == ("cpu", torch.float32)  # the options' placement: not a torch executor
    check_head(head, weights, atol=atol)


def test_without_target_access_the_draft_reads_the_checkpoint(tiny_hf, weights):
    executor = ExampleExecutor(512)
    assert target_access(executor) is None
    head, device, dtype = target_head(executor, ExecutorOptions(model=str(tiny_hf.path)))
    assert (device.type, dtype) == ("cpu", torch.float32)
    check_head(head, weights, atol=1e-6)

"""Tensor parallelism on CUDA GPUs (NCCL): marked ``gpu``, skipped unless torch sees 2 or more GPUs.

On a small random GGUF (8 query heads, 2 KV heads: 4 and 8 ranks replicate KV heads):

* eager float32: N ranks against one GPU, prefill logits and decode steps (no graphs);
* graphs: every rank captures the same decode graphs with the all-reduces and the
  logits gather inside; graph steps (greedy and seeded, one row per sequence, and
  pipelined launches whose chunks follow the previous step's ids) give the ids of the
  same ranks run eagerly, and logits close to them; bf16 (the CUDA default).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checkpoint_support import write_gpu_checkpoint
from step_support import chunk, decode_run

torch = pytest.importorskip("torch")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs"),
]

SIZES = [s for s in (2, 4, 8) if s <= max(GPUS, 2)]
BLOCKS = 64


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory):
    return write_gpu_checkpoint(tmp_path_factory.mktemp("tp_gpu"))


def parallel(path, size, dtype, forward_sizes):
    from musegl_cuda.parallel.executor import TensorParallelExecutor
    from musegl_cuda.parallel.rank import RankSpec

    ex = TensorParallelExecutor(RankSpec(str(path), "cuda", size, dtype=dtype, forward_sizes=forward_sizes))
    ex.allocate_kv(BLOCKS)
    return ex


def prompt(seed, n):
    return np.random.default_rng(seed).integers(3, 4096, n).tolist()


@pytest.mark.parametrize("size", SIZES)
def test_eager_float32_ranks_match_one_gpu(checkpoint_path, size):
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import Step
    from musegl_cuda.executor import TorchExecutor

    torch.backends.cuda.matmul.allow_tf32 = False
    single = TorchExecutor(load_checkpoint(checkpoint_path), device="cuda:0", dtype="float32", forward_sizes=())
    single.allocate_kv(BLOCKS)
    ex = parallel(checkpoint_path, size, "float32", ())
    try:
        tokens = prompt(1, 100)
        blocks = list(range(8))
        a = single.step(Step([chunk(1, tokens, 0, blocks, logit_rows=True, sample=1)]))
        b = ex.step(Step([chunk(1, tokens, 0, blocks, logit_rows=True, sample=1)]))
        assert float((a.logits[1].float().cpu() - b.logits[1]).abs().max()) < 2e-3
        assert a.tokens == b.tokens
        last = a.tokens[1][0]
        for p in range(100, 116):
            a = single.step(Step([chunk(1, [last], p, blocks, want_logits=True, sample=1)]))
            b = ex.step(Step([chunk(1, [last], p, blocks, want_logits=True, sample=1)]))
            assert a.tokens == b.tokens, p
            assert float((a.logits[1].float().cpu() - b.logits[1]).abs().max()) < 2e-3
            last = a.tokens[1][0]
    finally:
        ex.close()
        single.close()


def decode_seqs(ex, seqs, steps, pipelined):
    """Prefill ``seqs`` sequences (odd ones sample with a seed, even ones are greedy), then
    ``steps`` decode steps of one row per sequence (a graph width); ``pipelined``: each
    step is launched before the previous one is read, its chunks following that step's ids."""
    from musegl_core.engine.executor import SamplingParams

    settings = {s: {"sampling": SamplingParams(temperature=0.8, top_p=0.9, seed=s)} if s % 2 else {}
                for s in range(seqs)}
    return decode_run(ex, {s: prompt(10 + s, 40 + s) for s in range(seqs)},
                      {s: [4 * s + i for i in range(4)] for s in range(seqs)}, settings, steps, pipelined, width=seqs)


@pytest.mark.parametrize("size", SIZES)
def test_graphs_with_collectives_inside_replay_the_eager_steps(checkpoint_path, size):
    eager = parallel(checkpoint_path, size, "bfloat16", ())
    try:
        want = decode_seqs(eager, 4, 12, pipelined=False)
    finally:
        eager.close()
    graphs = parallel(checkpoint_path, size, "bfloat16", (1, 2, 4, 8))
    try:
        assert graphs.limits.step_sizes == (1, 2, 4, 8)
        assert decode_seqs(graphs, 4, 12, pipelined=False) == want
        assert decode_seqs(graphs, 4, 12, pipelined=True) == want
    finally:
        graphs.close()
